"""A gated MLP's activation with gate/up's LoRA expand in the same kernel: `h = silu(gate) * up`.

A merged gate/up group computes `y = x @ [W_gate; W_up].T` (one base GEMM) and the LoRA shrink u.
Unfused, the step then runs the expand (`y += delta`, a read-modify-write of the `[M, 2I]` output)
and the activation (read y again, write `h [M, I]`): two kernels and y's bytes three times. Here one
kernel reads y once, adds each row's delta in registers and writes h:

    g[m]  = y[m, :I] + scaling[0, s] * u[m, :r]   @ B[s, :I].T    rounded to y's dtype
    up[m] = y[m, I:] + scaling[1, s] * u[m, r:2r] @ B[s, I:].T    rounded to y's dtype
    h[m]  = silu(g[m]) * up[m]                                      in fp32, rounded once

which is what the unfused expand stores and what inductor's fused activation computes from it.
Rows with a slot are reached through the step's tiles (any grid mode, as in `lora_expand`); rows
without one (never given an adapter, or released by StepTrim) through cdiv(M, BM) more programs over
consecutive rows, which read `row_slot` and keep the rows < 0. Every row of h is written once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_config import KernelConfig, get_kernel_config
from .lora_kernels import (
    _columns_per_program, _dependent_launch_prologue, _dot_precision, _launches, _load_b, _load_u, _meta_tensors,
    _pdl_options, _tile, padded_rank,
)
from .meta import LoRABatchMeta


@triton.jit
def _gate_up_block(
    y_rows, h_rows, mask_m, n0, I, stride_yn, stride_hn, u_g, u_u, b_g, b_u, scale_g, scale_u,
    HAS_DELTA: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """h[rows, n0:n0 + BN] = silu(g) * up from y's gate and up columns, plus the delta if HAS_DELTA."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask = mask_m[:, None] & (offs_n < I)[None, :]
    g = tl.load(y_rows + offs_n[None, :] * stride_yn, mask=mask, other=0.0)
    up = tl.load(y_rows + (I + offs_n)[None, :] * stride_yn, mask=mask, other=0.0)
    if HAS_DELTA:
        # Rounded to y's dtype as the unfused expand stores them.
        g = (g.to(tl.float32) + scale_g * tl.dot(u_g, b_g, input_precision=DOT_PRECISION)).to(g.dtype)
        up = (up.to(tl.float32) + scale_u * tl.dot(u_u, b_u, input_precision=DOT_PRECISION)).to(up.dtype)
    g32 = g.to(tl.float32)
    h = g32 / (1.0 + tl.exp(-g32)) * up.to(tl.float32)
    tl.store(h_rows + offs_n[None, :] * stride_hn, h.to(h_rows.dtype.element_ty), mask=mask)


