"""A small, deterministic diffusion-like pipeline of real torch modules, sized by a byte budget.

Three components, shaped like a text-to-image pipeline so that every edge case of weight
placement shows up in a few megabytes:

* ``text_encoder`` -- token embedding, two causal transformer blocks, a final LayerNorm and an
  output head **tied** to the embedding (one tensor under two names);
* ``transformer`` -- a DiT: patch projection, a persistent ``pos_embed`` buffer, a timestep
  embedder with a non-persistent float32 ``freqs`` buffer (kept float32 even in a bfloat16
  pipeline: mixed dtypes in one component), ``blocks`` (an ``nn.ModuleList`` of
  :class:`DiTBlock`, adaptive scale/shift/gate from the conditioning), final norm and
  projection; most of the bytes live in the blocks;
* ``vae`` -- a small convolutional decoder from 4 latent channels to RGB.

:meth:`DemoPipeline.build` picks widths and depths so that the weights take the requested
bytes (within 25%; about 87% transformer, 10% text encoder, 3% VAE) and fills them from a
seeded generator, fast enough for multi-GB budgets. :meth:`DemoPipeline.generate` runs text
encoding, a few denoising steps and decoding, each component inside ``ctl.use(name)`` when a
controller is given; the same weights and seed give a bit-identical image.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .._units import parse_size  # (re-exported: drills, benchmarks and tests size the demo)
from ._checkpoint import unique_tensors

__all__ = ["DemoConfig", "DemoPipeline", "DiTBlock", "parse_size"]

VOCAB = 1024
LATENT_CHANNELS = 4
LATENT_SIZE = 8  # latents are 1 x 4 x 8 x 8
PATCH = 2  # -> 16 tokens of 16 features
TEXT_LAYERS = 2
PROMPT_LEN = 16
T_FREQ_DIM = 256  # sinusoidal timestep features
_POOL = 4_194_301  # prime: windows of the random pool never line up with row widths
_MB = 2**20


# -- modules -------------------------------------------------------------------------

def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class Attention(nn.Module):
    """Multi-head self-attention: one fused ``qkv`` projection, SDPA, output projection."""

    def __init__(self, dim: int, heads: int, *, causal: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, c // self.heads).permute(
            2, 0, 3, 1, 4).unbind(0)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        out: torch.Tensor = self.out(y.transpose(1, 2).reshape(b, n, c))
        return out


class MLP(nn.Module):
    """Two linear layers with a tanh-GELU between them."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc2(F.gelu(self.fc1(x), approximate="tanh"))
        return out


class TextBlock(nn.Module):
    """A pre-norm causal transformer block."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads, causal=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


class TextEncoder(nn.Module):
    """Token embedding, causal blocks, final norm and a head tied to the embedding.

    Returns one pooled vector per prompt: the mean hidden state plus the expected embedding
    of the next token under the tied head (so the tied weight is read twice per forward)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        # An explicit weight skips Embedding's normal_ init (slow to set up on ``meta``);
        # DemoPipeline.build fills every weight anyway.
        self.embed = nn.Embedding(VOCAB, dim, _weight=torch.empty(VOCAB, dim))
        self.blocks = nn.ModuleList(TextBlock(dim, heads) for _ in range(TEXT_LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``head.weight`` the very tensor of ``embed.weight`` (``to_empty`` unties)."""
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        probs = self.head(h[:, -1]).float().softmax(-1).to(h.dtype)
        pooled: torch.Tensor = h.mean(1) + probs @ self.embed.weight
        return pooled


class TimestepEmbedder(nn.Module):
    """Sinusoidal timestep features (from a float32 ``freqs`` buffer) through an MLP."""

    freqs: torch.Tensor

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.empty(T_FREQ_DIM // 2, dtype=torch.float32),
                             persistent=False)
        self.fc1 = nn.Linear(T_FREQ_DIM, dim)
        self.fc2 = nn.Linear(dim, dim)

    def init_buffers(self) -> None:
        half = T_FREQ_DIM // 2
        self.freqs = torch.exp(-math.log(10_000.0) * torch.arange(half, dtype=torch.float32)
                               / half).to(self.freqs.device)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        args = t.float()[:, None] * self.freqs[None]
        feats = torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.fc1.weight.dtype)
        out: torch.Tensor = self.fc2(F.silu(self.fc1(feats)))
        return out


class DiTBlock(nn.Module):
    """LayerNorm, self-attention and MLP, each modulated (shift, scale, gate) by ``c``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.mlp = MLP(dim, 4 * dim)
        self.ada = nn.Linear(dim, 6 * dim)

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c)).chunk(6, dim=-1)
        x = x + gate1.unsqueeze(1) * self.attn(_modulate(self.norm1(x), shift1, scale1))
        out: torch.Tensor = x + gate2.unsqueeze(1) * self.mlp(
            _modulate(self.norm2(x), shift2, scale2))
        return out


