"""A decode step of a few rows: the base GEMM and its LoRA delta in one launch (`KernelConfig.gemv_lora_max_rows`).

Semantics (the same as `linear_lora_op`'s):
    y[m] = x[m] @ W.T + bias + scaling[s] * (x[m] @ A[s, :r].T) @ B[s, :, :r].T    # s = row_slot[m] >= 0
    y[m] = x[m] @ W.T + bias                                                        # s = -1

At a few rows the step is bound by reading W, and the LoRA delta as its own shrink and expand
launches costs two launches' fixed time per projection for well under 1% of the bytes. Here each
program streams a block of W's output channels over its share of K (W in the model's dtype, or fp8
with a scale per output channel, widened in registers as `fp8.fp8_weight_only` does) and, in the
same loop over K, its rows' own adapter A (a few KB from L2); the program that finishes a column
block multiplies the rows' u by their adapter's B for those columns.
So a projection with LoRA is one launch, like one without.

Rows have different adapters, so A and B are read per row (a runtime loop over the rows, at most
`GEMV_MAX_ROWS`): fine for a few rows, which is what this path is for. Merged projections (q/k/v,
gate/up) pass `segments` as `lora_expand` does: segment g uses A's rows `[g * r_max, (g + 1) * r_max)`,
B's columns of the segment and `scaling[g]`.

Split K, as `fp8.fp8_weight_only` does (and with its plan and arrival counters): a launch with fewer
column blocks than the GPU has multiprocessors splits K; each program writes its partial sums (of
x @ W.T and of u) and the last of a column block's programs to finish adds them up, applies the LoRA
and writes y.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fp8 import arrival_counters, plan_split_k
from .kernel_config import GEMV_MAX_ROWS, get_kernel_config  # GEMV_MAX_ROWS: rows past M are masked
from .lora_kernels import padded_rank
from .lora_launch import _dot_precision, pdl_launch_options

# (BLOCK_N, BLOCK_K, num_warps, num_stages): the launch, unless a probe passes its own.
GEMV_LAUNCH = (32, 256, 4, 3)
# Programs per multiprocessor a launch aims for when it splits K.
GEMV_PROGRAMS_PER_SM = 3


@triton.jit
def _row_of(tensor, rows, m):
    """Row m of a `[BLOCK_M, X]` register tensor, as `[X]`."""
    return tl.sum(tl.where(rows[:, None] == m, tensor, 0.0), axis=0)


@triton.jit
def _row_adapter(slot_ptr, rank_ptr, m, r_max, MASK_RANK: tl.constexpr):
    """(slot, rank) of row m: slot -1 for none; rank r_max unless MASK_RANK reads the slot's own."""
    slot = tl.load(slot_ptr + m).to(tl.int32)
    rank = r_max
    if MASK_RANK:
        rank = tl.load(rank_ptr + tl.maximum(slot, 0))
    return slot, rank


