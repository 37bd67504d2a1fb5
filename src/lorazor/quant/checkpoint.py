"""Hugging Face fp8 checkpoints, loaded in fp8.

The Hugging Face "fp8" format (transformers' FineGrainedFP8, used by Qwen3-FP8 and DeepSeek's
checkpoints): `config.json` holds `quantization_config = {"quant_method": "fp8", "weight_block_size":
[bn, bk], ...}` and each quantized projection stores `weight` in float8_e4m3fn `[N, K]` and
`weight_scale_inv` in float32 `[ceil(N / bn), ceil(K / bk)]`, one multiplier per block:
`W[n, k] = weight[n, k] * weight_scale_inv[n // bn, k // bk]`.

transformers dequantizes such a checkpoint to the full dtype when it loads on the CPU. LoRazor loads
the model without its quantizer (the other tensors: embeddings, norms, the LM head, in the model
dtype), then builds each projection's `Fp8Linear` from the checkpoint's own fp8 weights and block
scales. Blocks of 128x128 (the format's published checkpoints: Qwen3-FP8, DeepSeek-V3) are kept as
they are, and LoRazor's fp8 GEMM computes with them (`lorazor_kernels.fp8`: the weights are exactly
the checkpoint's). Other block sizes are re-scaled to one scale per output channel: each row takes
its largest block scale, so that block keeps its fp8 values exactly and the row's other blocks are
rounded to fp8 once more (docs/models.md gives what that costs).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from lorazor_kernels.fp8 import FP8, FP8_MAX, MIN_SCALE, SCALE_BLOCK
from torch import nn

# `quantization_config.quant_method`s whose checkpoints load (quantized bf16/fp16/fp32 bases are
# served with LoRazorConfig(quantization="fp8") instead).
SUPPORTED_CHECKPOINTS = ("fp8",)
SCALE_SUFFIX = ".weight_scale_inv"


def checkpoint_quantization(hf_config) -> dict | None:
    """The checkpoint's `quantization_config` as a dict when it is one LoRazor loads; None when it
    has none. Raises ValueError naming what is supported for any other scheme."""
    found = getattr(hf_config, "quantization_config", None)
    if found is None:
        return None
    found = found if isinstance(found, dict) else found.to_dict()
    method = found.get("quant_method")
    if method not in SUPPORTED_CHECKPOINTS:
        raise ValueError(f"the checkpoint's quantization_config.quant_method is {method!r}; LoRazor loads "
                         f"{SUPPORTED_CHECKPOINTS} checkpoints (block-scaled float8_e4m3fn, the Hugging Face "
                         "fp8 format), and quantizes an unquantized base with quantization='fp8'")
    block = found.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"an fp8 checkpoint needs quantization_config.weight_block_size = [rows, cols] (block "
                         f"scales in weight_scale_inv), got {block!r}")
    return found


def without_quantization(hf_config):
    """A copy of the model config without its `quantization_config` (transformers then loads the
    checkpoint's tensors as they are, with no quantizer)."""
    plain = copy.deepcopy(hf_config)
    if hasattr(plain, "quantization_config"):
        delattr(plain, "quantization_config")
    return plain


def checkpoint_scales(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, float32 scales) as LoRazor's fp8 GEMM takes them: the checkpoint's own for 128x128
    blocks (a 2-D scale), else one per output channel (`block_to_channel`)."""
    bn, bk = block
    n, k = weight.shape
    expected = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(f"weight_scale_inv of shape {tuple(scale_inv.shape)} for a {n}x{k} weight in {bn}x{bk} "
                         f"blocks; expected {expected}")
    if (bn, bk) == (SCALE_BLOCK, SCALE_BLOCK):
        return weight, scale_inv.float().contiguous()
    return block_to_channel(weight, scale_inv, block)


def block_to_channel(weight: torch.Tensor, scale_inv: torch.Tensor, block) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, per-output-channel float32 scale) equal to the block-scaled `weight`, up to one more
    fp8 rounding of the blocks whose scale is below their row's largest."""
    bn, bk = block
    n, k = weight.shape
    scales = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    # A row's scale is its largest block scale: that block's fp8 values stay as they are, the others
    # (scaled by at most 1, so never out of range) are rounded to fp8 once more.
    row_scale = scales.amax(dim=1).clamp(min=MIN_SCALE)
    return (weight.float() * scales / row_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), row_scale


def checkpoint_files(base, load_kwargs: dict) -> list[Path]:
    """The checkpoint's safetensors files: a local folder's, or a Hub repo's (fetched into the Hub cache)."""
    folder = Path(str(base))
    if not folder.is_dir():
        from huggingface_hub import snapshot_download

        keys = ("revision", "token", "cache_dir", "local_files_only")
        folder = Path(snapshot_download(str(base), allow_patterns=["*.safetensors", "*.json"],
                                        **{k: v for k, v in load_kwargs.items() if k in keys}))
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"an fp8 checkpoint loads from safetensors files; {folder} has none")
    return files


def read_fp8_projections(files: list[Path], hf_model: nn.Module, block) -> dict[nn.Module, tuple]:
    """The checkpoint's fp8 projections: the model's nn.Linear -> (fp8 weight, scales:
    `checkpoint_scales`), for every weight stored with a `weight_scale_inv`."""
    from safetensors import safe_open

    where = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            where.update({key: path for key in handle.keys()})
    found = {}
    for key in where:
        if not key.endswith(SCALE_SUFFIX):
            continue
        name = key[: -len(SCALE_SUFFIX)]
        module = hf_model.get_submodule(name)
        if not isinstance(module, nn.Linear):
            raise ValueError(f"the checkpoint scales {name!r}, which is a {type(module).__name__}, not a linear")
        tensors = {}
        for suffix in (".weight", SCALE_SUFFIX):
            with safe_open(str(where[name + suffix]), framework="pt") as handle:
                tensors[suffix] = handle.get_tensor(name + suffix)
        if tensors[".weight"].dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}.weight is {tensors['.weight'].dtype}; an fp8 checkpoint stores float8_e4m3fn")
        found[module] = checkpoint_scales(tensors[".weight"], tensors[SCALE_SUFFIX], block)
    if not found:
        raise ValueError("the checkpoint says fp8 but stores no weight_scale_inv tensor")
    return found

