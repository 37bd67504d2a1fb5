"""An MoE layer's token outputs from its token-expert pairs' outputs, sorted by expert.

For token t with top-k experts, routing weights `weights[t, j]` and pair rows `inverse[t * k + j]` of
`out` (the pairs' outputs in expert order):

    y[t] = sum_j weights[t, j] * out[inverse[t * k + j]]        (fp32 sums, y in out's dtype)

torch.compile fuses the same gather, product and sum into one generated reduction whose speed, on an
H100, depended on the graph it was compiled in: 0.32 ms a layer for the 8 MB of a 256-token decode
step in the backbone-only graphs, 0.05 ms in the adapters' (`benchmarks/results/moe_h100/`). Here each
program reads its token's k rows as one `[k, BLOCK_N]` tile, contiguous along N, in one launch per
layer that inductor cannot re-fuse.
`expert_combine_reference` is the same in torch ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def expert_combine_reference(out: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`[T, N]` in out's dtype (see the module docstring), in torch ops."""
    tokens, top_k = weights.shape
    pairs = out[inverse].float() * weights.reshape(-1, 1).float()
    return pairs.view(tokens, top_k, out.shape[1]).sum(dim=1).to(out.dtype)


@triton.jit(do_not_specialize=["N"])
def _combine_kernel(out_ptr, inverse_ptr, weights_ptr, y_ptr, N, stride_out, stride_w, stride_y,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < N
    js = tl.arange(0, K_PAD)
    chosen = js < TOP_K
    rows = tl.load(inverse_ptr + t * TOP_K + js, mask=chosen, other=0).to(tl.int64)
    w = tl.load(weights_ptr + t * stride_w + js, mask=chosen, other=0.0).to(tl.float32)
    tile = tl.load(out_ptr + rows[:, None] * stride_out + cols[None, :], mask=chosen[:, None] & inside[None, :],
                   other=0.0)
    y = tl.sum(tile.to(tl.float32) * w[:, None], axis=0)
    tl.store(y_ptr + t * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


def _expert_combine(out: torch.Tensor, inverse: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    tokens, top_k = weights.shape
    if out.dim() != 2 or inverse.shape != (tokens * top_k,) or out.shape[0] != tokens * top_k:
        raise ValueError(f"expert_combine needs out [T * k, N], inverse [T * k] and weights [T, k]; got out "
                         f"{tuple(out.shape)}, inverse {tuple(inverse.shape)}, weights {tuple(weights.shape)}")
    n = out.shape[1]
    y = torch.empty(tokens, n, dtype=out.dtype, device=out.device)
    if tokens == 0:
        return y
    out = out if out.stride(1) == 1 else out.contiguous()
    weights = weights if weights.stride(1) == 1 else weights.contiguous()
    block_n = min(512, triton.next_power_of_2(n))
    _combine_kernel[(tokens, triton.cdiv(n, block_n))](out, inverse.contiguous(), weights, y, n, out.stride(0),
                                                       weights.stride(0), y.stride(0), TOP_K=top_k,
                                                       K_PAD=triton.next_power_of_2(top_k), BLOCK_N=block_n,
                                                       num_warps=4)
    return y


# An opaque op for torch.compile (the kernel launches from Python, and inductor must not re-fuse the gather).
expert_combine = torch.library.custom_op("lorazor::expert_combine", mutates_args=())(_expert_combine)


@expert_combine.register_fake
def _(out, inverse, weights):
    return out.new_empty(weights.shape[0], out.shape[1])