@triton.jit
def _lora_epilogue(acc, u, rows, cols, M, N, slot_ptr, rank_ptr, b_ptr, scaling_ptr, scale_ptr, bias_ptr, y_ptr, seg,
                   r_max, stride_sg, stride_bl, stride_bn, stride_br, stride_y, HAS_SCALE: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, MASK_RANK: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[rows, cols] = acc (times fp8 weights' channel scales) + bias + per row m with a slot:
    scaling[seg, s] * u[m] @ B[s, cols, :].T."""
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + cols, mask=cols < N, other=0.0)[None, :]
    offs_r = tl.arange(0, BLOCK_R)
    if HAS_LORA:
        for m in range(0, M):
            slot, rank = _row_adapter(slot_ptr, rank_ptr, m, r_max, MASK_RANK)
            if slot >= 0:
                mask_r = offs_r < rank
                b = tl.load(b_ptr + slot.to(tl.int64) * stride_bl + offs_r[:, None] * stride_br
                            + cols[None, :] * stride_bn, mask=mask_r[:, None] & (cols < N)[None, :], other=0.0)
                u_m = _row_of(u, rows, m).to(b.dtype).to(tl.float32)  # rounded to the weights' dtype, as the kernels do
                delta = tl.sum(u_m[:, None] * b.to(tl.float32), axis=0)  # [BN]
                scale = tl.load(scaling_ptr + seg * stride_sg + slot).to(tl.float32)
                acc = tl.where(rows[:, None] == m, acc + scale * delta[None, :], acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _load_w(w_ptr, cols, k, mask_k, N, stride_w):
    """W's `[BN, BK]` block at (cols, k), in its stored dtype."""
    return tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_w + k[None, :],
                   mask=(cols[:, None] < N) & mask_k[None, :], other=0.0)


@triton.jit
def _chunk(acc, u, w, k, mask_k, x_ptr, rows, M, seg, r_max, slot_ptr, rank_ptr, a_ptr, stride_x, stride_al,
           stride_ar, stride_ak, HAS_LORA: tl.constexpr, MASK_RANK: tl.constexpr, DOT_PRECISION: tl.constexpr,
           BLOCK_R: tl.constexpr):
    """One K chunk: acc += x[:, k] @ w.T and, per row with an adapter, u[m] += A[s, seg rows, k] @ x[m, k]."""
    x = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :], mask=(rows[:, None] < M) & mask_k[None, :], other=0.0)
    acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=DOT_PRECISION)  # fp8 weights widened here
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        for m in range(0, M):  # the shrink of each row with an adapter (its A from L2)
            slot, rank = _row_adapter(slot_ptr, rank_ptr, m, r_max, MASK_RANK)
            if slot >= 0:
                a = tl.load(a_ptr + slot.to(tl.int64) * stride_al + (seg * r_max + offs_r)[:, None] * stride_ar
                            + k[None, :] * stride_ak, mask=(offs_r < rank)[:, None] & mask_k[None, :], other=0.0)
                x_m = tl.load(x_ptr + m * stride_x + k, mask=mask_k, other=0.0)
                u_m = tl.sum(a.to(tl.float32) * x_m.to(a.dtype).to(tl.float32)[None, :], axis=1)  # [BR]
                u = tl.where(rows[:, None] == m, u + u_m[None, :], u)
    return acc, u