@triton.jit
def _slot_tile(
    pid, u_ptr, b_ptr, y_ptr, h_ptr, scaling_ptr, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr,
    slot_list_ptr, I, r_max, tiles_per_slot, n_lo, n_hi, stride_sg, stride_us, stride_um, stride_ur, stride_bl,
    stride_bn, stride_br, stride_ym, stride_yn, stride_hm, stride_hn,
    TILE_TABLE: tl.constexpr, USE_SLOT_LIST: tl.constexpr, CLASS_MAX_ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """h for the rows of tile `pid` (one slot), columns [n_lo, n_hi), with the slot's delta."""
    slot, rows, mask_m, rank = _tile(
        pid, slot_start_ptr, r_max, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
        tiles_per_slot, TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS, False, BLOCK_M,
    )  # without MASK_RANK the rank pointer is not read (slot_start stands in)
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    b_gate = b_ptr + slot.to(tl.int64) * stride_bl
    b_up = b_gate + I * stride_bn
    # The first B tiles before the wait for the kernel ahead (adapter weights never depend on it).
    b_g = _load_b(b_gate, offs_r, mask_r, n_lo, I, stride_br, stride_bn, BLOCK_N)
    b_u = _load_b(b_up, offs_r, mask_r, n_lo, I, stride_br, stride_bn, BLOCK_N)
    _dependent_launch_prologue(USE_GDC)
    u_g = _load_u(u_ptr, rows, mask_m, offs_r, mask_r, stride_us, stride_um, stride_ur, SPLIT_K, BLOCK_M, BLOCK_R)
    u_u = _load_u(u_ptr + r_max * stride_ur, rows, mask_m, offs_r, mask_r, stride_us, stride_um, stride_ur,
                  SPLIT_K, BLOCK_M, BLOCK_R)
    u_g = u_g.to(b_ptr.dtype.element_ty)  # the weights' dtype, as the expand kernel multiplies
    u_u = u_u.to(b_ptr.dtype.element_ty)
    scale_g = tl.load(scaling_ptr + slot).to(tl.float32)
    scale_u = tl.load(scaling_ptr + stride_sg + slot).to(tl.float32)
    y_rows = y_ptr + rows[:, None] * stride_ym
    h_rows = h_ptr + rows[:, None] * stride_hm
    _gate_up_block(y_rows, h_rows, mask_m, n_lo, I, stride_yn, stride_hn, u_g, u_u, b_g, b_u, scale_g, scale_u,
                   True, BLOCK_N, DOT_PRECISION)
    for n0 in range(n_lo + BLOCK_N, n_hi, BLOCK_N):
        b_g = _load_b(b_gate, offs_r, mask_r, n0, I, stride_br, stride_bn, BLOCK_N)
        b_u = _load_b(b_up, offs_r, mask_r, n0, I, stride_br, stride_bn, BLOCK_N)
        _gate_up_block(y_rows, h_rows, mask_m, n0, I, stride_yn, stride_hn, u_g, u_u, b_g, b_u, scale_g, scale_u,
                       True, BLOCK_N, DOT_PRECISION)


@triton.jit
def _rows_without_slot(
    block, y_ptr, h_ptr, row_slot_ptr, M, I, n_lo, n_hi, stride_ym, stride_yn, stride_hm, stride_hn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_GDC: tl.constexpr,
):
    """h for the rows without a slot among rows [block * BM, (block + 1) * BM), columns [n_lo, n_hi)."""
    rows = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    in_m = rows < M
    mask_m = in_m & (tl.load(row_slot_ptr + rows, mask=in_m, other=0) < 0)
    if tl.max(mask_m.to(tl.int32), axis=0) == 0:
        return  # every row here has a slot (every block when all rows have adapters)
    _dependent_launch_prologue(USE_GDC)
    y_rows = y_ptr + rows[:, None] * stride_ym
    h_rows = h_ptr + rows[:, None] * stride_hm
    for n0 in range(n_lo, n_hi, BLOCK_N):
        _gate_up_block(y_rows, h_rows, mask_m, n0, I, stride_yn, stride_hn, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
                       False, BLOCK_N, DOT_PRECISION)


@triton.jit
def _expand_silu_mul_kernel(
    u_ptr, b_ptr, y_ptr, h_ptr, scaling_ptr, row_slot_ptr,
    sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
    M, I, r_max, tiles_per_slot, tile_programs, n_per_program, stride_sg,
    stride_us, stride_um, stride_ur, stride_bl, stride_bn, stride_br, stride_ym, stride_yn, stride_hm, stride_hn,
    TILE_TABLE: tl.constexpr, USE_SLOT_LIST: tl.constexpr, CLASS_MAX_ROWS: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Programs [0, tile_programs): a tile of one slot's rows, with the delta. The rest: BLOCK_M
    consecutive rows each, only those without a slot, no delta. Axis 1 splits h's I columns."""
    pid = tl.program_id(0)
    n_lo = tl.program_id(1) * n_per_program
    n_hi = tl.minimum(n_lo + n_per_program, I)
    if pid < tile_programs:
        _slot_tile(pid, u_ptr, b_ptr, y_ptr, h_ptr, scaling_ptr, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr,
                   tile_rows_ptr, slot_list_ptr, I, r_max, tiles_per_slot, n_lo, n_hi, stride_sg, stride_us,
                   stride_um, stride_ur, stride_bl, stride_bn, stride_br, stride_ym, stride_yn, stride_hm, stride_hn,
                   TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS, SPLIT_K, BLOCK_M, BLOCK_N, BLOCK_R, DOT_PRECISION,
                   USE_GDC)
    else:
        _rows_without_slot(pid - tile_programs, y_ptr, h_ptr, row_slot_ptr, M, I, n_lo, n_hi, stride_ym, stride_yn,
                           stride_hm, stride_hn, BLOCK_M, BLOCK_N, DOT_PRECISION, USE_GDC)


def lora_expand_silu_mul(
    u: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, y: torch.Tensor, meta: LoRABatchMeta,
    cfg: KernelConfig | None = None,
) -> torch.Tensor:
    """`h = silu(gate) * up` of a merged gate/up output with its LoRA delta added (see the module doc).

    Args:
        u: `[S, M, >= 2 * r]` fp32 partials of `lora_shrink` over gate's and up's A stacked `[L, 2 * r, K]`
            (as a merged group computes it, `mask_rank=False`).
        lora_b: `[L, 2 * I, r]`: gate's B then up's.
        scaling: `[2, L]`: gate's row, then up's.
        y: `[M, 2 * I]` base output (gate columns, then up columns); read, not written.
        meta: the step's `LoRABatchMeta`; rows with `row_slot < 0` get `silu(gate) * up` of y alone.

    Returns:
        `h [M, I]` in y's dtype.
    """
    M, N = y.shape
    L, r = lora_b.shape[0], lora_b.shape[2]
    if N % 2 or lora_b.shape[1] != N:
        raise ValueError(f"y must be [M, 2 * I] and lora_b [L, 2 * I, r]; got {tuple(y.shape)} and "
                         f"{tuple(lora_b.shape)}")
    if scaling.shape != (2, L):
        raise ValueError(f"scaling must be [2, L={L}] (gate's, then up's), got {tuple(scaling.shape)}")
    if u.dim() != 3 or u.shape[1] != M or u.shape[2] < 2 * r:
        raise ValueError(f"u must be shrink's partials [S, M={M}, >= {2 * r}], got {tuple(u.shape)}")
    cfg = cfg or get_kernel_config(y.device)
    width = N // 2
    h = torch.empty(M, width, dtype=y.dtype, device=y.device)
    block_n = min(cfg.silu_block_n or cfg.expand_block_n, max(16, triton.next_power_of_2(width)))
    launches = _launches(meta, expand=True)
    row_programs = triton.cdiv(M, meta.block_m)
    n_per_program = _columns_per_program(sum(n for n, *_ in launches) + row_programs, width, block_n,
                                         cfg.expand_programs_per_sm, y.device, cfg.expand_max_steps)
    for i, (programs, tiles_per_slot, table, slot_list, class_rows) in enumerate(launches):
        # The rows without a slot go with the first launch only (two_class runs two).
        extra = row_programs if i == 0 else 0
        _expand_silu_mul_kernel[(programs + extra, triton.cdiv(width, n_per_program))](
            u, lora_b, y, h, scaling, meta.row_slot, *_meta_tensors(meta, table, slot_list),
            M, width, r, tiles_per_slot, programs, n_per_program, scaling.stride(0),
            u.stride(0), u.stride(1), u.stride(2), lora_b.stride(0), lora_b.stride(1), lora_b.stride(2),
            y.stride(0), y.stride(1), h.stride(0), h.stride(1),
            TILE_TABLE=table, USE_SLOT_LIST=slot_list is not None, CLASS_MAX_ROWS=class_rows, SPLIT_K=u.shape[0],
            BLOCK_M=meta.block_m, BLOCK_N=block_n, BLOCK_R=padded_rank(r), DOT_PRECISION=_dot_precision(lora_b.dtype),
            num_warps=cfg.silu_num_warps or cfg.expand_num_warps, num_stages=cfg.expand_num_stages,
            **_pdl_options(cfg, y.device),
        )
    return h


def silu_mul_reference(y: torch.Tensor) -> torch.Tensor:
    """`silu(y[:, :I]) * y[:, I:]` computed in fp32 and rounded once to y's dtype (as the kernel)."""
    gate, up = y.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(y.dtype)
