"""An MoE layer's expert projection for a decode step's few token-expert pairs, read in place.

For pair p (a token's row of x routed to expert e_p):

    y[p] = weight[e_p] @ x[p]            (weight `[E, N, K]`, x `[P, K]`, y `[P, N]`)

or, for fp8 experts (float8_e4m3fn weights with a scale per expert and output channel, `[E, N]`),
`y[p] = scale[e_p] * (weight[e_p] @ x[p])`.

A decode step of a few tokens routes each to a handful of experts: the grouped GEMM that serves a
prefill (pairs sorted by expert, tiles of rows per expert) then runs tiles that are almost all
padding, after a sort, a histogram and a scatter that each cost a launch. Here the pairs stay in
token order and each program reads one pair's expert rows where they lie (a matrix-vector product,
fp32 sums): bound by the bytes of the chosen experts, in one launch. A pair's expert is read once per
pair, so this serves only steps whose pairs rarely share an expert (`DECODE_PAIRS`).
`expert_gemv_reference` gathers each pair's expert weights (a `[P, N, K]` copy) for a batched matmul.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Up to this many token-expert pairs (4 tokens at top-8) a step's experts run `expert_gemv`; more
# share experts often enough for the sorted grouped GEMM to read less.
DECODE_PAIRS = 32


def expert_gemv_reference(x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor,
                          scale: torch.Tensor | None = None) -> torch.Tensor:
    """`[P, N]` in x's dtype (see the module docstring), in torch ops (fp8 experts dequantized)."""
    w = weight[expert]
    if scale is not None:
        w = (w.float() * scale[expert].float()[..., None]).to(x.dtype)
    return torch.bmm(w, x.to(w.dtype)[:, :, None])[..., 0].to(x.dtype)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, expert_ptr, y_ptr, N, K, stride_x, stride_we, stride_wn, stride_se,
                 stride_y, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALED: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < N
    expert = tl.load(expert_ptr + p).to(tl.int64)
    base = w_ptr + expert * stride_we
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(x_ptr + p.to(tl.int64) * stride_x + ks, mask=in_k, other=0.0).to(tl.float32)
        w = tl.load(base + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=inside[:, None] & in_k[None, :],
                    other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if SCALED:  # fp8 experts: each output channel's scale, once after the sum
        acc *= tl.load(scale_ptr + expert * stride_se + cols, mask=inside, other=0.0)
    tl.store(y_ptr + p.to(tl.int64) * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=inside)


def _expert_gemv(x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor,
                 scale: torch.Tensor | None = None) -> torch.Tensor:
    pairs, k = x.shape
    n = weight.shape[1]
    if weight.stride(2) != 1:
        raise ValueError("expert_gemv needs each expert's rows contiguous along K")
    if scale is not None and (scale.shape != weight.shape[:2] or scale.stride(1) != 1):
        raise ValueError(f"expert_gemv's scales must be [E, N] = {tuple(weight.shape[:2])} with N contiguous, "
                         f"got {tuple(scale.shape)}")
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    expert = expert.to(torch.int32).contiguous()
    block_n = 32
    scaled = scale is not None
    _gemv_kernel[(pairs, triton.cdiv(n, block_n))](x, weight, scale if scaled else weight, expert, y, n, k, x.stride(0),
                                                   weight.stride(0), weight.stride(1),
                                                   scale.stride(0) if scaled else 0, y.stride(0), BLOCK_N=block_n,
                                                   BLOCK_K=128, SCALED=scaled, num_warps=4)
    return y


# An opaque op for torch.compile (the kernel launches from Python).
expert_gemv = torch.library.custom_op("lorazor::expert_gemv", mutates_args=())(_expert_gemv)


@expert_gemv.register_fake
def _(x, weight, expert, scale=None):
    return x.new_empty(x.shape[0], weight.shape[1])