class DiT(nn.Module):
    """A diffusion transformer over 2x2 patches of a 4 x 8 x 8 latent."""

    pos_embed: torch.Tensor

    def __init__(self, dim: int, heads: int, layers: int, text_dim: int) -> None:
        super().__init__()
        patch_features = LATENT_CHANNELS * PATCH * PATCH
        self.grid = LATENT_SIZE // PATCH
        self.x_proj = nn.Linear(patch_features, dim)
        self.register_buffer("pos_embed", torch.empty(1, self.grid * self.grid, dim))
        self.t_embed = TimestepEmbedder(dim)
        self.text_proj = nn.Linear(text_dim, dim)
        self.blocks = nn.ModuleList(DiTBlock(dim, heads) for _ in range(layers))
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Linear(dim, 2 * dim)
        self.out_proj = nn.Linear(dim, patch_features)

    def init_buffers(self) -> None:
        """Fixed 2-D sin/cos position embedding (half the features per axis)."""
        dim = self.pos_embed.shape[-1]
        quarter = dim // 4
        omega = 1.0 / 10_000.0 ** (torch.arange(quarter, dtype=torch.float64) / max(quarter, 1))
        ys, xs = torch.meshgrid(torch.arange(self.grid, dtype=torch.float64),
                                torch.arange(self.grid, dtype=torch.float64), indexing="ij")
        parts = [f(pos.reshape(-1, 1) * omega) for pos in (ys, xs) for f in (torch.sin, torch.cos)]
        table = torch.zeros(self.grid * self.grid, dim, dtype=torch.float64)
        table[:, :4 * quarter] = torch.cat(parts, dim=1)
        self.pos_embed.copy_(table.unsqueeze(0))
        self.t_embed.init_buffers()

    def forward(self, latent: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        b, ch, hgt, wid = latent.shape
        g, p = hgt // PATCH, wid // PATCH
        tokens = latent.reshape(b, ch, g, PATCH, p, PATCH).permute(0, 2, 4, 1, 3, 5)
        x = self.x_proj(tokens.reshape(b, g * p, ch * PATCH * PATCH)) + self.pos_embed
        c = self.t_embed(t) + self.text_proj(text)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_ada(F.silu(c)).chunk(2, dim=-1)
        out: torch.Tensor = self.out_proj(_modulate(self.final_norm(x), shift, scale))
        return out.reshape(b, g, p, ch, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5).reshape(
            b, ch, hgt, wid)


class VAEDecoder(nn.Module):
    """Latent (4 channels, 8 x 8) to an RGB image (3 channels, 32 x 32) in [-1, 1]."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        c, half, quarter = channels, channels // 2, channels // 4
        self.conv_in = nn.Conv2d(LATENT_CHANNELS, c, 3, padding=1)
        self.norm1 = nn.GroupNorm(8, c)
        self.conv_mid = nn.Conv2d(c, c, 3, padding=1)
        self.norm2 = nn.GroupNorm(8, c)
        self.conv_up1 = nn.Conv2d(c, half, 3, padding=1)
        self.norm3 = nn.GroupNorm(8, half)
        self.conv_up2 = nn.Conv2d(half, quarter, 3, padding=1)
        self.norm4 = nn.GroupNorm(8, quarter)
        self.conv_out = nn.Conv2d(quarter, 3, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = h + self.conv_mid(F.silu(self.norm1(h)))
        h = self.conv_up1(self.up(F.silu(self.norm2(h))))
        h = self.conv_up2(self.up(F.silu(self.norm3(h))))
        return torch.tanh(self.conv_out(F.silu(self.norm4(h))))


# -- sizing and initialisation ---------------------------------------------------------

@dataclass(frozen=True)
class DemoConfig:
    """Widths and depths of a :class:`DemoPipeline`."""

    text_dim: int
    dim: int
    layers: int
    vae_channels: int

    @staticmethod
    def heads(width: int) -> int:
        return width // 64 if width % 64 == 0 and width >= 256 else width // 16

    def make(self) -> dict[str, nn.Module]:
        return {"text_encoder": TextEncoder(self.text_dim, self.heads(self.text_dim)),
                "transformer": DiT(self.dim, self.heads(self.dim), self.layers, self.text_dim),
                "vae": VAEDecoder(self.vae_channels)}


def _widths(x: float) -> tuple[int, int]:
    """The multiples of the head width (16 below 256, else 64) just below and above ``x``."""
    q = 16 if x < 256 else 64
    lo = max(16, int(x // q) * q)
    return lo, lo + q


def _unique_tensors(modules: dict[str, nn.Module]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``modules`` once (tied weights once), in a fixed order."""
    return iter(unique_tensors(
        (f"{cname}.{name}", t) for cname, module in modules.items()
        for name, t in [*module.named_parameters(), *module.named_buffers()]).items())


def _nbytes(modules: dict[str, nn.Module]) -> int:
    return sum(t.nbytes for _, t in _unique_tensors(modules))


def _make(config: DemoConfig, dtype: torch.dtype) -> dict[str, nn.Module]:
    return {name: module.to(dtype) for name, module in config.make().items()}


def _choose(size_bytes: int, dtype: torch.dtype, num_layers: int | None) -> DemoConfig:
    """Widths and depth whose weights come closest to ``size_bytes`` (counted on ``meta``)."""
    params = size_bytes / dtype.itemsize
    text_dim = _widths((-1052 + math.sqrt(1052**2 + 96 * 0.10 * params)) / 48)[0]
    vae_channels = max(32, round(math.sqrt(0.03 * params / 14.625) / 32) * 32)
    if num_layers is not None:
        depths = [num_layers]
    else:
        base = round(2 + 1.5 * math.log2(max(size_bytes, _MB) / _MB))
        depths = sorted({min(28, max(2, base + k)) for k in (-1, 0, 1)})
    best: tuple[float, DemoConfig] | None = None
    with torch.device("meta"):
        fixed = _nbytes({"text_encoder": TextEncoder(text_dim, 1).to(dtype),
                         "vae": VAEDecoder(vae_channels).to(dtype)})
        rest = max(size_bytes - fixed, 0) / dtype.itemsize
        for layers in depths:
            # (18 L + 3) d^2 + (15 L + 310 + text_dim) d parameters; rounded, then counted
            a, b = 18 * layers + 3, 15 * layers + 310 + text_dim
            dim = (-b + math.sqrt(b * b + 4 * a * rest)) / (2 * a)
            for width in _widths(dim):
                cfg = DemoConfig(text_dim, width, layers, vae_channels)
                err = abs(_nbytes(_make(cfg, dtype)) - size_bytes)
                if best is None or err < best[0]:
                    best = (err, cfg)
    assert best is not None
    return best[1]


def _fill(modules: dict[str, nn.Module], seed: int) -> None:
    """Seeded weights: windows of one random pool, scaled per tensor (cheap at any size).

    Matrices and kernels get std ``1/sqrt(fan_in)`` (a tenth of it for the adaptive
    modulations), norm weights one, biases small."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(_POOL, generator=g)
    for name, p in _unique_tensors(modules):
        if not isinstance(p, nn.Parameter):
            continue
        if p.dim() == 1 and name.endswith("weight"):
            p.fill_(1.0)
            continue
        std = 0.02 if p.dim() == 1 else 1.0 / math.sqrt(p[0].numel())
        if ".ada." in name or "final_ada" in name:
            std *= 0.1
        flat = p.view(-1)
        off = int(torch.randint(_POOL, (1,), generator=g))
        pos = 0
        while pos < flat.numel():
            take = min(flat.numel() - pos, _POOL - off)
            flat[pos:pos + take].copy_(pool[off:off + take])
            pos, off = pos + take, 0
        flat.mul_(std)  # (a mixed-dtype ``torch.mul(..., out=)`` is slower for bfloat16)


# -- the pipeline ----------------------------------------------------------------------

class UsesComponents(Protocol):
    """What :meth:`DemoPipeline.generate` needs of a controller."""

    def use(self, name: str) -> AbstractAsyncContextManager[Any]: ...

    def request(self, order: Sequence[str]) -> AbstractAsyncContextManager[None]: ...


def _device_of(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


class DemoPipeline:
    """``text_encoder`` -> ``transformer`` (denoising steps) -> ``vae``; see the module doc."""

    COMPONENTS: ClassVar[tuple[str, ...]] = ("text_encoder", "transformer", "vae")

    def __init__(self, modules: dict[str, nn.Module], config: DemoConfig) -> None:
        self.modules = modules
        self.config = config

    @classmethod
    def build(cls, size_bytes: int = 64 * _MB, *, seed: int = 0, dtype: torch.dtype = torch.float32,
              num_layers: int | None = None) -> DemoPipeline:
        """A pipeline whose weights take about ``size_bytes`` (within 25% from 1 MB up;
        smaller budgets get the smallest pipeline, about 0.2 MB), on the CPU.

        The same ``(size_bytes, seed, dtype, num_layers)`` always gives the same weights."""
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be positive, got {size_bytes}")
        if num_layers is not None and num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        config = _choose(size_bytes, dtype, num_layers)
        with torch.device("meta"):
            modules = _make(config, dtype)
        with torch.no_grad():
            for module in modules.values():
                module.to_empty(device="cpu")
                module.eval()
            text = modules["text_encoder"]
            dit = modules["transformer"]
            assert isinstance(text, TextEncoder) and isinstance(dit, DiT)
            text.tie_weights()
            dit.init_buffers()
            _fill(modules, seed)
        return cls(modules, config)

    @property
    def nbytes(self) -> int:
        """Bytes of every parameter and buffer, each tensor once (tied weights once)."""
        return _nbytes(self.modules)

    # -- the computation, one component at a time --------------------------------------
    def _encode(self, module: nn.Module, prompt_ids: torch.Tensor | None) -> torch.Tensor:
        device = _device_of(module)
        if prompt_ids is None:
            prompt_ids = (torch.arange(PROMPT_LEN) * 97 + 13).remainder(VOCAB).unsqueeze(0)
        with torch.inference_mode():
            out: torch.Tensor = module(prompt_ids.to(device))
        return out

    def _denoise(self, module: nn.Module, text: torch.Tensor, steps: int,
                 seed: int) -> torch.Tensor:
        p = next(module.parameters())
        g = torch.Generator().manual_seed(seed)
        shape = (text.shape[0], LATENT_CHANNELS, LATENT_SIZE, LATENT_SIZE)
        with torch.inference_mode():
            latent = torch.randn(shape, generator=g).to(p.device, p.dtype)
            text = text.to(p.device, p.dtype)
            for i in range(steps):  # Euler steps of a flow from t=1000 down to 0
                t = torch.full((shape[0],), 1000.0 * (1 - i / steps), device=p.device)
                latent = latent - module(latent, t, text) / steps
        return latent

    def _decode(self, module: nn.Module, latent: torch.Tensor) -> torch.Tensor:
        p = next(module.parameters())
        with torch.inference_mode():
            image: torch.Tensor = module(latent.to(p.device, p.dtype)).float()
        return image

    @asynccontextmanager
    async def _use(self, ctl: UsesComponents | None, name: str) -> AsyncIterator[nn.Module]:
        if ctl is None:
            yield self.modules[name]
        else:
            async with ctl.use(name) as module:
                yield module

    async def generate(self, prompt_ids: torch.Tensor | None = None, *,
                       ctl: UsesComponents | None = None, steps: int = 3,
                       seed: int = 0) -> torch.Tensor:
        """Encode ``prompt_ids`` (default: a fixed 16-token prompt), denoise a seeded
        1 x 4 x 8 x 8 latent for ``steps`` steps, decode: a 1 x 3 x 32 x 32 float32 image.

        Each component runs inside ``ctl.use(name)``, all within one ``ctl.request``, when
        ``ctl`` is given (so the next component moves in while one runs). Inference mode
        is entered around each forward only, never across an ``await``: it is thread-local
        state, and tensors a controller allocates while it is on would become inference
        tensors that cannot be updated in place later."""
        plan = ctl.request(self.COMPONENTS) if ctl is not None else contextlib.nullcontext()
        async with plan:  # the next component moves in while the current one runs
            async with self._use(ctl, "text_encoder") as module:
                text = self._encode(module, prompt_ids)
            async with self._use(ctl, "transformer") as module:
                latent = self._denoise(module, text, steps, seed)
            async with self._use(ctl, "vae") as module:
                return self._decode(module, latent)

    def forward_sync(self, steps: int = 2, seed: int = 0) -> torch.Tensor:
        """:meth:`generate` on the modules directly, without a controller (benchmarks)."""
        text = self._encode(self.modules["text_encoder"], None)
        latent = self._denoise(self.modules["transformer"], text, steps, seed)
        return self._decode(self.modules["vae"], latent)
