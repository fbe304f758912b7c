"""Decoding ``update_weights_from_tensor`` payloads: safetensors, the reference's pickles, and
pickles that try to run code (refused before anything runs)."""

from __future__ import annotations

import base64
import builtins
import collections
import importlib
import io
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_sharer
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.multiprocessing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.multiprocessing import reductions

from lifecycle.payload import LOAD_FORMATS, TransportError, decode_named_tensors
from tests.http.clients import REFERENCE_MODULE, bucket, reference_metadata_class

pytestmark = pytest.mark.service


def _b64(data: bytes | memoryview) -> str:
    return base64.b64encode(bytes(data)).decode()


def _forking(obj: object) -> str:
    """What SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` sends."""
    return _b64(ForkingPickler.dumps(obj))


def _pairs() -> list[tuple[str, torch.Tensor]]:
    return [
        ("layer.weight", torch.arange(6, dtype=torch.float32).reshape(2, 3)),
        ("layer.bias", torch.tensor([1.5, -2.0, 3.25], dtype=torch.bfloat16)),
        ("empty", torch.zeros(0, 4)),
        ("strided", torch.arange(10)[::2]),
        ("param", torch.nn.Parameter(torch.ones(2, 2))),
        ("mask", torch.tensor([True, False, True])),
    ]


def _assert_same(got: list[tuple[str, torch.Tensor]], sent: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in sent]
    for (_, g), (_, s) in zip(got, sent, strict=True):
        assert type(g) is torch.Tensor
        assert g.dtype == s.dtype and g.shape == s.shape and not g.requires_grad
        assert torch.equal(g, s.detach())


@pytest.fixture(params=["file_descriptor", "file_system"])
def sharing_strategy(request: pytest.FixtureRequest) -> Iterator[str]:
    before = torch.multiprocessing.get_sharing_strategy()  # type: ignore[no-untyped-call]
    torch.multiprocessing.set_sharing_strategy(request.param)  # type: ignore[no-untyped-call]
    yield str(request.param)
    torch.multiprocessing.set_sharing_strategy(before)  # type: ignore[no-untyped-call]


class _Call:
    """Pickles as ``fn(*args)``: how a hostile payload makes the unpickler call something."""

    def __init__(self, fn: object, *args: object) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[object, ...]]:
        return self.fn, self.args

    def __call__(self) -> None:  # pickle insists that the reduce function be callable
        raise AssertionError("never called")


def _global_call(module: str, name: str, *args: object) -> bytes:
    """A pickle calling ``module.name(*args)``, written by hand: the name need not be importable."""
    body = pickle.dumps(args, protocol=3)  # b"\x80\x03" <the args tuple> b"." (3: bytes, no frames)
    return b"\x80\x03c" + f"{module}\n{name}\n".encode() + body[2:-1] + b"R."


# --------------------------------------------------------------------------------------------
# Safetensors.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("load_format", ["safetensors", None])
def test_safetensors_round_trip_keeps_values_dtypes_and_file_order(load_format: str | None) -> None:
    """A safetensors file comes back tensor for tensor, in the file's order, named or sniffed."""
    wide = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    tensors = {
        "f32": torch.randn(2, 3),
        "bf16": torch.randn(4, dtype=torch.bfloat16),
        "f16": torch.randn(2, 2, dtype=torch.float16),
        "i64": torch.arange(5),
        "u8": torch.arange(7, dtype=torch.uint8),
        "bool": torch.tensor([True, False]),
        "empty": torch.zeros(0, 3),
        "transposed": wide.T.contiguous(),  # non-contiguous input, made contiguous by the client
    }
    data = safetensors.torch.save(tensors)
    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + header_len])
    file_order = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])

    got = decode_named_tensors(_b64(data), load_format)

    assert [name for name, _ in got] == file_order
    for name, tensor in got:
        assert tensor.dtype == tensors[name].dtype
        assert torch.equal(tensor, tensors[name])
    assert torch.equal(dict(got)["transposed"], wide.T)


