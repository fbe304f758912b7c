"""The opcode pre-scan: what a pickle may make the unpickler do, read before it runs.

Every opcode is read once (:func:`scan`): only the opcodes torch's picklers write are admitted,
memo indices may not skip ahead (one 6-byte ``LONG_BINPUT`` would otherwise make the unpickler
zero a memo array of gigabytes), frames are small, and the objects the pickle may build are
costed against a budget of a constant plus a small multiple of its size. Large byte strings
are reported, so that the unpickler gets them out of band (views of the payload, not copies).
"""

from __future__ import annotations

import dataclasses
import pickle
import pickletools
from collections.abc import Mapping

from ._errors import refuse

# --------------------------------------------------------------------------------------------
# The opcode check: what a pickle may make the unpickler do, read before it runs.
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Op:
    name: str
    fixed: int = 0      # bytes of a fixed-size argument
    counted: int = 0    # bytes of the little-endian length of a counted argument
    cost: int = 16      # bytes the unpickler may keep for it (plus a counted argument's length)


# Only what torch's and Python's picklers write for tensors, storages, handles, lists, dicts
# and tuples (protocols 2 to 5, binary opcodes): no text opcodes (protocol 0), no sets, no
# extension registry, no out-of-band buffers, no DUP, no NEWOBJ_EX / INST / OBJ, no persistent
# ids (but in torch's legacy storage pickles). Costs are generous estimates of what the
# unpickler allocates (object, stack slot, container slot).
_OPCODES: Mapping[int, _Op] = {
    0x80: _Op("PROTO", fixed=1, cost=0),
    0x95: _Op("FRAME", fixed=8, cost=0),
    ord("."): _Op("STOP", cost=0),
    ord("("): _Op("MARK"),
    ord("0"): _Op("POP", cost=0),
    ord("1"): _Op("POP_MARK", cost=0),
    ord("N"): _Op("NONE", cost=24),
    0x88: _Op("NEWTRUE", cost=24),
    0x89: _Op("NEWFALSE", cost=24),
    ord("J"): _Op("BININT", fixed=4, cost=48),
    ord("K"): _Op("BININT1", fixed=1, cost=48),
    ord("M"): _Op("BININT2", fixed=2, cost=48),
    0x8A: _Op("LONG1", counted=1, cost=64),
    0x8B: _Op("LONG4", counted=4, cost=64),
    ord("G"): _Op("BINFLOAT", fixed=8, cost=48),
    0x8C: _Op("SHORT_BINUNICODE", counted=1, cost=96),
    ord("X"): _Op("BINUNICODE", counted=4, cost=96),
    0x8D: _Op("BINUNICODE8", counted=8, cost=96),
    ord("C"): _Op("SHORT_BINBYTES", counted=1, cost=64),
    ord("B"): _Op("BINBYTES", counted=4, cost=64),
    0x8E: _Op("BINBYTES8", counted=8, cost=64),
    ord("]"): _Op("EMPTY_LIST", cost=96),
    ord("}"): _Op("EMPTY_DICT", cost=128),
    ord(")"): _Op("EMPTY_TUPLE", cost=24),
    ord("l"): _Op("LIST", cost=96),
    ord("d"): _Op("DICT", cost=128),
    ord("t"): _Op("TUPLE", cost=64),
    0x85: _Op("TUPLE1", cost=64),
    0x86: _Op("TUPLE2", cost=72),
    0x87: _Op("TUPLE3", cost=80),
    ord("a"): _Op("APPEND"),
    ord("e"): _Op("APPENDS"),
    ord("s"): _Op("SETITEM", cost=64),
    ord("u"): _Op("SETITEMS", cost=64),
    ord("q"): _Op("BINPUT", fixed=1),
    ord("r"): _Op("LONG_BINPUT", fixed=4),
    0x94: _Op("MEMOIZE"),
    ord("h"): _Op("BINGET", fixed=1, cost=32),
    ord("j"): _Op("LONG_BINGET", fixed=4, cost=32),
    ord("c"): _Op("GLOBAL", cost=128),
    0x93: _Op("STACK_GLOBAL", cost=128),
    ord("R"): _Op("REDUCE", cost=1024),
    ord("b"): _Op("BUILD", cost=256),
    0x81: _Op("NEWOBJ", cost=256),
    ord("Q"): _Op("BINPERSID", cost=256),  # legacy storage pickles only
}
_BYTES_OPS = frozenset({ord("C"), ord("B"), 0x8E})
_MAX_FRAME = 2**20
_MAX_OPS = 1_000_000
# A pickle may make the unpickler hold at most this, plus _COST_PER_BYTE times its size.
_COST_BASE = 32 * 2**20
_COST_PER_BYTE = 2
_LEGACY_MAX = 64 * 2**10  # each small pickle of the legacy storage format
# Byte strings at least this long (outside frames, which hold only small ones) are handed to
# the unpickler out of band: a view of the payload instead of a copy.
_OUT_OF_BAND = 64 * 2**10


