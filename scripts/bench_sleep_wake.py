"""Sleep/wake benchmark (the same as ``residency bench``); see lifecycle/bench.py."""

import sys

from lifecycle.bench import main

sys.exit(main())
