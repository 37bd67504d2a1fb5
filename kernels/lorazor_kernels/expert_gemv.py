"""An MoE layer's expert projection for a decode step's few token-expert pairs, read in place.

For pair p (a token's row of x routed to expert e_p):

    y[p] = weight[e_p] @ x[p]            (weight `[E, N, K]`, x `[P, K]`, y `[P, N]`)

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


def expert_gemv_reference(x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """`[P, N]` in x's dtype (see the module docstring), in torch ops."""
    return torch.bmm(weight[expert], x.to(weight.dtype)[:, :, None])[..., 0].to(x.dtype)


@triton.jit(do_not_specialize=["N", "K"])
def _gemv_kernel(x_ptr, w_ptr, expert_ptr, y_ptr, N, K, stride_x, stride_we, stride_wn, stride_y,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < N
    base = w_ptr + tl.load(expert_ptr + p).to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks < K
        x = tl.load(x_ptr + p.to(tl.int64) * stride_x + ks, mask=in_k, other=0.0).to(tl.float32)
        w = tl.load(base + cols[:, None].to(tl.int64) * stride_wn + ks[None, :], mask=inside[:, None] & in_k[None, :],
                    other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(y_ptr + p.to(tl.int64) * stride_y + cols, acc.to(y_ptr.dtype.element_ty), mask=inside)


def _expert_gemv(x: torch.Tensor, weight: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    pairs, k = x.shape
    n = weight.shape[1]
    if weight.stride(2) != 1:
        raise ValueError("expert_gemv needs each expert's rows contiguous along K")
    y = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return y
    x = x if x.stride(1) == 1 else x.contiguous()
    expert = expert.to(torch.int32).contiguous()
    block_n = 32
    _gemv_kernel[(pairs, triton.cdiv(n, block_n))](x, weight, expert, y, n, k, x.stride(0), weight.stride(0),
                                                   weight.stride(1), y.stride(0), BLOCK_N=block_n, BLOCK_K=128,
                                                   num_warps=4)
    return y


# An opaque op for torch.compile (the kernel launches from Python).
expert_gemv = torch.library.custom_op("lorazor::expert_gemv", mutates_args=())(_expert_gemv)


@expert_gemv.register_fake
def _(x, weight, expert):
    return x.new_empty(x.shape[0], weight.shape[1])