# --------------------------------------------------------------------------------------------
# The reference's pickles, built as its clients build them.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("load_format", ["direct", None])
def test_forking_pickler_pairs_decode_under_each_sharing_strategy(
    sharing_strategy: str, load_format: str | None
) -> None:
    """ForkingPickler's shared-memory pickles of (name, tensor) pairs decode to equal plain tensors."""
    sent = _pairs()
    _assert_same(decode_named_tensors(_forking(sent), load_format), sent)


def test_plain_pickle_of_pairs_decodes_to_equal_tensors() -> None:
    """``pickle.dumps`` of a list of pairs (data inline, no shared memory) decodes too."""
    sent = _pairs()
    _assert_same(decode_named_tensors(_b64(pickle.dumps(sent)), "direct"), sent)


def test_flattened_bucket_of_bytes_decodes_like_the_reference(sharing_strategy: str) -> None:
    """Today's uint8 bucket of mixed dtypes decodes, with no sglang module importable."""
    sent = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(2, 4, dtype=torch.bfloat16)),
        ("c", torch.arange(6, dtype=torch.int64).reshape(3, 2)),
        ("d", torch.zeros(0, 2)),
    ]
    with reference_metadata_class() as meta_cls:
        payload = _forking(bucket(sent, meta_cls, as_bytes=True))
    assert REFERENCE_MODULE not in sys.modules
    _assert_same(decode_named_tensors(payload, "flattened_bucket"), sent)


def test_flattened_bucket_of_one_dtype_decodes_like_the_older_reference() -> None:
    """The older bucket (one dtype, no byte view, numel in elements) decodes too."""
    sent = [("x", torch.randn(2, 3)), ("y", torch.randn(5)), ("z", torch.randn(1, 1, 2))]
    with reference_metadata_class() as meta_cls:
        payload = _forking(bucket(sent, meta_cls, as_bytes=False))
    _assert_same(decode_named_tensors(payload, "flattened_bucket"), sent)


_SENDER = textwrap.dedent("""
    import base64, sys, torch, torch.multiprocessing as tmp
    from multiprocessing.reduction import ForkingPickler
    pairs = [("w", torch.arange(6.0).reshape(2, 3))]
    for strategy in ("file_system", "file_descriptor"):
        tmp.set_sharing_strategy(strategy)
        print(base64.b64encode(bytes(ForkingPickler.dumps(pairs))).decode(), flush=True)
    sys.stdin.readline()
""")