@triton.jit
def _gemv_lora_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, a_ptr, b_ptr, slot_ptr, rank_ptr, scaling_ptr, y_ptr, part_ptr,
                      count_ptr, M, N, K, K_SPLIT, SPLIT_K, r_max, seg_n1, seg_n2, stride_sg,
                      stride_x, stride_w, stride_al, stride_ar, stride_ak, stride_bl, stride_bn, stride_br, stride_y,
                      HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr,
                      MASK_RANK: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
                      USE_GDC: tl.constexpr):
    # Program (n, s): BLOCK_N output channels (inside one segment), the s-th K_SPLIT columns of K.
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    n0 = pid_n * BLOCK_N
    cols = n0 + tl.arange(0, BLOCK_N)
    seg = (n0 >= seg_n1).to(tl.int32) + (n0 >= seg_n2).to(tl.int32)
    offs_r = tl.arange(0, BLOCK_R)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_begin = pid_k * K_SPLIT  # < K: every split has columns (`plan_split_k`)
    # The first W block before the wait for the kernel ahead (USE_GDC): weights never depend on it,
    # so with programmatic dependent launch this read overlaps that kernel's tail.
    k = k_begin + ks
    w = _load_w(w_ptr, cols, k, k < K, N, stride_w)
    if USE_GDC:
        tl.extra.cuda.gdc_wait()  # x, the partials and y only after the kernel ahead is done
        tl.extra.cuda.gdc_launch_dependents()
    acc, u = _chunk(acc, u, w, k, k < K, x_ptr, rows, M, seg, r_max, slot_ptr, rank_ptr, a_ptr, stride_x,
                    stride_al, stride_ar, stride_ak, HAS_LORA, MASK_RANK, DOT_PRECISION, BLOCK_R)
    for k0 in range(BLOCK_K, K_SPLIT, BLOCK_K):  # the last split's columns past K are masked
        k = k_begin + k0 + ks
        w = _load_w(w_ptr, cols, k, k < K, N, stride_w)
        acc, u = _chunk(acc, u, w, k, k < K, x_ptr, rows, M, seg, r_max, slot_ptr, rank_ptr, a_ptr, stride_x,
                        stride_al, stride_ar, stride_ak, HAS_LORA, MASK_RANK, DOT_PRECISION, BLOCK_R)
    if not SPLIT:
        _lora_epilogue(acc, u, rows, cols, M, N, slot_ptr, rank_ptr, b_ptr, scaling_ptr, scale_ptr, bias_ptr, y_ptr,
                       seg, r_max, stride_sg, stride_bl, stride_bn, stride_br, stride_y, HAS_SCALE, HAS_BIAS,
                       HAS_LORA, MASK_RANK, BLOCK_R)
    else:
        # As in `fp8._weight_only_kernel`: partials out, the last arrival of the column block sums them.
        width = BLOCK_N + BLOCK_R
        base = part_ptr + (pid_k * tl.num_programs(0) + pid_n) * BLOCK_M * width
        tl.store(base + rows[:, None] * width + tl.arange(0, BLOCK_N)[None, :], acc)
        if HAS_LORA:
            tl.store(base + rows[:, None] * width + BLOCK_N + offs_r[None, :], u)
        tl.debug_barrier()  # every thread's partial is written before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
            for s in range(SPLIT_K):  # .cg: read the partials from L2, where the other programs wrote them
                other = part_ptr + (s * tl.num_programs(0) + pid_n) * BLOCK_M * width
                acc += tl.load(other + rows[:, None] * width + tl.arange(0, BLOCK_N)[None, :], cache_modifier=".cg")
                if HAS_LORA:
                    u += tl.load(other + rows[:, None] * width + BLOCK_N + offs_r[None, :], cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            _lora_epilogue(acc, u, rows, cols, M, N, slot_ptr, rank_ptr, b_ptr, scaling_ptr, scale_ptr, bias_ptr,
                           y_ptr, seg, r_max, stride_sg, stride_bl, stride_bn, stride_br, stride_y, HAS_SCALE,
                           HAS_BIAS, HAS_LORA, MASK_RANK, BLOCK_R)


def gemv_lora(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor,
              lora_b: torch.Tensor, scaling: torch.Tensor, lora_rank: torch.Tensor, row_slot: torch.Tensor,
              mask_rank: bool = True, segments: tuple[int, ...] = (), launch: tuple[int, ...] | None = None,
              weight_scale: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """`x @ weight.T + bias` plus the batched LoRA delta, in one launch, for at most `GEMV_MAX_ROWS` rows.

    Args:
        x: `[M, K]`, M <= `GEMV_MAX_ROWS`.
        weight: `[N, K]` in x's dtype, or float8_e4m3fn with `weight_scale`.
        bias: `[N]` or None.
        lora_a: `[L, r_max, K]` (with `segments`, `[L, G * r_max, K]`).
        lora_b: `[L, N, r_max]`, best the bank's `[L, r, N]` storage seen through a transpose.
        scaling: `[L]` (with `segments`, `[G, L]`).
        lora_rank: `[L]` int32 real rank per slot.
        row_slot: `[M]` slot per row, -1 for none.
        mask_rank: read each slot's rank and mask past it (False: zeros past each rank, as the bank stores them).
        segments: merged projections' inner column edges (see `lora_expand`), multiples of 16.
        launch: (BLOCK_N, BLOCK_K, num_warps, num_stages[, split_k]) for probes; None: `GEMV_LAUNCH`.
        weight_scale: fp8 weights' float32 scales, one per output channel `[N]` (`fp8.py`); None for
            weights in x's dtype.
        pdl: launch with programmatic dependent launch (Hopper or newer; ignored elsewhere): each
            program reads its first W block before waiting for the kernel ahead.

    Returns:
        `[M, N]` in x's dtype.
    """
    segments = tuple(segments or ())
    if segments and mask_rank:
        raise ValueError("segments need mask_rank=False (merged members share one rank, zero-padded weights)")
    if any(e % 16 for e in segments):
        raise ValueError(f"segment edges {segments} must be multiples of 16")
    r_max = lora_b.shape[2]
    if lora_a.shape[1] < (len(segments) + 1) * r_max:
        raise ValueError(f"lora_a must stack {len(segments) + 1} segments of rank {r_max}, got {tuple(lora_a.shape)}")
    return _launch(x, weight, bias, weight_scale, (lora_a, lora_b, scaling, lora_rank, row_slot), mask_rank, segments,
                   launch, pdl)


def gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                weight_scale: torch.Tensor | None = None, launch: tuple[int, ...] | None = None,
                pdl: bool = False) -> torch.Tensor:
    """`x @ weight.T + bias` for at most `GEMV_MAX_ROWS` rows, no LoRA (`KernelConfig.gemv_max_rows`):
    `gemv_lora`'s kernel without its adapter work; the arguments as there."""
    return _launch(x, weight, bias, weight_scale, None, False, (), launch, pdl)


def _launch(x, weight, bias, weight_scale, lora, mask_rank, segments, launch, pdl) -> torch.Tensor:
    """Check the base arguments, plan the launch (column blocks inside segments, split K) and run the kernel;
    `lora`: (lora_a, lora_b, scaling, lora_rank, row_slot) or None."""
    M, K = x.shape
    N = weight.shape[0]
    if M > GEMV_MAX_ROWS:
        raise ValueError(f"gemv_lora takes at most {GEMV_MAX_ROWS} rows, got {M}")
    fp8 = weight_scale is not None
    if weight.shape[1] != K or weight.dtype != (torch.float8_e4m3fn if fp8 else x.dtype):
        raise ValueError(f"weight must be [N, K={K}] in x's dtype {x.dtype} (float8_e4m3fn with weight_scale), got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if fp8 and tuple(weight_scale.shape) != (N,):
        raise ValueError(f"weight_scale must be one scale per output channel [{N}], got {tuple(weight_scale.shape)}")
    block_n, block_k, warps, stages, *split = launch or GEMV_LAUNCH
    while any(e % block_n for e in segments) and block_n > 16:
        block_n //= 2  # every column block must lie in one segment (edges are multiples of 16)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    lora_a, lora_b, scaling, lora_rank, row_slot = lora or (y.new_empty(1, 1, 1), y.new_empty(1, 1, 1), y, y, y)
    r_max = lora_b.shape[2] if lora else 1
    column_blocks = triton.cdiv(N, block_n)
    split_k, k_split = plan_split_k(column_blocks, K, block_k, x.device, GEMV_PROGRAMS_PER_SM,
                                    split[0] if split else 0)
    block_r = padded_rank(r_max)
    if split_k > 1:
        counters = arrival_counters(x.device, column_blocks, "gemv_lora")
        partials = torch.empty(split_k * column_blocks * GEMV_MAX_ROWS * (block_n + block_r), dtype=torch.float32,
                               device=x.device)
    else:
        counters = partials = y  # unused
    seg_args = (*(segments + (N, N))[:2], scaling.stride(0) if segments else 0)
    _gemv_lora_kernel[(column_blocks, split_k)](
        x, weight, weight_scale if fp8 else y, bias if bias is not None else y, lora_a, lora_b, row_slot, lora_rank,
        scaling, y, partials, counters, M, N, K, k_split, split_k, r_max, *seg_args,
        x.stride(0), weight.stride(0), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
        lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0),
        HAS_SCALE=fp8, HAS_BIAS=bias is not None, HAS_LORA=lora is not None, MASK_RANK=mask_rank,
        SPLIT=split_k > 1, DOT_PRECISION=_dot_precision(x.dtype), BLOCK_M=GEMV_MAX_ROWS, BLOCK_N=block_n,
        BLOCK_K=block_k, BLOCK_R=block_r, num_warps=warps, num_stages=stages, **pdl_launch_options(pdl, x.device))
    return y


def _gemv_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_scale: torch.Tensor | None) -> torch.Tensor:
    """`gemv_linear` as the model's base layers run it: programmatic dependent launch as the device's
    kernel config says (`KernelConfig.pdl`)."""
    return gemv_linear(x, weight, bias, weight_scale, pdl=get_kernel_config(x.device).pdl)


# The registered op for compiled model code (an opaque node in the graph, as `lorazor::fp8_linear`).
gemv_linear_op = torch.library.custom_op("lorazor::gemv_linear", mutates_args=())(_gemv_linear)


@gemv_linear_op.register_fake
def _(x, weight, bias, weight_scale):
    return x.new_empty(x.shape[0], weight.shape[0])
