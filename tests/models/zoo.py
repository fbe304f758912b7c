"""A catalogue of real diffusers and transformers models built from tiny configs (nothing is downloaded).

Each :class:`ModelCase` builds its model from a seed (same seed: bit-identical weights), makes
deterministic example inputs from a seed, and picks the main output tensor of a forward. The
models keep the structure of the real ones (block lists, tied weights, weight norm, rotary
embeddings, attention processors); only the widths, depths and input sizes are tiny, so every
model is a few hundred KB at most and a forward takes a few milliseconds on a CPU.

:func:`tiny_flux_pipeline` puts tiny components together into a real ``diffusers.FluxPipeline``
(tokenizers built in memory) that generates a 32x32 image in two steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
import transformers
from torch import nn

__all__ = ["CASES", "DEEP", "ModelCase", "build_deep", "flux_call_kwargs", "plain_tensor_attributes",
           "tiny_flux_pipeline"]


@dataclass(frozen=True)
class ModelCase:
    """One model of the catalogue: how to build it, feed it and read its output."""

    name: str
    family: str  # "diffusers" or "transformers"
    build: Callable[[int], nn.Module]  # build(seed): float32, eval(); same seed => bit-identical weights
    inputs: Callable[[int], dict[str, Any]]  # inputs(seed): keyword arguments of forward, deterministic
    output: Callable[[Any], torch.Tensor]  # the main output tensor out of what forward returned
    block_lists: tuple[str, ...]  # the nn.ModuleLists of repeated blocks, in execution order
    block: str  # one block a test can call directly
    leaf: str  # one leaf module that holds weights
    # How many tensors the built module holds as plain attributes, neither parameters nor buffers
    # (see plain_tensor_attributes): weight_norm's recomputed ``weight`` in Oobleck, none elsewhere.
    plain_tensors: int = 0

    def run(self, module: nn.Module, seed: int = 0) -> torch.Tensor:
        """One forward of ``module`` (built by this case) on ``inputs(seed)``, without autograd."""
        with torch.no_grad():
            return self.output(module(**self.inputs(seed)))


def _seeded(seed: int, make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(seed)
    module = make().eval()
    # float32 by construction (torch's default dtype); no .to(): diffusers logs a warning for that.
    tensors = [*module.parameters(), *module.buffers()]
    assert all(t.dtype == torch.float32 for t in tensors if t.is_floating_point())
    return module


def _randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen)


def _sample(out: Any) -> torch.Tensor:
    sample: torch.Tensor = out.sample
    return sample


def _last_hidden_state(out: Any) -> torch.Tensor:
    hidden: torch.Tensor = out.last_hidden_state
    return hidden


# --- Flux -----------------------------------------------------------------------------------------
# The packed latent of a 32x32 image: a 4-channel 8x8 latent (VAE scale factor 4) in 2x2 patches,
# so 16 tokens of 16 channels. Text: 8 T5 tokens of width 32 and CLIP's pooled output of width 16.

_FLUX_LATENT_CHANNELS = 4
_TEXT_DIM = 32  # T5 d_model: the width of the text tokens every DiT here takes
_POOLED_DIM = 16  # CLIP hidden size: FluxPipeline passes CLIPTextModel's pooler_output
_TEXT_LEN = 8


def _flux_transformer(depth: int = 2) -> diffusers.FluxTransformer2DModel:
    return diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=4 * _FLUX_LATENT_CHANNELS, num_layers=depth,
        num_single_layers=depth if depth == 2 else 2 * depth,  # FLUX.1: 19 double, 38 single
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=_TEXT_DIM,
        pooled_projection_dim=_POOLED_DIM, guidance_embeds=True, axes_dims_rope=(2, 2, 4))


def _flux_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    h = w = 4  # packed latent grid: 16 image tokens
    img_ids = torch.zeros(h, w, 3)
    img_ids[..., 1] = torch.arange(h)[:, None]
    img_ids[..., 2] = torch.arange(w)[None, :]
    return {
        "hidden_states": _randn(gen, 1, h * w, 4 * _FLUX_LATENT_CHANNELS),
        "encoder_hidden_states": _randn(gen, 1, _TEXT_LEN, _TEXT_DIM),
        "pooled_projections": _randn(gen, 1, _POOLED_DIM),
        "timestep": torch.rand(1, generator=gen),
        "img_ids": img_ids.reshape(h * w, 3),
        "txt_ids": torch.zeros(_TEXT_LEN, 3),
        "guidance": torch.full((1,), 3.5),
    }


# --- SD3 ------------------------------------------------------------------------------------------


def _sd3_transformer(depth: int = 2) -> diffusers.SD3Transformer2DModel:
    return diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_layers=depth, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=_TEXT_DIM, caption_projection_dim=16,
        pooled_projection_dim=_POOLED_DIM, out_channels=4, pos_embed_max_size=8,
        dual_attention_layers=(0,), qk_norm="rms_norm")  # SD3.5-style: first block dual attention


def _sd3_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": _randn(gen, 1, 4, 8, 8),
        "encoder_hidden_states": _randn(gen, 1, _TEXT_LEN, _TEXT_DIM),
        "pooled_projections": _randn(gen, 1, _POOLED_DIM),
        "timestep": torch.randint(0, 1000, (1,), generator=gen),
    }


# --- Wan ------------------------------------------------------------------------------------------


def _wan_transformer(depth: int = 2) -> diffusers.WanTransformer3DModel:
    return diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=_TEXT_DIM, freq_dim=16, ffn_dim=32, num_layers=depth,
        rope_max_seq_len=32)


def _wan_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": _randn(gen, 1, 4, 2, 8, 8),  # (batch, channels, frames, height, width)
        "timestep": torch.randint(0, 1000, (1,), generator=gen),
        "encoder_hidden_states": _randn(gen, 1, _TEXT_LEN, _TEXT_DIM),
    }


# --- LTX-Video ------------------------------------------------------------------------------------


def _ltx_transformer(depth: int = 2) -> diffusers.LTXVideoTransformer3DModel:
    return diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, patch_size=1, patch_size_t=1, num_attention_heads=2,
        attention_head_dim=8, cross_attention_dim=16, num_layers=depth, caption_channels=_TEXT_DIM)


def _ltx_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    frames, height, width = 2, 4, 4
    mask = torch.ones(1, _TEXT_LEN, dtype=torch.long)
    mask[:, -2:] = 0  # two padding tokens
    return {
        "hidden_states": _randn(gen, 1, frames * height * width, 8),
        "encoder_hidden_states": _randn(gen, 1, _TEXT_LEN, _TEXT_DIM),
        "timestep": torch.randint(0, 1000, (1,), generator=gen),
        "encoder_attention_mask": mask,
        "num_frames": frames,
        "height": height,
        "width": width,
    }


# --- HunyuanVideo ---------------------------------------------------------------------------------


def _hunyuan_transformer(depth: int = 2) -> diffusers.HunyuanVideoTransformer3DModel:
    return diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=depth,
        num_single_layers=depth if depth == 2 else 2 * depth, num_refiner_layers=2, patch_size=2,
        patch_size_t=1,
        guidance_embeds=True, text_embed_dim=_TEXT_DIM, pooled_projection_dim=_POOLED_DIM,
        rope_axes_dim=(2, 2, 4))


def _hunyuan_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, _TEXT_LEN, dtype=torch.long)
    mask[:, -2:] = 0
    return {
        "hidden_states": _randn(gen, 1, 4, 2, 8, 8),
        "timestep": torch.randint(0, 1000, (1,), generator=gen),
        "encoder_hidden_states": _randn(gen, 1, _TEXT_LEN, _TEXT_DIM),
        "encoder_attention_mask": mask,
        "pooled_projections": _randn(gen, 1, _POOLED_DIM),
        "guidance": torch.full((1,), 6000.0),  # embedded like a timestep: guidance scale * 1000
    }


# --- Stable Diffusion UNet ------------------------------------------------------------------------


def _unet() -> diffusers.UNet2DConditionModel:
    return diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), norm_num_groups=4,
        cross_attention_dim=_TEXT_DIM, attention_head_dim=4)


def _unet_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "sample": _randn(gen, 1, 4, 8, 8),
        "timestep": torch.randint(0, 1000, (1,), generator=gen),
        "encoder_hidden_states": _randn(gen, 1, _TEXT_LEN, _TEXT_DIM),
    }


# --- AutoencoderKL --------------------------------------------------------------------------------


def _vae(latent_channels: int = 4, shift_factor: float | None = None) -> diffusers.AutoencoderKL:
    return diffusers.AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=latent_channels,
        down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"),
        block_out_channels=(8, 8, 16), layers_per_block=1, norm_num_groups=4, sample_size=32,
        scaling_factor=0.5, shift_factor=shift_factor)


def _vae_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"sample": torch.rand(1, 3, 16, 16, generator=gen) * 2 - 1}


# --- AutoencoderOobleck (Stable Audio) ------------------------------------------------------------


def _oobleck() -> diffusers.AutoencoderOobleck:
    # torch.nn.utils.weight_norm (which diffusers' Oobleck layers use) is deprecated in favour of
    # torch.nn.utils.parametrizations.weight_norm: torch's FutureWarning about diffusers' code.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return diffusers.AutoencoderOobleck(
            encoder_hidden_size=4, downsampling_ratios=[2, 2], channel_multiples=[1, 2],
            decoder_channels=4, decoder_input_channels=2, audio_channels=2, sampling_rate=1000)


def _oobleck_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    return {"sample": _randn(gen, 1, 2, 64)}  # (batch, audio channels, samples)


# --- Text encoders --------------------------------------------------------------------------------

_CLIP_VOCAB = 128
_CLIP_MAX_LEN = 16
_T5_VOCAB = 64


def _clip_config(depth: int = 2) -> transformers.CLIPTextConfig:
    return transformers.CLIPTextConfig(
        vocab_size=_CLIP_VOCAB, hidden_size=_POOLED_DIM, intermediate_size=32, projection_dim=_POOLED_DIM,
        num_hidden_layers=depth, num_attention_heads=2, max_position_embeddings=_CLIP_MAX_LEN,
        bos_token_id=0, eos_token_id=1, pad_token_id=1)


def _clip(depth: int = 2) -> transformers.CLIPTextModel:
    return transformers.CLIPTextModel(_clip_config(depth))


def _clip_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, _CLIP_VOCAB, (1, _TEXT_LEN), generator=gen)
    ids[:, 0], ids[:, -1] = 0, 1  # bos ... eos
    return {"input_ids": ids}


def _t5_config(depth: int = 2) -> transformers.T5Config:
    return transformers.T5Config(
        vocab_size=_T5_VOCAB, d_model=_TEXT_DIM, d_kv=8, d_ff=32, num_layers=depth, num_heads=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16,
        feed_forward_proj="gated-gelu", dropout_rate=0.0, pad_token_id=0, eos_token_id=1)


def _t5(depth: int = 2) -> transformers.T5EncoderModel:
    return transformers.T5EncoderModel(_t5_config(depth))


def _t5_inputs(seed: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, _T5_VOCAB, (1, _TEXT_LEN), generator=gen)
    ids[:, -1] = 1  # eos
    return {"input_ids": ids}


def _case(name: str, family: str, make: Callable[[], nn.Module], inputs: Callable[[int], dict[str, Any]],
          output: Callable[[Any], torch.Tensor], block_lists: tuple[str, ...], block: str,
          leaf: str, plain_tensors: int = 0) -> ModelCase:
    def build(seed: int) -> nn.Module:
        return _seeded(seed, make)

    return ModelCase(name, family, build, inputs, output, block_lists, block, leaf, plain_tensors)


CASES: dict[str, ModelCase] = {c.name: c for c in [
    _case("flux", "diffusers", _flux_transformer, _flux_inputs, _sample,
          ("transformer_blocks", "single_transformer_blocks"), "transformer_blocks.0", "proj_out"),
    _case("sd3", "diffusers", _sd3_transformer, _sd3_inputs, _sample,
          ("transformer_blocks",), "transformer_blocks.0", "proj_out"),
    _case("wan", "diffusers", _wan_transformer, _wan_inputs, _sample,
          ("blocks",), "blocks.0", "proj_out"),
    _case("ltx_video", "diffusers", _ltx_transformer, _ltx_inputs, _sample,
          ("transformer_blocks",), "transformer_blocks.0", "proj_out"),
    _case("hunyuan_video", "diffusers", _hunyuan_transformer, _hunyuan_inputs, _sample,
          ("context_embedder.token_refiner.refiner_blocks", "transformer_blocks",
           "single_transformer_blocks"), "transformer_blocks.0", "proj_out"),
    _case("unet", "diffusers", _unet, _unet_inputs, _sample,
          ("down_blocks", "up_blocks"), "down_blocks.0", "conv_out"),
    _case("vae", "diffusers", _vae, _vae_inputs, _sample,
          ("encoder.down_blocks", "decoder.up_blocks"), "decoder.up_blocks.0", "decoder.conv_out"),
    _case("oobleck", "diffusers", _oobleck, _oobleck_inputs, _sample,
          ("encoder.block", "decoder.block"), "encoder.block.0", "encoder.block.0.res_unit1.conv1",
          plain_tensors=32),  # weight_norm's ``weight`` on each of the 32 convolutions
    _case("clip_text", "transformers", _clip, _clip_inputs, _last_hidden_state,
          ("encoder.layers",), "encoder.layers.0", "encoder.layers.1.mlp.fc2"),
    _case("t5_encoder", "transformers", _t5, _t5_inputs, _last_hidden_state,
          ("encoder.block",), "encoder.block.0", "encoder.block.0.layer.1.DenseReluDense.wo"),
]}


# Deeper builds of the models whose depth is one number (blocks per list), for benchmarks:
# tiny widths still, but enough layers that streaming them can save something.
DEEP: dict[str, Callable[[int], nn.Module]] = {
    "flux": _flux_transformer, "sd3": _sd3_transformer, "wan": _wan_transformer,
    "ltx_video": _ltx_transformer, "hunyuan_video": _hunyuan_transformer, "clip_text": _clip,
    "t5_encoder": _t5,
}


def build_deep(name: str, depth: int, seed: int = 0) -> nn.Module:
    """Case ``name`` built with ``depth`` blocks per list (Flux and HunyuanVideo: ``depth``
    double blocks and ``2 * depth`` single ones), from ``seed``."""
    return _seeded(seed, lambda: DEEP[name](depth))


# --- Plain tensors ---------------------------------------------------------------------------------


def _tensors_in(value: Any, path: str) -> Iterator[str]:
    if isinstance(value, torch.Tensor):
        yield path
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors_in(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors_in(item, f"{path}[{key!r}]")


def plain_tensor_attributes(module: nn.Module) -> list[str]:
    """Tensors a module holds as plain attributes (in ``__dict__``, also inside lists, tuples and dicts)
    that are neither parameters nor buffers, e.g. the ``weight`` weight_norm recomputes each forward."""
    found = []
    for name, sub in module.named_modules(remove_duplicate=False):
        for attr, value in vars(sub).items():
            if attr in ("_parameters", "_buffers", "_modules"):
                continue
            found += [f"{name}.{p}" if name else p for p in _tensors_in(value, attr)]
    return found


# --- A real FluxPipeline ----------------------------------------------------------------------------

_WORDS = "a photo of tiny red fox cat dog sitting on the grass under blue sky"


def _clip_tokenizer() -> transformers.CLIPTokenizer:
    # CLIP's byte-level BPE: letters (a word's last one with "</w>"), and merges that make whole
    # tokens of the words in _WORDS (any other word stays spelled out).
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in "abcdefghijklmnopqrstuvwxyz":
        vocab.setdefault(ch, len(vocab))
        vocab.setdefault(ch + "</w>", len(vocab))
    merges: list[Any] = []  # pairs: CLIPTokenizer's annotation says list[str], tokenizers' BPE wants tuples
    for word in dict.fromkeys(_WORDS.split()):
        pieces = [*word[:-1], word[-1] + "</w>"]
        merged = pieces[0]
        for piece in pieces[1:]:
            if merged + piece not in vocab:
                merges.append((merged, piece))
                vocab[merged + piece] = len(vocab)
            merged += piece
    assert len(vocab) <= _CLIP_VOCAB
    return transformers.CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=_CLIP_MAX_LEN)


def _t5_tokenizer() -> transformers.T5Tokenizer:
    # T5's unigram model over a few words ("▁" marks a word start) and single letters.
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    pieces += [("▁" + w, -1.0) for w in dict.fromkeys(_WORDS.split())]
    pieces += [(ch, -3.0) for ch in "abcdefghijklmnopqrstuvwxyz"]
    assert len(pieces) <= _T5_VOCAB
    return transformers.T5Tokenizer(vocab=pieces, extra_ids=0)  # T5TokenizerFast is an alias of it


def tiny_flux_pipeline(seed: int = 0, tmp_path: Path | None = None) -> diffusers.FluxPipeline:
    """A real FluxPipeline of tiny random components (weights from ``seed``), progress bar off.

    Tokenizers are built in memory, so ``tmp_path`` is not needed (accepted for callers that
    keep files next to the pipeline)."""
    del tmp_path
    torch.manual_seed(seed)
    transformer = _flux_transformer()
    vae = _vae(latent_channels=_FLUX_LATENT_CHANNELS, shift_factor=0.1)
    text_encoder = _clip()
    text_encoder_2 = _t5()
    pipe = diffusers.FluxPipeline(
        # FLUX.1-dev's scheduler config: the shift depends on the image's sequence length.
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(
            shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
            base_image_seq_len=256, max_image_seq_len=4096),
        vae=vae.eval(), text_encoder=text_encoder.eval(), tokenizer=_clip_tokenizer(),
        text_encoder_2=text_encoder_2.eval(), tokenizer_2=_t5_tokenizer(),
        transformer=transformer.eval())
    pipe.set_progress_bar_config(disable=True)
    return pipe


def flux_call_kwargs(seed: int = 0) -> dict[str, Any]:
    """Keyword arguments of ``tiny_flux_pipeline()(...)``: a 32x32 image in two steps."""
    return {
        "prompt": "a photo of a tiny red fox",
        "height": 32,
        "width": 32,
        "num_inference_steps": 2,
        "guidance_scale": 3.5,
        "max_sequence_length": 16,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
    }
