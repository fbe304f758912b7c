"""Small pipelines and checks shared by the tests."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from lifecycle.testing import FaultInjection, FaultyDevice, faulty_cpu_layer_class, faulty_device_layer
from strategies import DeviceLayer

M = TypeVar("M", bound=nn.Module)


def faulty_device(**faults: Any) -> FaultInjection:
    """A fault-injecting layer for the CPU device, on the layer the pass runs on
    (``--device-layer``: the CPU layer, the ordering one, or the CUDA one over a simulated
    GPU), made with ``faults`` (``fail_copy_at=k``, ``copy_delay=s``, ...)."""
    return faulty_device_layer("cpu", **faults)


if TYPE_CHECKING:
    SelectedFaultyDevice = FaultyDevice
else:
    #: The class of :func:`faulty_device`'s layers, the base of the tests' own layers: read
    #: when the tests are imported (``--device-layer`` has set the variable by then).
    SelectedFaultyDevice = faulty_cpu_layer_class()


class TiedLM(nn.Module):
    """Embedding with a tied output head, a persistent and a non-persistent buffer, and a
    buffer that is a view of a parameter's storage."""

    scale: torch.Tensor
    freqs: torch.Tensor
    first_row: torch.Tensor

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim))
                                    for _ in range(3))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((dim,), 0.5))
        self.register_buffer("freqs", torch.arange(dim, dtype=torch.float32), persistent=False)
        self.register_buffer("first_row", self.embed.weight.detach()[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids) * self.scale + self.freqs * 1e-3 + self.first_row * 1e-3
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)  # type: ignore[no-any-return]


def small_pipeline(seed: int = 0) -> dict[str, nn.Module]:
    torch.manual_seed(seed)
    return {
        "text_encoder": TiedLM(),
        "transformer": nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)),
        "vae": nn.Sequential(nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8),
                             nn.Conv2d(8, 3, 1)).eval(),
    }


def tied_lm(pipe: dict[str, nn.Module]) -> TiedLM:
    """``small_pipeline``'s text encoder, typed as the ``TiedLM`` it is."""
    lm = pipe["text_encoder"]
    assert isinstance(lm, TiedLM)
    return lm


def layer(seq: nn.Module, index: int, kind: type[M]) -> M:
    """``seq[index]`` of an ``nn.Sequential`` (as ``small_pipeline``'s transformer and vae
    are), checked to be a ``kind``."""
    assert isinstance(seq, nn.Sequential)
    sub = seq[index]
    assert isinstance(sub, kind)
    return sub


def run_pipeline(pipe: dict[str, nn.Module]) -> list[torch.Tensor]:
    with torch.no_grad():
        ids = torch.arange(6).reshape(1, 6)
        x = torch.linspace(-1, 1, 32).reshape(2, 16)
        z = torch.linspace(-1, 1, 4 * 25).reshape(1, 4, 5, 5)
        return [pipe["text_encoder"](ids), pipe["transformer"](x), pipe["vae"](z)]


