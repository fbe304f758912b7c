"""The deep profile of the model-based stateful test (thousands of examples, both backends).

    python scripts/deep_stateful.py [pytest options]
"""

import os
import sys
from pathlib import Path

import pytest

os.environ["HYPOTHESIS_PROFILE"] = "deep"
root = Path(__file__).resolve().parents[1]
sys.exit(pytest.main([str(root / "tests/lifecycle/test_stateful.py"), "-q", *sys.argv[1:]]))
