"""``python -m lifecycle``: the ``residency`` command."""

import sys

from .cli import main

sys.exit(main())