def fingerprint(module: nn.Module) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    tensors: list[tuple[str, torch.Tensor]] = list(module.named_parameters(remove_duplicate=False))
    tensors += list(module.named_buffers(remove_duplicate=False))
    for name, t in sorted(tensors, key=lambda nt: nt[0]):
        c = t.detach().to("cpu")
        c = (c.to_dense() if c.layout != torch.strided else c).contiguous()
        h.update(f"{name}|{c.dtype}|{tuple(c.shape)}".encode())
        h.update(c.view(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b"")
    return h.hexdigest()


def fingerprints(pipe: dict[str, nn.Module]) -> dict[str, str]:
    return {name: fingerprint(m) for name, m in pipe.items()}


def tensor_ids(pipe: dict[str, nn.Module]) -> dict[str, int]:
    out = {}
    for cname, m in pipe.items():
        for n, t in list(m.named_parameters()) + list(m.named_buffers()):
            out[f"{cname}.{n}"] = id(t)
    return out


def reachable_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a module tree reaches through attributes: parameters, buffers, plain
    tensor attributes and tensors inside list, tuple and dict attributes (written apart from
    the library's own inventory, so that it can check it)."""
    out: list[tuple[str, torch.Tensor]] = []
    for prefix, sub in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, value in vars(sub).items():
            if isinstance(value, torch.Tensor):
                out.append((dot + attr, value))
            elif isinstance(value, (list, tuple)):
                out += [(f"{dot}{attr}[{i}]", v) for i, v in enumerate(value)
                        if isinstance(v, torch.Tensor)]
            elif isinstance(value, dict):
                out += [(f"{dot}{attr}[{k!r}]", v) for k, v in value.items()
                        if isinstance(v, torch.Tensor)]
    return out


def device_tier_storages(pipe: dict[str, nn.Module], ctl: object) -> dict[str, int]:
    """``{first tensor name: storage bytes}`` of every storage with bytes that a pipeline
    reaches on the device tier. On CUDA that is a CUDA storage; on the CPU stand-in, any
    storage that is not inside one of the controller's host mirrors."""
    from lifecycle import LifecycleController

    assert isinstance(ctl, LifecycleController)
    mirrors = [(u.host.data_ptr(), u.host.data_ptr() + u.host.nbytes)
               for name in ctl.components for u in ctl.strategy(name).store.units
               if u.host is not None]
    found: dict[int, tuple[str, int]] = {}
    for cname, module in pipe.items():
        for name, t in reachable_tensors(module):
            st = t.untyped_storage()
            if not st.nbytes() or t.is_meta:
                continue
            ptr = st.data_ptr()
            if ctl.device.type == "cuda":
                on_device = t.device.type == "cuda"
            else:
                on_device = not any(lo <= ptr < hi for lo, hi in mirrors)
            if on_device and ptr not in found:
                found[ptr] = (f"{cname}.{name}", st.nbytes())
    return dict(found.values())


def new_on_the_device(t: torch.Tensor, layer: DeviceLayer, dtype: torch.dtype | None = None
                      ) -> torch.Tensor:
    """A new copy of ``t`` (cast to ``dtype``) in ``layer``'s device memory, as torch makes a new
    tensor on a GPU (``t.to(dtype)``, a replacement built there): allocated by the layer, so a
    simulated GPU whose device memory is its own (RESIDENCY_SIM_HOST_MODULES=1) counts it as
    device memory too; a CPU tensor on the CPU layers. (A tensor made device memory where it is,
    no copy: ``tests/strategies/device_modules.py``'s ``in_device_memory``.)"""
    dtype = dtype or t.dtype
    nbytes = t.numel() * dtype.itemsize
    out = layer.alloc(nbytes, "device")[:nbytes].view(dtype).view(t.shape)
    out.copy_(t)
    return out


def cast_by_hand(module: nn.Module, dtype: torch.dtype, layer: DeviceLayer) -> None:
    """``module.to(dtype)`` done by hand on the device, as it happens on a GPU: every
    floating parameter and buffer re-pointed at a new device tensor (:func:`new_on_the_device`)."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            if t.is_floating_point():
                t.data = new_on_the_device(t, layer, dtype)


def attach_allocates(module: nn.Module, layer: DeviceLayer) -> bool:
    """Whether attaching ``module`` as it is now makes ``layer`` allocate the device buffers of
    what it keeps on the device: yes when its tensors are host memory (a model built on the CPU,
    on a GPU or on a simulated GPU whose device memory is its own), no when they are on the
    layer's device tier already (on the CPU layers, or a simulated GPU sharing host memory:
    adopted in place, so the layer's own allocations leave them out)."""
    tiers = {layer.on_device(t) for t in module.state_dict().values() if t.numel()}
    assert len(tiers) == 1, f"{type(module).__name__} is partly on the device tier"
    return not tiers.pop()
