"""Small pipelines and checks shared by the tests."""

from __future__ import annotations

import hashlib

import torch
from torch import nn


class TiedLM(nn.Module):
    """Embedding with a tied output head, a persistent and a non-persistent buffer, and a
    buffer that is a view of a parameter's storage."""

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


def run_pipeline(pipe: dict[str, nn.Module]) -> list[torch.Tensor]:
    with torch.no_grad():
        ids = torch.arange(6).reshape(1, 6)
        x = torch.linspace(-1, 1, 32).reshape(2, 16)
        z = torch.linspace(-1, 1, 4 * 25).reshape(1, 4, 5, 5)
        return [pipe["text_encoder"](ids), pipe["transformer"](x), pipe["vae"](z)]


def fingerprint(module: nn.Module) -> str:
    """SHA-256 over every parameter and buffer (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    tensors = list(module.named_parameters(remove_duplicate=False))
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
