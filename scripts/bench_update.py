"""Weight-update benchmark (also ``python -m lifecycle.bench_update``); see lifecycle/bench_update.py."""

import sys

from lifecycle.bench_update import main

sys.exit(main())