def test_pickles_from_another_process_decode_by_file_system_but_not_by_fd() -> None:
    """From an unrelated live sender, file_system segments map; fd passing fails authentication."""
    with subprocess.Popen([sys.executable, "-c", _SENDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as sender:
        assert sender.stdout is not None
        by_name, by_fd = sender.stdout.readline().strip(), sender.stdout.readline().strip()
        try:
            got = decode_named_tensors(by_name, None)
            with pytest.raises(TransportError, match=r"AuthenticationError.*authkey"):
                decode_named_tensors(by_fd, None)
        finally:
            sender.communicate("done\n", timeout=30)
    assert torch.equal(dict(got)["w"], torch.arange(6.0).reshape(2, 3))
    # The segment was copied, never mapped nor written: it goes when the sender's manager does.
    segment = b"/dev/shm" + re.findall(rb"/torch_[0-9A-Za-z_]+", base64.b64decode(by_name))[0]
    deadline = time.monotonic() + 20
    while os.path.exists(segment) and time.monotonic() < deadline:
        time.sleep(0.1)
    with pytest.raises(TransportError, match=r"segment cannot be used.*sender alive"):
        decode_named_tensors(by_name, None)


_CUDA_SENDER = textwrap.dedent("""
    import base64, pickle, sys, types, torch
    from multiprocessing.reduction import ForkingPickler
    from torch.multiprocessing import reductions
    tensor = torch.arange(8.0, device="cuda").reshape(2, 4)
    print(base64.b64encode(bytes(ForkingPickler.dumps([("w", tensor)]))).decode(), flush=True)
    # What a client with SGLang's monkey_patch_torch_reductions sends: its rebuild, a device UUID.
    module = types.ModuleType("sglang.srt.utils.patch_torch")
    def _rebuild_cuda_tensor_modified(*args): raise AssertionError("never called")
    _rebuild_cuda_tensor_modified.__module__ = module.__name__
    module._rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_modified
    for name in ("sglang", "sglang.srt", "sglang.srt.utils"):
        sys.modules[name] = types.ModuleType(name)
    sys.modules[module.__name__] = module
    _, args = reductions.reduce_tensor(tensor)
    args = (*args[:6], str(torch.cuda.get_device_properties(tensor.device).uuid), *args[7:])
    class Call:
        def __reduce__(self): return _rebuild_cuda_tensor_modified, args
    print(base64.b64encode(pickle.dumps([("w", Call())])).decode(), flush=True)
    sys.stdin.readline()
""")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_pairs_from_another_process_decode_by_index_or_sglang_uuid() -> None:
    """CUDA IPC pickles from a live sender decode, by torch's rebuild or SGLang's UUID-patched one."""
    expected = torch.arange(8.0).reshape(2, 4)
    with subprocess.Popen([sys.executable, "-c", _CUDA_SENDER], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as sender:
        assert sender.stdout is not None
        by_index, by_uuid = sender.stdout.readline().strip(), sender.stdout.readline().strip()
        try:
            for payload in (by_index, by_uuid):
                got = dict(decode_named_tensors(payload, None))["w"]
                assert got.is_cuda and torch.equal(got.cpu(), expected)
                del got
            torch.cuda.synchronize()
        finally:
            sender.communicate("done\n", timeout=60)


def _cuda_args(**changes: object) -> tuple[object, ...]:
    """Arguments of ``rebuild_cuda_tensor``, as ``reduce_tensor`` lays them out for a CUDA tensor."""
    args: dict[str, object] = dict(
        tensor_cls=torch.Tensor, size=(2,), stride=(1,), offset=0, storage_cls=torch.storage.TypedStorage,
        dtype=torch.float32, device=0, storage_handle=b"h" * 64, storage_size_bytes=8,
        storage_offset_bytes=0, requires_grad=False, ref_counter_handle=b"/torch_1_2_3",
        ref_counter_offset=0, event_handle=None, event_sync_required=False)
    args.update(changes)
    return tuple(args.values())


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"ref_counter_offset": 10_000}, "ref-counter offset is outside torch's counter file"),
        ({"ref_counter_handle": b"/dev/shm/../etc"}, "ref-counter handle is not a torch shared-memory"),
        ({"storage_cls": torch.Tensor}, "storage class must be torch.storage.TypedStorage or Untyped"),
        ({"size": (2, 3)}, "size and stride have different lengths"),
        ({"device": "GPU-00000000-0000-0000-0000-000000000000"},
         "no CUDA device|UUID this process cannot see"),
    ],
)
def test_cuda_ipc_arguments_are_checked_before_cuda_is_touched(
    changes: dict[str, object], message: str
) -> None:
    """Handles, offsets and devices of a CUDA IPC pickle are validated first, SGLang's name included."""
    for module, name in [("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
                         ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"),
                         ("sglang.srt.patch_torch", "_rebuild_cuda_tensor_modified")]:
        with pytest.raises(TransportError, match=message):
            decode_named_tensors(_b64(_global_call(module, name, *_cuda_args(**changes))), "direct")


# --------------------------------------------------------------------------------------------
# Hostile pickles: refused, and nothing ran.
# --------------------------------------------------------------------------------------------


def _hostile(marker: Path) -> dict[str, bytes]:
    touch = f"touch {marker}"
    side_effect = f"open({str(marker)!r}, 'w').close()"
    return {
        "os.system": _global_call("os", "system", touch),
        "posix.system": pickle.dumps(_Call(os.system, touch)),
        "nt.system": _global_call("nt", "system", touch),
        "builtins.eval": pickle.dumps(_Call(builtins.eval, side_effect)),
        "builtins.exec": pickle.dumps(_Call(builtins.exec, side_effect)),
        "subprocess.Popen": pickle.dumps(_Call(subprocess.Popen, ["touch", str(marker)])),
        "builtins.getattr": pickle.dumps(
            _Call(_Call(getattr, _Call(importlib.import_module, "os"), "system"), touch)),
        "importlib.import_module": pickle.dumps(_Call(importlib.import_module, "os")),
        "torch.serialization.load": pickle.dumps(_Call(torch.load, str(marker.with_suffix(".pt")))),
    }


@pytest.mark.parametrize("qualname", list(_hostile(Path("x"))))
@pytest.mark.parametrize("load_format", ["direct", None, "flattened_bucket"])
def test_pickle_naming_a_dangerous_global_is_refused_before_it_runs(
    qualname: str, load_format: str | None, tmp_path: Path
) -> None:
    """A pickle calling anything outside the allow-list is refused, naming it; nothing runs."""
    marker = tmp_path / "ran"
    torch.save(_Call(os.system, f"touch {marker}"), marker.with_suffix(".pt"))
    refused = rf"pickle refers to {re.escape(qualname)}, which is not allowed"
    with pytest.raises(TransportError, match=refused):
        decode_named_tensors(_b64(_hostile(marker)[qualname]), load_format)
    assert not marker.exists()


def test_hostile_item_nested_in_an_otherwise_valid_list_is_refused(tmp_path: Path) -> None:
    """One hostile entry among real (name, tensor) pairs refuses the whole payload; nothing runs."""
    marker = tmp_path / "ran"
    payload = pickle.dumps([("ok", torch.ones(2)), ("evil", _Call(os.system, f"touch {marker}")),
                            ("ok2", torch.zeros(1))])
    with pytest.raises(TransportError, match=r"posix\.system"):
        decode_named_tensors(_b64(payload), None)
    assert not marker.exists()


@pytest.mark.parametrize(("zipped", "message"), [
    (True, r"_load_from_bytes: not torch's legacy storage format.*zip archives"),
    (False, r"_load_from_bytes: the storage refers to posix\.system, which is not allowed"),
])
def test_storage_bytes_holding_a_hostile_pickle_are_refused_and_nothing_runs(
        tmp_path: Path, zipped: bool, message: str) -> None:
    """The storage bytes of a plain pickle are read as torch's legacy storage format, never by
    ``torch.load``: a zip archive, or a legacy file naming any other global, is refused."""
    marker = tmp_path / "ran"
    inner = io.BytesIO()
    torch.save(_Call(os.system, f"touch {marker}"), inner, _use_new_zipfile_serialization=zipped)
    payload = pickle.dumps([("w", _Call(torch.storage._load_from_bytes, inner.getvalue()))])
    with pytest.raises(TransportError, match=message):
        decode_named_tensors(_b64(payload), "direct")
    assert not marker.exists()


def test_setting_state_on_an_allowed_class_is_refused_and_torch_is_untouched() -> None:
    """``BUILD`` on ``torch.Tensor`` (a process-wide monkeypatch) is refused."""
    state = pickle.dumps((None, {"pwned": 1}), protocol=2)[2:-1]
    payload = b"\x80\x02ctorch\nTensor\n" + state + b"b."
    with pytest.raises(TransportError, match=r"set the state of torch\.Tensor"):
        decode_named_tensors(_b64(payload), "direct")
    assert not hasattr(torch.Tensor, "pwned")


def test_calling_a_class_token_is_refused_without_allocating() -> None:
    """``torch.storage.UntypedStorage(10**12)`` is refused: classes are tokens, not constructors."""
    payload = _global_call("torch.storage", "UntypedStorage", 10**12)
    with pytest.raises(TransportError, match=r"calls torch\.storage\.UntypedStorage"):
        decode_named_tensors(_b64(payload), "direct")


def _fd_pickle(ident: object) -> bytes:
    fd = object.__new__(resource_sharer.DupFd)
    fd._id = ident  # type: ignore[attr-defined]
    storage = _Call(reductions.rebuild_storage_fd, torch.UntypedStorage, fd, 8)
    typed = _Call(reductions.rebuild_typed_storage, storage, torch.float32)
    tensor = _Call(reductions.rebuild_tensor, torch.Tensor, typed, (0, (2,), (1,), False))
    return pickle.dumps([("w", tensor)])


@pytest.mark.parametrize("ident", [(("127.0.0.1", 9), 1), ("/var/run/docker.sock", 1),
                                   ("/tmp/pymp-x/../../run/listener-y", 1)])
def test_fd_sharing_state_naming_a_foreign_socket_is_refused(ident: object) -> None:
    """DupFd state must name a multiprocessing listener path: no TCP, no arbitrary sockets."""
    with pytest.raises(TransportError, match="not a multiprocessing listener socket path"):
        decode_named_tensors(_b64(_fd_pickle(ident)), "direct")


def test_shared_memory_request_larger_than_its_segment_is_refused() -> None:
    """A file_system handle may not ask for more bytes than its segment holds (torch would grow it)."""
    storage = torch.ones(4).untyped_storage()
    manager, handle, size = storage._share_filename_cpu_()
    too_big = _Call(reductions.rebuild_storage_filename, torch.UntypedStorage, manager, handle, size * 1000)
    payload = pickle.dumps([("w", _Call(reductions.rebuild_tensor, torch.Tensor,
                                        _Call(reductions.rebuild_typed_storage, too_big, torch.float32),
                                        (0, (4,), (1,), False)))])
    with pytest.raises(TransportError, match=r"segment cannot be used"):
        decode_named_tensors(_b64(payload), "direct")
    foreign = pickle.dumps(_Call(reductions.rebuild_storage_filename, torch.UntypedStorage, manager,
                                 b"/some_other_segment", 8))
    with pytest.raises(TransportError, match="not a torch shared-memory segment name"):
        decode_named_tensors(_b64(foreign), "direct")


# --------------------------------------------------------------------------------------------
# Bad inputs.
# --------------------------------------------------------------------------------------------


def _safetensors_bytes() -> bytes:
    return safetensors.torch.save({"w": torch.randn(4, 4), "b": torch.randn(4)})


@pytest.mark.parametrize(
    ("payload", "load_format", "message"),
    [
        ("not base64!!", None, r"not valid base64 \(12 characters\)"),
        ("aGVsbG8=\u00e9", "safetensors", "not valid base64"),
        ("", "direct", "empty"),
        (_b64(_safetensors_bytes()[:-5]), "safetensors", "not a valid safetensors file"),
        (_b64(_safetensors_bytes()[:-5]), None, "not a valid safetensors file"),
        (_b64(_safetensors_bytes()[:20]), None, "neither a safetensors file nor a pickle"),
        (_b64(b"\x80\x04garbage"), "direct", "neither a safetensors file nor a pickle"),
        (_b64(pickle.dumps({"w": torch.ones(1)})), "direct",
         r"Missing tensor payload for module\(s\): \['transformer'\]. Provided modules: \['w'\] "
         r"\(a dict of tensors is not a payload: send a list of \(name, tensor\) pairs\)"),
        (_b64(pickle.dumps({"flattened_tensor": torch.ones(1), "metadata": []})), "direct",
         r"Provided modules: \['flattened_tensor', 'metadata'\] \(a flattened bucket needs "
         r"load_format='flattened_bucket'\)"),
        (_b64(pickle.dumps({"transformer": {"w": torch.ones(1)}})), "direct",
         r"module 'transformer' \(load_format direct\): the pickle holds a dict; expected a list"),
        (_b64(pickle.dumps([("w", torch.ones(1))])), "flattened_bucket",
         "holds list; expected \\{'flattened_tensor'"),
        (_b64(pickle.dumps([(1, torch.ones(1))])), None, "item 0 has a name of type int"),
        (_b64(pickle.dumps([("w", 3.0)])), "direct", "item 0 \\('w'\\) must be a tensor, got float"),
        (_b64(pickle.dumps([("w", torch.ones(1), "x")])), "direct", "item 0 of the pickled list is tuple"),
        (_b64(pickle.dumps(torch.ones(1))), "direct", "the pickle holds a rebuilt tensor"),
        (_b64(_safetensors_bytes()), "pickle", "load_format 'pickle' is not supported; accepted: "),
    ],
)
def test_bad_input_is_refused_with_a_message_naming_the_problem(
    payload: str, load_format: str | None, message: str
) -> None:
    """Malformed entries, wrong shapes and unknown formats raise TransportError saying what is wrong."""
    with pytest.raises(TransportError, match=message):
        decode_named_tensors(payload, load_format)


def _bad_bucket(edit: Callable[[Any], None]) -> str:
    with reference_metadata_class() as meta_cls:
        made = bucket([("a", torch.randn(4)), ("b", torch.randn(2))], meta_cls, as_bytes=True)
        edit(made["metadata"])
        return _b64(pickle.dumps(made))


def _set(index: int, **fields: object) -> Callable[[Any], None]:
    def edit(metadata: Any) -> None:
        for key, value in fields.items():
            setattr(metadata[index], key, value)
    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (_set(1, end_idx=10_000, numel=10_000 - 16), r"metadata\[1\] \('b'\) spans \[16, 10000\), outside"),
        (_set(0, numel=3), r"metadata\[0\] \('a'\) has numel 3 but spans 16"),
        (_set(0, shape=torch.Size([5])), r"metadata\[0\] \('a'\): 16 elements of torch.uint8 do not make"),
        (_set(0, dtype="float32"), "FlattenedTensorMetadata.dtype must be a torch dtype, got str"),
        (_set(1, start_idx=-1), "FlattenedTensorMetadata.start_idx must be a non-negative int"),
        (_set(0, name=7), "FlattenedTensorMetadata.name must be a str, got int"),
        (_set(0, extra=1), "FlattenedTensorMetadata state must have exactly the fields"),
    ],
)
def test_flattened_bucket_with_bad_metadata_is_refused(edit: Callable[[Any], None], message: str) -> None:
    """Offsets outside the flat tensor, inconsistent sizes and mistyped fields are refused."""
    with pytest.raises(TransportError, match=message):
        decode_named_tensors(_bad_bucket(edit), "flattened_bucket")


