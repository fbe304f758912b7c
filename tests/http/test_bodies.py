"""How an upload's body is read without copies: long strings stay in the body's buffer as
views (parsed exactly as JSON would), and base64 is decoded in place, 64-byte aligned."""

from __future__ import annotations

import base64
import ctypes
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lifecycle.http._bodies import SPAN_MIN, BadRequest, Span, parse
from lifecycle.payload import TransportError, decode_base64

_short = st.text(max_size=12)
# At least SPAN_MIN characters: a short random unit repeated (drawing 4096 characters one by
# one is slow), then a random tail.
_long = st.tuples(st.text(alphabet=st.sampled_from("AZaz09+/=\"\\é\u2603\U0001f600 "),
                          min_size=1, max_size=6), _short).map(
    lambda parts: parts[0] * (SPAN_MIN // len(parts[0]) + 1) + parts[1])
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | _short | _long,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_short | _long, inner, max_size=3),
    max_leaves=6)


def _plain(value: Any) -> Any:
    """``value`` with every :class:`Span` read back as the string it stands for."""
    if isinstance(value, Span):
        return json.loads(b'"' + bytes(value.view) + b'"')
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.dictionaries(_short | _long, _json, max_size=4), ascii_only=st.booleans())
def test_long_strings_become_views_and_the_rest_parses_as_json_does(
        body: dict[str, Any], ascii_only: bool) -> None:
    """Whatever the body (quotes, backslashes, any Unicode, long keys): reading it with spans
    gives what json.loads gives, long escape-free strings as views of the buffer."""
    raw = bytearray(json.dumps(body, ensure_ascii=ascii_only).encode())
    parsed = parse(raw, spans=len(raw) + 1)
    assert _plain(parsed) == body


def test_the_json_around_the_long_strings_is_bounded() -> None:
    """An upload whose JSON outside its long strings is over the limit: 413 before parsing."""
    raw = bytearray(json.dumps({"serialized_named_tensors": ["A" * 10_000],
                                "pad": list(range(1000))}).encode())
    with pytest.raises(BadRequest) as caught:
        parse(raw, spans=1000)
    assert caught.value.status == 413 and "outside its long strings" in str(caught.value)
    assert isinstance(parse(raw, spans=len(raw))["serialized_named_tensors"][0], Span)


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=5000), prefix=st.integers(0, 70))
def test_base64_decodes_in_place_aligned_or_into_a_new_buffer(data: bytes, prefix: int) -> None:
    """A writable view is decoded over its own text, starting 64-byte aligned when there is
    room; text and bytes decode into a new buffer; both give base64.b64decode's bytes."""
    text = base64.b64encode(data)
    if not data:
        with pytest.raises(TransportError, match="empty"):
            decode_base64(text)
        return
    assert bytes(decode_base64(text)) == data == bytes(decode_base64(text.decode()))
    buffer = bytearray(b"x" * prefix + text)
    out = decode_base64(memoryview(buffer)[prefix:])
    assert bytes(out) == data
    address = ctypes.addressof(ctypes.c_char.from_buffer(out))
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert start + prefix <= address < start + prefix + 64  # in place
    if len(text) - len(data) >= 64:
        assert address % 64 == 0


@pytest.mark.parametrize("text", ["QUJD=", "QU=D", "QUJD\n", "é===", "QUJ\x00"])
def test_bad_base64_is_refused(text: str) -> None:
    """Wrong length, padding inside, whitespace, non-ASCII, NUL: not valid base64."""
    with pytest.raises(TransportError, match="not valid base64"):
        decode_base64(text)
    with pytest.raises(TransportError, match="not valid base64"):
        decode_base64(memoryview(bytearray(text.encode())))
