"""scripts/mutate_cuda.py's list follows the code: every planted bug's anchor occurs exactly
once in its file, so a change to a wait that forgets the list fails here, not months later
when someone runs the mutation check."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutate_cuda", ROOT / "scripts" / "mutate_cuda.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look themselves up there)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


def test_every_mutants_anchor_occurs_once_in_its_file_and_its_mutation_changes_it() -> None:
    script = load()
    mutants = [*script.MUTANTS, *script.PROTOCOL]
    assert len({m.name for m in mutants}) == len(mutants) >= 25
    for m in mutants:
        source = (ROOT / m.path).read_text()
        assert source.count(m.old) == 1, (m.name, m.path)
        assert script.mutated(m, source) != source, m.name