# --------------------------------------------------------------------------------------------
# Property: arbitrary bytes.
# --------------------------------------------------------------------------------------------

_PREFIXES = [b"", b"\x80\x02", b"\x80\x04\x95", b"\x30\x00\x00\x00\x00\x00\x00\x00{", b"]\x94(\x8c"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prefix=st.sampled_from(_PREFIXES), body=st.binary(max_size=200),
       load_format=st.sampled_from(LOAD_FORMATS))
def test_arbitrary_bytes_raise_only_transport_error_and_run_nothing(
    prefix: bytes, body: bytes, load_format: str | None
) -> None:
    """Whatever the bytes, decoding returns or raises TransportError, and never reaches a shell."""
    ran: list[object] = []
    with pytest.MonkeyPatch.context() as mp:
        for target in (os, sys.modules["posix"]):
            mp.setattr(target, "system", lambda *a: ran.append(a))
        mp.setattr(subprocess, "Popen", lambda *a, **k: ran.append(a))
        try:
            decoded = decode_named_tensors(_b64(prefix + body), load_format)
        except TransportError:
            pass
        else:
            assert all(isinstance(n, str) and isinstance(t, torch.Tensor) for n, t in decoded)
    assert ran == []


def test_refusal_messages_never_quote_the_payload() -> None:
    """Errors on garbage name its length and the kind of failure, never the bytes themselves."""
    secret = b"SECRET-WEIGHTS-\x01\x02"
    for data, load_format in [(b"\x80\x04I" + secret + b"\n.", "direct"), (secret * 3, None),
                              (secret, "safetensors")]:
        with pytest.raises(TransportError) as caught:
            decode_named_tensors(_b64(data), load_format)
        assert "SECRET" not in str(caught.value)
        error = caught.value
        assert error.__cause__ is None and (error.__suppress_context__ or error.__context__ is None)


def test_an_empty_ordered_dict_is_the_only_thing_built_from_its_name() -> None:
    """``collections.OrderedDict`` may build an empty dict for hooks, not one filled from arguments."""
    payload = pickle.dumps(_Call(collections.OrderedDict, [("a", 1)]))
    with pytest.raises(TransportError, match=r"calls collections\.OrderedDict with 1 arguments"):
        decode_named_tensors(_b64(payload), "direct")
