"""Decoding tensor payloads (``POST /update_weights_from_tensor``): safetensors, or the reference's pickles.

The reference server (SGLang) takes ``serialized_named_tensors``: base64 of a pickle written by
torch's multiprocessing pickler (``ForkingPickler``; SGLang's ``MultiprocessingSerializer``). The
pickle does not carry tensor data: it carries *handles* to memory the sender shares on the same
host (a file descriptor passed over a Unix socket, a ``/dev/shm`` segment name, or a CUDA IPC
handle), plus either a list of ``(name, tensor)`` pairs (``load_format`` omitted or ``"direct"``)
or, for ``load_format="flattened_bucket"``, ``{"flattened_tensor": flat, "metadata": [...]}``
where each ``sglang.srt.weight_sync.tensor_bucket.FlattenedTensorMetadata`` names a slice of
``flat``. The newest diffusion clients key either kind by module, ``{"transformer": payload}``
(:func:`decode_modules` resolves it against ``target_modules`` as the reference does). No new
global is needed for that: the dict and its string keys are plain pickle opcodes.

This package depends on torch and the standard library only (no HTTP framework: it imports
without starlette or uvicorn installed); the service (``lifecycle.http``) calls it in worker
threads. One module per concern, each to be audited on its own:

- ``_prescan``: every opcode of a pickle read once before it runs (what it may make the
  unpickler do, and how much memory it may make it hold);
- ``_unpickler``: the restricted unpickler, its allow-list (:data:`ALLOWED_GLOBALS`) and the
  rebuild functions of plain tensors, storages and parameters;
- ``_sealed``: the sealed stand-ins the pickle gets instead of real objects, and the argument
  checks every rebuild function makes;
- ``_handles``: shared memory handed over by handle (file descriptors, ``/dev/shm`` segments,
  CUDA IPC);
- ``_legacy``: torch's legacy storage format (``torch.storage._load_from_bytes``), read
  without ``torch.load``;
- ``_bucket``: SGLang's flattened buckets;
- ``_safetensors``: safetensors uploads (the recommended path);
- ``_memory``: bytes into tensors (views where possible, copies in pieces);
- ``_decode``: base64, ``load_format`` and modules: the entry points.

Threat model
------------
*Who sends what.* The payload arrives over HTTP from whoever can reach the port: its bytes, and
what they claim (sizes, offsets, names, handles), are untrusted. ``pickle.loads`` on such input
runs arbitrary code: a pickle may name any importable callable (``os.system``,
``builtins.eval``, ``subprocess.Popen``, ``torch.load``...) and call it.

*No arbitrary pickles.* The pickle is read by an unpickler whose ``find_class`` answers only the
names in :data:`ALLOWED_GLOBALS`; anything else is refused with :class:`TransportError` before
it is imported. Even the allowed names are not handed out as the real objects: the pickle gets
sealed stand-ins (no attributes can be set on them, no state can be given to them, class tokens
cannot be called), and each stand-in's call validates every argument (types, ranges, handle and
socket names) before calling torch's own rebuild function with torch's own classes. What those
calls return to the pickle is sealed too (storage and tensor references), so the pickle can
neither mutate torch's classes process-wide nor tamper with the objects it is given; only the
final validation unwraps the tensors. ``torch.load`` is never called (torch's
``_load_from_bytes`` is ``torch.load(weights_only=False)``): the legacy storage format is read
here, zip archives (compressed entries can declare gigabytes) and other formats are refused.

*Bounded sizes.* Before the unpickler runs, every opcode is read once: only the opcodes torch's
picklers write are admitted, memo indices may not skip ahead (one 6-byte ``LONG_BINPUT`` would
otherwise make the unpickler zero a memo array of gigabytes), frames are small, and the objects
the pickle may build are costed against a budget of a constant plus a small multiple of its
size. Large byte strings are handed to the unpickler out of band (views of the decoded payload,
not copies). A storage is never larger than the bytes that carry it (or the shared segment that
holds it), and every tensor view must lie inside its storage (``Tensor.set_`` would silently
*grow* a resizable storage, handing out uninitialised memory as weights). A safetensors header
is at most 8 MiB of JSON (parsing holds the GIL), and long copies and base64 decoding go in
pieces, so that the event loop keeps answering.

*Handles name only what they may.* An fd handshake connects only to a multiprocessing listener
socket path, authenticated with this process's authkey and timed out at every step; a
shared-memory segment must be torch's, in ``/dev/shm``, owned by this user, opened read-only
without following symlinks, and is never written (one message for every refusal, so that the
answers cannot probe other users' segments); a CUDA reference counter must be torch's.

*What the allow-list cannot remove: the pickle path trusts the host.* Its handles point at
memory the sender shares on this machine, so fd-passed tensors alias the sender's memory (copy
them before the sender may reuse it), fd passing needs the sender alive and sharing this
process's multiprocessing authkey (a multiprocessing relative: unrelated processes fail
authentication) and works once per payload, ``file_system`` segments vanish when the sender
exits, and a local user who can create torch-named segments or multiprocessing sockets can feed
them to the server. Serve the pickle formats only to trusted, same-host trainers; safetensors
(which carries the data itself and runs no code) is the recommended path.

Errors are :class:`TransportError` with a message naming what was wrong. No message carries
payload bytes (at most their length) and nothing here logs tensor contents.
"""

from ._bucket import FlattenedTensorMetadata
from ._decode import (
    LOAD_FORMATS,
    check_load_format,
    decode_base64,
    decode_modules,
    decode_named_tensors,
    decode_payload,
)
from ._errors import PayloadModulesMismatch, TransportError
from ._handles import FD_TIMEOUT
from ._unpickler import ALLOWED_GLOBALS

__all__ = [
    "ALLOWED_GLOBALS",
    "FD_TIMEOUT",
    "LOAD_FORMATS",
    "FlattenedTensorMetadata",
    "PayloadModulesMismatch",
    "TransportError",
    "check_load_format",
    "decode_base64",
    "decode_modules",
    "decode_named_tensors",
    "decode_payload",
]
