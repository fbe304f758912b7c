"""Weight-update benchmark (the same as ``residency bench update``); see lifecycle/bench_update.py."""

import sys

from lifecycle.bench_update import main

sys.exit(main())
