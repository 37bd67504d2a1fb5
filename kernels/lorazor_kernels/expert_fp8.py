"""fp8 expert weights: per-channel quantization of fused experts, and a sorted step's grouped GEMM.

`quantize_experts(weight)`: `[E, N, K]` -> (float8_e4m3fn `[E, N, K]`, float32 scales `[E, N]`), one
scale per expert and output channel (`quantize_rows` on each expert). `expert_grouped_fp8(x, weight,
scale, offsets, expert)`: `x[p] @ (scale[e_p] * weight[e_p]).T` for token-expert pairs sorted by
expert (`offsets`: each expert's end, int32; `expert`: each pair's expert). On a Hopper GPU in bf16
the pairs' activations are quantized per token (`quantize_tokens`) and torch's row-wise scaled
grouped GEMM (`torch._scaled_grouped_mm`, the fp8 MoE GEMM of torchao and others) multiplies them with
the fp8 experts in one launch, both scales applied in its epilogue; elsewhere each pair's expert is
dequantized (`expert_gemv_reference`: the definition, and a `[P, N, K]` gather).
"""

from __future__ import annotations

import torch

from .expert_gemv import expert_gemv_reference
from .fp8 import ROW_MULTIPLE, quantize_rows, quantize_tokens


def quantize_experts(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8 `[E, N, K]` float8_e4m3fn, scale `[E, N]` float32) for fused expert weights `[E, N, K]`."""
    experts, n, k = weight.shape
    w8, scale = quantize_rows(weight.reshape(experts * n, k))
    return w8.view(experts, n, k), scale.view(experts, n)


def grouped_fp8_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `torch._scaled_grouped_mm` serves this product: bf16 activations on a Hopper GPU (its
    fp8 grouped kernels are sm90's), both dims in multiples of 16."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and not weight.shape[1] % ROW_MULTIPLE and not weight.shape[2] % ROW_MULTIPLE)


def _expert_grouped_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, offsets: torch.Tensor,
                        expert: torch.Tensor) -> torch.Tensor:
    if not grouped_fp8_available(x, weight):
        return expert_gemv_reference(x, weight, expert, scale)
    x8, x_scale = quantize_tokens(x, x.shape[0])
    # weight.transpose of a row-major [E, N, K] is the column-major [E, K, N] the GEMM wants.
    return torch._scaled_grouped_mm(x8, weight.transpose(1, 2), x_scale.view(-1), scale.float(),
                                    offs=offsets.int(), out_dtype=x.dtype, use_fast_accum=True)


# An opaque op for torch.compile (as `fp8_linear_op`: the quantization kernel and the scaled GEMM stay
# out of inductor's graph).
expert_grouped_fp8 = torch.library.custom_op("lorazor::expert_grouped_fp8", mutates_args=())(_expert_grouped_fp8)


@expert_grouped_fp8.register_fake
def _(x, weight, scale, offsets, expert):
    return x.new_empty(x.shape[0], weight.shape[1])