def scan(data: memoryview, start: int = 0, *, legacy: bool = False
          ) -> tuple[int, list[tuple[int, int, int]]]:
    """Read the pickle starting at ``start`` up to its STOP without running it; returns the
    offset after STOP and the large byte strings as ``(opcode offset, start, end)``. Raises
    :class:`TransportError` for an opcode that is not admitted, a memo index that skips ahead,
    a truncated argument, a large frame, or more objects than the budget allows."""
    end = len(data) if not legacy else min(len(data), start + _LEGACY_MAX)
    budget = _COST_BASE + _COST_PER_BYTE * (end - start) if not legacy else 2**20
    pos, cost, ops, memo, frame_end = start, 0, 0, 0, start
    large: list[tuple[int, int, int]] = []
    while True:
        if pos >= end:
            refuse("the pickle ends before its STOP opcode" if end == len(data) else
                    f"a pickle of the legacy storage format is over {_LEGACY_MAX} bytes")
        code = data[pos]
        op = _OPCODES.get(code)
        if op is None or (op.name == "BINPERSID" and not legacy):
            name = _OPCODE_NAMES.get(code, "an unknown opcode")
            refuse(f"the pickle uses {name} (0x{code:02x}) at byte {pos}, which is not allowed: "
                    "only the opcodes torch's picklers write are")
        ops += 1
        if ops > _MAX_OPS:
            refuse(f"the pickle has more than {_MAX_OPS:,} opcodes")
        at = pos
        pos += 1
        arg = 0
        if op.fixed:
            if pos + op.fixed > end:
                refuse(f"the pickle is truncated in {op.name} at byte {at}")
            arg = int.from_bytes(data[pos:pos + op.fixed], "little")
            pos += op.fixed
        elif op.counted:
            if pos + op.counted > end:
                refuse(f"the pickle is truncated in {op.name} at byte {at}")
            arg = int.from_bytes(data[pos:pos + op.counted], "little")
            pos += op.counted
            if arg > end - pos:
                refuse(f"{op.name} at byte {at} declares {arg} bytes, past the end of the pickle")
            if code in _BYTES_OPS and not legacy and arg >= _OUT_OF_BAND and pos >= frame_end:
                large.append((at, pos, pos + arg))  # a view, not a copy
            else:
                cost += arg
            pos += arg
        elif op.name == "GLOBAL":
            for _ in range(2):
                line = bytes(data[pos:min(pos + 257, end)])
                newline = line.find(b"\n")
                if newline < 0:
                    refuse(f"GLOBAL at byte {at} has no name of at most 256 characters")
                pos += newline + 1
        cost += op.cost
        if cost > budget:
            refuse(f"the pickle would make the unpickler hold over {budget // 2**20} MiB "
                    f"({ops:,} opcodes in {end - start:,} bytes); refused")
        if op.name == "STOP":
            return pos, large
        if op.name == "PROTO" and arg > pickle.HIGHEST_PROTOCOL:
            refuse(f"the pickle's protocol {arg} is not supported")
        elif op.name == "FRAME":
            if arg > _MAX_FRAME or arg > end - pos:
                refuse(f"the pickle has a frame of {arg} bytes; at most {_MAX_FRAME} inside it")
            frame_end = pos + arg
        elif op.name in ("BINPUT", "LONG_BINPUT"):
            # The unpickler makes room for index * 2 entries, zeroed: no skipping ahead.
            if arg > memo:
                refuse(f"{op.name} at byte {at} stores memo entry {arg} after {memo} entries")
            memo += arg == memo
        elif op.name == "MEMOIZE":
            memo += 1


_OPCODE_NAMES = {ord(op.code): op.name for op in pickletools.opcodes}
