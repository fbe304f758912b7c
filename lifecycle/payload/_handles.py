"""Shared memory handed over by handle: file descriptors, ``/dev/shm`` segments, CUDA IPC.

- ``torch.multiprocessing.reductions.rebuild_storage_fd`` with ``multiprocessing.resource_sharer.DupFd``
  (``file_descriptor`` sharing): asks the sender's resource-sharer listener for a file descriptor and
  maps it. The listener address must be a multiprocessing listener socket path
  (``.../pymp-*/listener-*``), so a payload cannot make the server connect to arbitrary sockets (TCP
  or otherwise); the connection is authenticated with this process's multiprocessing authkey, every
  step of the handshake times out (``fd_timeout``, 5 s by default: a listener that accepts and never
  speaks costs a 400, not a thread), and the descriptor received must be a regular file holding the
  requested bytes (a shorter one would fault on access).
- ``torch.multiprocessing.reductions.rebuild_storage_filename`` (``file_system`` sharing): copies
  the bytes of a named shared-memory segment. The name must be torch's (``/torch_<...>``); the
  segment is opened read-only without following symlinks and must be a regular file in
  ``/dev/shm`` owned by this process's user, holding torch's 64-byte header plus the requested
  bytes. The segment is never written (torch's own rebuild would bump its reference count, and
  grow it when short) and torch's manager socket is never contacted (it stays the sender's). Every
  refusal has one message, so the answers cannot probe other users' segments. The price: the
  reference the sender took for this pickle is never given back, so a segment stays in
  ``/dev/shm`` until the sender (and its manager) exits.
- ``torch.multiprocessing.reductions.rebuild_cuda_tensor`` and SGLang's UUID-aware
  ``_rebuild_cuda_tensor_modified`` (``sglang.srt.utils.patch_torch``, formerly
  ``sglang.srt.patch_torch``; clients that import SGLang emit it): open a CUDA IPC handle. The
  device may be an index or a device UUID; the reference-counter file must be torch's and its offset
  inside torch's counter file (``CUDA_IPC_REF_COUNTER_FILE_SIZE``); the view must lie inside the
  storage's declared bytes.

Every handle trusts the *host* (see the package's threat model): serve these formats only to
trusted, same-host trainers.
"""

from __future__ import annotations

import contextvars
import multiprocessing
import os
import re
import socket
import stat
import struct
from multiprocessing import connection as mp_connection
from multiprocessing import reduction as mp_reduction
from typing import NoReturn

import torch
from torch.multiprocessing import reductions

from ._errors import TransportError, refuse
from ._memory import PIECE, writable
from ._sealed import (
    TYPED_STORAGE,
    UNTYPED_STORAGE,
    StorageRef,
    TensorRef,
    check_arity,
    check_bool,
    check_bytes,
    check_dtype,
    check_int,
    check_ints,
    check_storage_class,
    check_tensor_class,
    check_view,
    kind_of,
    torch_call,
)

#: Seconds each step of the fd-passing handshake may take by default.
FD_TIMEOUT = 5.0


# torch/csrc/CudaIPCTypes.h: each reference-counter file holds this many int64 counters.
_CUDA_IPC_REF_COUNTER_FILE_SIZE = 10000
# torch's refcounted shared-memory segments start with a header of this many bytes (the
# reference count), then the storage's bytes (aten MapAllocator's map_alloc_alignment).
_SHM_HEADER = 64
_SHM_HANDLE = re.compile(rb"/torch_[0-9A-Za-z_]+")
_SHM_MANAGER = re.compile(
    rb"/(?:[^/\x00]+/)*(?:torch-shm-dir-[^/\x00]+/manager\.sock|torch-shm-socket-[^/\x00]+)")
_LISTENER = re.compile(r"/(?:[^/\x00]+/)*pymp-[^/\x00]+/listener-[^/\x00]+")


fd_timeout_var: contextvars.ContextVar[float] = contextvars.ContextVar("fd_timeout", default=FD_TIMEOUT)


class DupFd:
    """Stands in for ``multiprocessing.resource_sharer.DupFd``: only its ``_id`` state, checked."""

    __slots__ = ("ident",)
    ident: tuple[str, int]

    def __init__(self, *args: object) -> NoReturn:
        refuse("pickle calls multiprocessing.resource_sharer.DupFd, which is not allowed")

    def __setstate__(self, state: object) -> None:
        what = "multiprocessing.resource_sharer.DupFd state"
        if hasattr(self, "ident"):
            refuse(f"{what} is set twice")
        if not isinstance(state, dict) or set(state) != {"_id"}:
            refuse(f"{what} must be {{'_id': (address, key)}}")
        ident = state["_id"]
        if not isinstance(ident, tuple) or len(ident) != 2:
            refuse(f"{what} must be {{'_id': (address, key)}}")
        address, key = ident
        if (type(address) is not str or len(address) > 4096 or not _LISTENER.fullmatch(address)
                or os.path.normpath(address) != address):
            refuse(f"{what}: the address is not a multiprocessing listener socket path "
                    "(.../pymp-*/listener-*)")
        object.__setattr__(self, "ident", (address, check_int(f"{what} key", key)))

    def __reduce__(self) -> NoReturn:
        raise TypeError("DupFd cannot be pickled")


