"""The ranks' ops (lifecycle.http._ops): one typed dataclass each, in one table both sides
use; what rank 0 posts is what every other rank reads back."""

from __future__ import annotations

import dataclasses
import json
import typing
from typing import Any

import pytest

from lifecycle import DistributedUpdate, RefusedBroadcast
from lifecycle.http._ops import OPS, Op, UpdateFromDistributed

#: A value of each field type an op has (JSON-able, as rank 0 posts them).
_SAMPLES: dict[str, Any] = {
    "str": "x", "int": 3, "float": 1.5, "bool": True, "str | None": None,
    "list[str] | None": ["transformer"], "list[str]": ["a.weight"], "dict[str, str]": {"a": "b"},
    "dict[str, int]": {"1": 0}, "dict[str, Any]": {"group_name": "g"},
    "list[list[int]]": [[2, 3]], "Discard": ["vae"],
    "Broadcast": DistributedUpdate.parse(
        {"names": ["a.weight"], "dtypes": ["bfloat16"], "shapes": [[2, 3]], "lora_rank": 4,
         "weight_update_mode": "lora_merge", "bucket_bytes": 64, "weight_version": "7"})}


def _sample(op: type[Op[Any]]) -> Op[Any]:
    hints = {f.name: f.type for f in dataclasses.fields(op)}
    return op(**{name: _SAMPLES[str(hint)] for name, hint in hints.items()})


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_op_read_back_from_its_json_is_the_op_posted(name: str) -> None:
    """Each op's to_json survives JSON (the store's format) and from_json gives it back equal:
    the two sides share one definition of every op's arguments."""
    op = _sample(OPS[name])
    posted = json.loads(json.dumps(op.to_json()))
    assert posted["op"] == name == op.name
    assert OPS[posted["op"]].from_json(posted["args"]) == op


def test_the_op_table_names_every_op_once_and_each_runs_on_a_rank() -> None:
    """The table is every Op subclass by its name; each one defines how it runs."""
    assert len(OPS) == len({cls.name for cls in OPS.values()})
    for name, cls in OPS.items():
        assert cls.run is not Op.run, name
        assert typing.get_type_hints(cls.run)  # typed: what it returns rank 0 uses as is


def test_a_refused_broadcast_travels_to_every_rank_as_posted() -> None:
    """A distributed update refused for a field (every rank still receives its broadcast)
    reads back on the other ranks as the same refusal, naming the same field; so does one
    whose tensor list could not be read (the ranks break the group instead)."""
    for body in ({"names": ["a"], "dtypes": ["float32"], "shapes": [[1]], "timeout": 0},
                 {"names": ["a"], "dtypes": ["float33"], "shapes": [[1]]}):
        refusal = DistributedUpdate.parse(body)
        assert isinstance(refusal, RefusedBroadcast)
        op = UpdateFromDistributed(refusal, 5.0)
        posted = json.loads(json.dumps(op.to_json()))
        assert OPS[posted["op"]].from_json(posted["args"]) == op
