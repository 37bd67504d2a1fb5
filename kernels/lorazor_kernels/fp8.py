"""fp8 base weights: per-output-channel quantization to float8_e4m3fn and the GEMM over them.

Semantics:
    scale[n] = max_k |W[n, k]| / 448                       # per output channel, float32
    W8[n, k] = float8_e4m3fn(W[n, k] / scale[n])
    fp8_linear(x, W8, scale, b) ~= x @ (W8 * scale[:, None]).T + b

On a GPU with fp8 matrix units (compute capability >= 8.9), activations are quantized per token on
the fly (a scale per row of x, as vLLM's `--quantization fp8` does) and the product runs in
`torch._scaled_mm` with both scales applied in its epilogue. Elsewhere (the CPU) the weights are
dequantized to x's dtype and the product is a plain linear: the same weights, activations unrounded.
`fp8_linear_reference` is the dequantized definition; `scaled=True` forces the `_scaled_mm` path
(torch runs it on the CPU too, so tests check it there).
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# torch._scaled_mm's GPU kernels want the rows of x in multiples of this.
ROW_MULTIPLE = 16
# The smallest scale: an all-zero row quantizes to zeros, never divides by zero.
MIN_SCALE = 1e-12


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8 `[N, K]` float8_e4m3fn, scale `[N]` float32) for a `[N, K]` weight, per output channel."""
    w = weight.detach().float()
    scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=MIN_SCALE)
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """W8 * scale[:, None] in `dtype` (the weights an fp8 layer computes with)."""
    return (weight.float() * scale.float()[:, None]).to(dtype)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """The definition: a linear over the dequantized weights, in x's dtype."""
    return torch.nn.functional.linear(x, dequantize(weight, scale, x.dtype), bias)


def scaled_mm_available(device: torch.device) -> bool:
    """Whether `torch._scaled_mm` runs fp8 on `device`'s matrix units (Ada, Hopper and newer)."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
               scaled: bool | None = None) -> torch.Tensor:
    """`x [M, K]` times fp8 `weight [N, K]` with per-channel `scale [N]`, plus `bias`; `[M, N]` in
    x's dtype. `scaled`: the `_scaled_mm` path with per-token activation scales (None: where the
    GPU has fp8 matrix units)."""
    if scaled is None:  # the GPU's fp8 rowwise-scaled GEMM writes bf16
        scaled = x.dtype == torch.bfloat16 and scaled_mm_available(x.device)
    if not scaled:
        return fp8_linear_reference(x, weight, scale, bias)
    rows = x.shape[0]
    pad = -rows % ROW_MULTIPLE if x.is_cuda else 0
    if pad:
        x = torch.nn.functional.pad(x, (0, 0, 0, pad))
    x_scale = (x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=MIN_SCALE)
    x8 = (x.float() / x_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    # weight.t() of a row-major [N, K] is the column-major [K, N] _scaled_mm wants for its second operand.
    y = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.float()[None, :], out_dtype=x.dtype,
                         bias=None if bias is None else bias.to(x.dtype))
    return y[:rows] if pad else y