_FD = "torch.multiprocessing.reductions.rebuild_storage_fd"
_FD_HINT = (": file_descriptor sharing needs the sender alive, a payload decoded at most once, and "
            "the sender sharing this process's multiprocessing authkey (a multiprocessing relative); "
            "send safetensors instead")


class _FdFetch:
    """What ``reductions.rebuild_storage_fd`` calls ``detach()`` on: the resource sharer's
    handshake (``multiprocessing.resource_sharer.DupFd.detach``), with every step timed out,
    and a check that the descriptor received is a regular file holding ``nbytes``."""

    def __init__(self, ident: tuple[str, int], nbytes: int, timeout: float) -> None:
        self.ident, self.nbytes, self.timeout = ident, nbytes, timeout

    def detach(self) -> int:
        address, key = self.ident
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.timeout)  # the connect
            sock.connect(address)
            # Kernel-level timeouts: multiprocessing's Connection reads the raw descriptor.
            seconds = max(self.timeout, 0.001)
            timeval = struct.pack("ll", int(seconds), int(seconds % 1 * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
            sock.setblocking(True)
            conn = mp_connection.Connection(sock.detach())
        finally:
            sock.close()
        with conn:
            authkey = multiprocessing.current_process().authkey
            mp_connection.answer_challenge(conn, authkey)
            mp_connection.deliver_challenge(conn, authkey)
            conn.send((key, os.getpid()))
            fd: int = mp_reduction.recv_handle(conn)
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_size < self.nbytes:
                refuse(f"{_FD}: the descriptor received is not a regular file of at least "
                        f"{self.nbytes} bytes")
        except BaseException:
            os.close(fd)
            raise
        return fd


def rebuild_storage_fd(*args: object) -> StorageRef:
    check_arity(_FD, args, 3)
    cls, df, size = args
    check_storage_class(f"{_FD} argument 1", cls)
    if not isinstance(df, DupFd) or not hasattr(df, "ident"):
        refuse(f"{_FD} argument 2 must be a multiprocessing.resource_sharer.DupFd with its state")
    nbytes = check_int(f"{_FD} size", size)
    fetch = _FdFetch(df.ident, nbytes, fd_timeout_var.get())
    try:
        storage = reductions.rebuild_storage_fd(  # type: ignore[no-untyped-call]
            torch.UntypedStorage, fetch, nbytes)
    except TransportError:
        raise
    except (TimeoutError, BlockingIOError):
        raise TransportError(f"{_FD}: the sender's listener did not answer within "
                             f"{fetch.timeout:g} s{_FD_HINT}") from None
    except Exception as exc:
        raise TransportError(f"{_FD} failed ({type(exc).__name__}){_FD_HINT}") from None
    return StorageRef(storage, None)


_FN = "torch.multiprocessing.reductions.rebuild_storage_filename"
_FN_REFUSED = (f"{_FN}: the shared-memory segment cannot be used; it must be a regular file in "
               "/dev/shm owned by this server's user and holding torch's 64-byte header plus the "
               "requested bytes (file_system sharing needs the sender alive on this host)")


def rebuild_storage_filename(*args: object) -> StorageRef:
    check_arity(_FN, args, 4, 5)
    cls, manager, handle, size = args[:4]
    dtype = args[4] if len(args) == 5 else None
    check_storage_class(f"{_FN} argument 1", cls)
    manager = check_bytes(f"{_FN} manager", manager)
    if not _SHM_MANAGER.fullmatch(manager) or os.path.normpath(manager) != manager:
        refuse(f"{_FN}: the manager is not torch's shared-memory manager socket")
    handle = check_bytes(f"{_FN} handle", handle, limit=255)
    if not _SHM_HANDLE.fullmatch(handle):
        refuse(f"{_FN}: the handle is not a torch shared-memory segment name (/torch_...)")
    checked_dtype = None if dtype is None else check_dtype(f"{_FN} dtype", dtype)
    nbytes = check_int(f"{_FN} size", size) * (1 if checked_dtype is None else checked_dtype.itemsize)
    # The manager socket is the sender's: it is never contacted (torch's rebuild would register
    # the segment with whatever socket the payload names, and keep that connection open).
    storage = _copy_segment(b"/dev/shm" + handle, nbytes)
    return StorageRef(storage, checked_dtype)


def _copy_segment(path: bytes, nbytes: int) -> torch.UntypedStorage:
    """The ``nbytes`` after torch's header of the segment at ``path``, copied; read-only, so the
    segment (and its reference count) is never written. One message for every refusal."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags)
    except OSError:
        raise TransportError(_FN_REFUSED) from None
    try:
        info = os.fstat(fd)
        if (not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid()
                or info.st_size < _SHM_HEADER + nbytes):
            refuse(_FN_REFUSED)
        out = torch.empty(nbytes, dtype=torch.uint8)
        target = writable(out)
        done = 0
        while done < nbytes:
            got = os.preadv(fd, [target[done:done + PIECE]], _SHM_HEADER + done)
            if got <= 0:
                refuse(_FN_REFUSED)  # truncated under us
            done += got
    except OSError:
        raise TransportError(_FN_REFUSED) from None
    finally:
        os.close(fd)
    return out.untyped_storage()


def _cuda_device(what: str, device: object) -> int:
    """A device index, or (SGLang's patched reductions) a device UUID string."""
    if type(device) is int:
        return check_int(what, device)
    if type(device) is not str or len(device) > 64:
        refuse(f"{what} must be a device index or a device UUID string")
    if not torch.cuda.is_available():
        refuse(f"{what}: the payload holds CUDA tensors but this process has no CUDA device")
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    refuse(f"{what} names a CUDA device UUID this process cannot see")


_CU = "torch.multiprocessing.reductions.rebuild_cuda_tensor"


def rebuild_cuda_tensor(*args: object) -> TensorRef:
    check_arity(_CU, args, 15)
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, storage_handle,
     storage_size_bytes, storage_offset_bytes, requires_grad, ref_counter_handle,
     ref_counter_offset, event_handle, event_sync_required) = args
    check_tensor_class(f"{_CU} tensor class", tensor_cls)
    size_t = check_ints(f"{_CU} size", size)
    stride_t = check_ints(f"{_CU} stride", stride)
    if len(size_t) != len(stride_t):
        refuse(f"{_CU}: size and stride have different lengths")
    # reduce_tensor sends type(tensor._typed_storage()): TypedStorage (torch 2.x).
    if storage_cls is not TYPED_STORAGE and storage_cls is not UNTYPED_STORAGE:
        refuse(f"{_CU} storage class must be torch.storage.TypedStorage or UntypedStorage, got "
                f"{kind_of(storage_cls)}")
    real_storage_cls = torch.storage.TypedStorage if storage_cls is TYPED_STORAGE else torch.UntypedStorage
    if storage_handle is not None:
        check_bytes(f"{_CU} storage handle", storage_handle)
    if event_handle is not None:
        check_bytes(f"{_CU} event handle", event_handle)
    nbytes = check_int(f"{_CU} storage size", storage_size_bytes)
    if storage_handle is None or nbytes == 0:
        counter = ref_counter_handle  # torch makes an empty storage and never opens the counter
        if counter is not None:
            check_bytes(f"{_CU} ref-counter handle", counter, limit=255)
    elif not _SHM_HANDLE.fullmatch(check_bytes(f"{_CU} ref-counter handle", ref_counter_handle, limit=255)):
        refuse(f"{_CU}: the ref-counter handle is not a torch shared-memory segment name")
    else:
        counter = ref_counter_handle
    check_bool(f"{_CU} requires_grad", requires_grad)  # dropped, as in rebuild_tensor
    if check_int(f"{_CU} ref-counter offset", ref_counter_offset) >= _CUDA_IPC_REF_COUNTER_FILE_SIZE:
        refuse(f"{_CU}: the ref-counter offset is outside torch's counter file")
    checked_dtype = check_dtype(f"{_CU} dtype", dtype)
    checked_offset = check_int(f"{_CU} offset", offset)
    check_view(_CU, checked_offset, size_t, stride_t,
          nbytes // checked_dtype.itemsize if storage_handle is not None else 0)
    checked = (
        torch.Tensor, size_t, stride_t, checked_offset, real_storage_cls,
        checked_dtype, _cuda_device(f"{_CU} device", device), storage_handle,
        nbytes, check_int(f"{_CU} storage offset", storage_offset_bytes),
        False, counter, ref_counter_offset,
        event_handle, check_bool(f"{_CU} event_sync_required", event_sync_required),
    )
    return TensorRef(torch_call(_CU, reductions.rebuild_cuda_tensor, *checked,
                                  hint=": CUDA IPC needs the sender alive on this host"))


