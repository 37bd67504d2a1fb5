"""Benchmark only: a Triton base GEMM `y = x @ W.T` that can add the exact LoRA expand in its epilogue.

The question it answers for `bench_lora_forms.py`: can LoRazor's own base GEMM stand in for
cuBLAS's at decode shapes (M = 256), and does taking the expand into its epilogue (no expand
launch, no read-modify-write of y) pay? With EXPAND, each output tile adds, row by row,
    y[m, n] += sum_r u[m, seg * R + r] * B[slot[m], r, n]
where u is the exact shrink's output (its SPLIT fp32 partials are summed here), B the bank's
`[S, R, N]` storage with the scalings folded in, and seg the merged segment of the tile's columns
(segment edges are multiples of BLOCK_N). Rows with slot < 0 get no delta. With USE_GDC (Hopper,
programmatic dependent launch) the first W tile is loaded before waiting for the kernel ahead:
weights never depend on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemm_expand_kernel(
    x_ptr, w_ptr, y_ptr, u_ptr, b_ptr, slot_ptr,
    M, N, K, seg_n1, seg_n2,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_ym, stride_yn,
    stride_us, stride_um, stride_ur, stride_bl, stride_br, stride_bn,
    EXPAND: tl.constexpr, R: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_GDC: tl.constexpr,
):
    pid_n = tl.program_id(0)  # N-major launch order: the programs of one W column block run together
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = rows < M
    mask_n = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    w_tile = tl.load(w_cols + offs_k[None, :] * stride_wk, mask=mask_n[:, None] & (offs_k < K)[None, :], other=0.0)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x_tile = tl.load(x_rows + offs_k[None, :] * stride_xk, mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
    acc = tl.dot(x_tile, tl.trans(w_tile))
    for k0 in range(BLOCK_K, K, BLOCK_K):
        k = k0 + offs_k
        x_tile = tl.load(x_rows + k[None, :] * stride_xk, mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
        w_tile = tl.load(w_cols + k[None, :] * stride_wk, mask=mask_n[:, None] & (k < K)[None, :], other=0.0)
        acc += tl.dot(x_tile, tl.trans(w_tile))
    if EXPAND:
        slot = tl.load(slot_ptr + rows, mask=mask_m, other=-1)
        has = slot >= 0
        b_rows = b_ptr + tl.maximum(slot, 0).to(tl.int64)[:, None] * stride_bl + cols[None, :] * stride_bn
        n0 = pid_n * BLOCK_N
        seg = (n0 >= seg_n1).to(tl.int32) + (n0 >= seg_n2).to(tl.int32)
        u_rows = u_ptr + rows.to(tl.int64) * stride_um + seg * R * stride_ur
        for r in tl.static_range(R):
            u_r = tl.zeros((BLOCK_M,), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                u_r += tl.load(u_rows + s * stride_us + r * stride_ur, mask=has, other=0.0)
            b_r = tl.load(b_rows + r * stride_br, mask=has[:, None] & mask_n[None, :], other=0.0)
            # Rounded to B's dtype first, as the expand kernel multiplies u in the weights' dtype.
            acc += u_r.to(b_ptr.dtype.element_ty).to(tl.float32)[:, None] * b_r.to(tl.float32)
    y_tile = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :] * stride_yn
    tl.store(y_tile, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def gemm_expand(x, w, block=(64, 128, 64, 4, 4), u=None, b=None, slots=None, edges=(), rank=8, pdl=False):
    """`x @ w.T` (x `[M, K]`, w `[N, K]`), plus the expand when u (`[SPLIT, M, >= G * rank]` fp32),
    b (`[S, rank, N]`, scalings folded in) and slots (`[M]`, -1 = none) are given.

    `block` = (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages); `edges` the merged segments' inner
    column edges (multiples of BLOCK_N).
    """
    M, K = x.shape
    N = w.shape[0]
    bm, bn, bk, warps, stages = block
    if any(e % bn for e in edges):
        raise ValueError(f"segment edges {edges} must be multiples of BLOCK_N={bn}")
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    expand = u is not None
    us = (u.stride(0), u.stride(1), u.stride(2)) if expand else (0, 0, 0)
    bs = (b.stride(0), b.stride(1), b.stride(2)) if expand else (0, 0, 0)
    seg = (*edges, N, N)[:2]
    extra = dict(launch_pdl=True) if pdl else {}
    _gemm_expand_kernel[(triton.cdiv(N, bn), triton.cdiv(M, bm))](
        x, w, y, u if expand else y, b if expand else y, slots if expand else y,
        M, N, K, *seg, x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1), *us, *bs,
        EXPAND=expand, R=rank, SPLIT=u.shape[0] if expand else 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        USE_GDC=pdl, num_warps=warps, num_stages=stages, **extra,
    )
    return y
