"""GridTrim: one Triton shrink/expand family for the grouped LoRA delta, four grid modes.

Semantics (see `reference.lora_delta_reference`):
    u[m]  = x[m] @ lora_a[s, :r].T                  # shrink, r = rank[s], s = row_slot[m]
    y[m] += scaling[s] * u[m] @ lora_b[s, :, :r].T  # expand, in place

Every program first maps its id to a tile: a slot and a run of at most BLOCK_M rows of that slot in
`meta.sorted_rows`. How it does so is the grid mode, chosen by constexpr flags, not by copies:
    TILE_TABLE=True   `exact`: program t reads (tile_slot[t], tile_row[t]) from a device-built table;
                      the grid is cdiv(M, BM) + min(L, M) tiles and only tiles that hold rows compute.
    TILE_TABLE=False  slot-major: program = slot * tiles_per_slot + j; `full` uses tiles_per_slot =
                      cdiv(M, BM), `active_rows` cdiv(R, BM); empty tiles exit. USE_SLOT_LIST reads
                      the slot from a compact list (two_class large class); CLASS_MAX_ROWS > 0 skips
                      slots with more rows (two_class small class).
Two ways to run the delta, same tiles and same arithmetic (fp32 u, cast to the weights' dtype):
    shrink + expand   the default (faster on the H200): shrink splits K over grid axis 1 (the rank
                      is tiny, K is large) and writes one fp32 partial per split; expand sums the
                      partials, so no atomics and no zero-fill are needed.
    FUSED=True        the expand kernel shrinks its own tile over the whole K into registers first:
                      one launch per projection and no u round trip through memory; when a launch
                      has too few tiles to fill the GPU, N is split over more programs, each
                      recomputing its tile's small shrink.
Ranks are padded only inside the kernels to a dot-legal power of two >= 16. With MASK_RANK, loads
past a slot's real rank are masked, so a rank-8 adapter reads rank-8 bytes even in a bank whose
largest rank is 64; without it (uniform-rank banks, zeros past each rank) the rank load is skipped.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .kernel_config import KernelConfig, get_kernel_config
from .meta import LARGE_CLASS_CAPACITY, SMALL_CLASS_ROWS, LoRABatchMeta

# The smallest dot dimension the GPU compiler accepts: shrink's rank block, and the least rank padding.
BLOCK_R = 16


def padded_rank(r_max: int) -> int:
    """Rank width the kernels compute in: a power of two >= BLOCK_R (a legal dot dimension)."""
    return max(BLOCK_R, triton.next_power_of_2(r_max))


@triton.jit
def _tile_rows(
    pid, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr, tiles_per_slot,
    TILE_TABLE: tl.constexpr, USE_SLOT_LIST: tl.constexpr, CLASS_MAX_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Map a program id to (slot, rows [BM] int64, row mask [BM]); slot < 0 means exit."""
    lanes = tl.arange(0, BLOCK_M)
    if TILE_TABLE:
        # Both loads depend only on pid: the exact grid reaches its rows in one memory round trip.
        slot = tl.load(tile_slot_ptr + pid)
        rows = tl.load(tile_rows_ptr + pid * BLOCK_M + lanes)
        mask_m = rows >= 0
        rows = tl.maximum(rows, 0).to(tl.int64)
    else:
        slot_idx = pid // tiles_per_slot
        j = pid % tiles_per_slot
        if USE_SLOT_LIST:
            slot = tl.load(slot_list_ptr + slot_idx)
        else:
            slot = slot_idx
        safe = tl.maximum(slot, 0)
        group_lo = tl.load(slot_start_ptr + safe)
        group_hi = tl.load(slot_start_ptr + safe + 1)
        row_lo = group_lo + j * BLOCK_M
        if CLASS_MAX_ROWS > 0:
            slot = tl.where(group_hi - group_lo > CLASS_MAX_ROWS, -1, slot)
        slot = tl.where(row_lo < group_hi, slot, -1)
        offs = row_lo + lanes
        mask_m = offs < group_hi
        rows = tl.load(sorted_rows_ptr + offs, mask=mask_m, other=0).to(tl.int64)
    return slot, rows, mask_m


@triton.jit
def _tile(
    pid, rank_ptr, r_max, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
    tiles_per_slot, TILE_TABLE: tl.constexpr, USE_SLOT_LIST: tl.constexpr, CLASS_MAX_ROWS: tl.constexpr,
    MASK_RANK: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """A program's tile: (slot, rows, row mask, rank). Rank 0 means the program has nothing to do.

    Without MASK_RANK the caller promises every used slot has rank r_max (or zero weights past its
    rank), so the kernels skip the rank load: one dependent memory round trip less.
    """
    slot, rows, mask_m = _tile_rows(
        pid, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr, tiles_per_slot,
        TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS, BLOCK_M,
    )
    if MASK_RANK:
        rank = tl.load(rank_ptr + tl.maximum(slot, 0))
    else:
        rank = r_max
    return slot, rows, mask_m, tl.where(slot < 0, 0, rank)


@triton.jit
def _shrink_rows(
    x_rows, a_rows, mask_m, mask_r, k_lo, k_hi, K, stride_xk, stride_ak,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """fp32 `[BM, BR]` = x[rows, k_lo:k_hi] @ A[slot, r, k_lo:k_hi].T; x_rows `[BM, 1]`, a_rows `[BR, 1]` pointers.

    The first A chunk is loaded before `_dependent_launch_prologue` (the wait for the kernel ahead):
    adapter weights never depend on it, so with PDL that load overlaps its tail. k_lo < k_hi.
    """
    offs_k = tl.arange(0, BLOCK_K)
    k = k_lo + offs_k
    mask_k = k < K
    a_tile = tl.load(a_rows + k[None, :] * stride_ak, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
    _dependent_launch_prologue(USE_GDC)
    x_tile = tl.load(x_rows + k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
    acc = tl.dot(x_tile.to(a_tile.dtype), tl.trans(a_tile), input_precision=DOT_PRECISION)
    for k0 in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        x_tile = tl.load(x_rows + k[None, :] * stride_xk, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        a_tile = tl.load(a_rows + k[None, :] * stride_ak, mask=mask_r[:, None] & mask_k[None, :], other=0.0)
        # [BM, BK] @ [BK, BR]
        acc += tl.dot(x_tile.to(a_tile.dtype), tl.trans(a_tile), input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _load_u(u_ptr, rows, mask_m, offs_r, mask_r, stride_us, stride_um, stride_ur, SPLIT_K: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr):
    """fp32 `[BM, BR]`: the sum of shrink's SPLIT_K partials for these rows, below the rank."""
    u_ptrs = u_ptr + rows[:, None] * stride_um + offs_r[None, :] * stride_ur
    u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):
        u += tl.load(u_ptrs + split * stride_us, mask=mask_m[:, None] & mask_r[None, :], other=0.0)
    return u


@triton.jit
def _load_b(b_slot, offs_r, mask_r, n0, N, stride_br, stride_bn, BLOCK_N: tl.constexpr):
    """B's `[BR, BN]` tile at columns n0: contiguous along N when B is stored [L, r, N] (stride_bn == 1)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    return tl.load(b_slot + offs_r[:, None] * stride_br + offs_n[None, :] * stride_bn,
                   mask=mask_r[:, None] & (offs_n < N)[None, :], other=0.0)


@triton.jit
def _expand_block(u, b_tile, y_rows, mask_m, scale, n0, N, stride_yn, BLOCK_N: tl.constexpr,
                  DOT_PRECISION: tl.constexpr):
    """y[rows, n0:n0 + BN] += scale * u @ b_tile."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.dot(u, b_tile, input_precision=DOT_PRECISION)  # [BM, BR] @ [BR, BN]
    y_tile = y_rows + offs_n[None, :] * stride_yn
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    y_old = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y_old.to(tl.float32) + acc * scale).to(y_old.dtype), mask=mask)


@triton.jit
def _expand_rows(
    u, b_slot, y_rows, mask_m, offs_r, mask_r, scale, n_lo, n_hi, N, stride_br, stride_bn, stride_yn,
    b_first, n_first, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """y[rows, n_lo:n_hi] += scale * u @ B[slot, :, r].T, with u `[BM, BR]` in the weights' dtype.

    `b_first`: B's tile at column n_first (the program's first block, loaded before the wait for
    the kernel ahead), used when this range starts there.
    """
    start = n_lo
    if n_lo == n_first:
        _expand_block(u, b_first, y_rows, mask_m, scale, n_lo, N, stride_yn, BLOCK_N, DOT_PRECISION)
        start = n_lo + BLOCK_N
    for n0 in range(start, tl.minimum(n_hi, N), BLOCK_N):
        b_tile = _load_b(b_slot, offs_r, mask_r, n0, N, stride_br, stride_bn, BLOCK_N)
        _expand_block(u, b_tile, y_rows, mask_m, scale, n0, N, stride_yn, BLOCK_N, DOT_PRECISION)


@triton.jit
def _dependent_launch_prologue(USE_GDC: tl.constexpr):
    """Programmatic dependent launch (Hopper+, `KernelConfig.pdl`): the programs of this kernel may
    be scheduled before the kernel ahead of it in the stream has finished, which hides the launch
    gap. Called after the program has read its tile (tile table, rows, rank) and its first adapter
    weight tile: the step metadata is written at the start of the step, well before the kernel ahead
    was launched, and weights never change within a step, so those reads overlap that kernel's tail.
    Then wait for it before reading activations (it may have written x, u or y) or writing anything,
    and let the next kernel be scheduled in turn: its own wait covers all of this kernel."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def _lora_shrink_kernel(
    x_ptr, a_ptr, u_ptr, rank_ptr,
    sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
    K, r_max, tiles_per_slot, k_per_split,
    stride_xm, stride_xk, stride_al, stride_ar, stride_ak, stride_us, stride_um, stride_ur,
    TILE_TABLE: tl.constexpr, USE_SLOT_LIST: tl.constexpr, CLASS_MAX_ROWS: tl.constexpr, MASK_RANK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_r = tl.program_id(2)
    slot, rows, mask_m, rank = _tile(
        pid, rank_ptr, r_max, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
        tiles_per_slot, TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS, MASK_RANK, BLOCK_M,
    )
    if pid_r * BLOCK_R >= rank:
        return
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    k_lo = pid_k * k_per_split
    acc = _shrink_rows(  # waits for the kernel ahead after its first A load (USE_GDC)
        x_ptr + rows[:, None] * stride_xm, a_ptr + slot.to(tl.int64) * stride_al + offs_r[:, None] * stride_ar,
        mask_m, mask_r, k_lo, k_lo + k_per_split, K, stride_xk, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K,
        DOT_PRECISION, USE_GDC,
    )
    u_tile = u_ptr + pid_k * stride_us + rows[:, None] * stride_um + offs_r[None, :] * stride_ur
    tl.store(u_tile, acc, mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _lora_expand_kernel(
    x_ptr, a_ptr, u_ptr, b_ptr, y_ptr, scaling_ptr, rank_ptr,
    sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
    K, N, r_max, tiles_per_slot, n_per_program, seg_n1, seg_n2, stride_sg,
    stride_xm, stride_xk, stride_al, stride_ar, stride_ak, stride_us, stride_um, stride_ur,
    stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
    TILE_TABLE: tl.constexpr, USE_SLOT_LIST: tl.constexpr, CLASS_MAX_ROWS: tl.constexpr, MASK_RANK: tl.constexpr,
    FUSED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr,
):
    """Expand a tile into y. FUSED: shrink the tile over all of K first (x, A); else sum the SPLIT_K
    fp32 partials `u [SPLIT_K, M, R]` that the shrink kernel wrote.

    y's columns are up to three segments [0, seg_n1), [seg_n1, seg_n2), [seg_n2, N); a plain
    projection is one segment (seg_n1 = seg_n2 = N). Segment g reads its own r_max columns of u
    (`u[:, g * r_max :]`) and its own scaling row (`scaling_ptr + g * stride_sg`): merged
    projections, e.g. q/k/v in one output. Segment edges are multiples of BLOCK_N.
    """
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot, rows, mask_m, rank = _tile(
        pid, rank_ptr, r_max, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
        tiles_per_slot, TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS, MASK_RANK, BLOCK_M,
    )
    if rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    slot64 = slot.to(tl.int64)
    b_slot = b_ptr + slot64 * stride_bl
    y_rows = y_ptr + rows[:, None] * stride_ym
    # A program covers n_per_program columns in BLOCK_N steps: fewer, longer programs amortize the
    # tile lookup and keep several independent B loads in flight.
    n_lo = pid_n * n_per_program
    n_hi = tl.minimum(n_lo + n_per_program, N)
    # The first B tile before the wait for the kernel ahead (adapter weights never depend on it).
    b_first = _load_b(b_slot, offs_r, mask_r, n_lo, N, stride_br, stride_bn, BLOCK_N)
    if FUSED:  # one segment: u is shrunk here, over the whole rank (waiting after its first A load)
        u = _shrink_rows(
            x_ptr + rows[:, None] * stride_xm, a_ptr + slot64 * stride_al + offs_r[:, None] * stride_ar,
            mask_m, mask_r, 0, K, K, stride_xk, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, USE_GDC,
        )
        scale = tl.load(scaling_ptr + slot).to(tl.float32)
        _expand_rows(
            u.to(b_ptr.dtype.element_ty), b_slot, y_rows, mask_m, offs_r, mask_r, scale, n_lo, n_hi, N,
            stride_br, stride_bn, stride_yn, b_first, n_lo, BLOCK_M, BLOCK_N, DOT_PRECISION,
        )
    else:
        _dependent_launch_prologue(USE_GDC)
        for seg in tl.static_range(3):
            if seg == 0:
                seg_lo = 0
                seg_hi = seg_n1
            elif seg == 1:
                seg_lo = seg_n1
                seg_hi = seg_n2
            else:
                seg_lo = seg_n2
                seg_hi = N
            lo = tl.maximum(n_lo, seg_lo)
            hi = tl.minimum(n_hi, seg_hi)
            if lo < hi:  # u and scaling are loaded once per segment this program touches
                u = _load_u(u_ptr + seg * r_max * stride_ur, rows, mask_m, offs_r, mask_r,
                            stride_us, stride_um, stride_ur, SPLIT_K, BLOCK_M, BLOCK_R)
                scale = tl.load(scaling_ptr + seg * stride_sg + slot).to(tl.float32)
                _expand_rows(
                    u.to(b_ptr.dtype.element_ty), b_slot, y_rows, mask_m, offs_r, mask_r, scale, lo, hi, N,
                    stride_br, stride_bn, stride_yn, b_first, n_lo, BLOCK_M, BLOCK_N, DOT_PRECISION,
                )


def _launches(meta: LoRABatchMeta, expand: bool):
    """Launch plan of a step: (programs on axis 0, tiles_per_slot, TILE_TABLE, slot list, CLASS_MAX_ROWS)."""
    bm = meta.block_m
    if meta.grid == "exact":
        return [(meta.num_tiles, 1, True, None, 0)]
    tiles = triton.cdiv(meta.row_bound, bm)
    if meta.grid == "two_class" and expand and meta.class_split:
        small_tiles = triton.cdiv(SMALL_CLASS_ROWS, bm)
        return [
            (meta.num_slots * small_tiles, small_tiles, False, None, SMALL_CLASS_ROWS),
            (LARGE_CLASS_CAPACITY * tiles, tiles, False, meta.large_slots, 0),
        ]
    return [(meta.num_slots * tiles, tiles, False, None, 0)]


def _meta_tensors(meta: LoRABatchMeta, table: bool, slot_list):
    """sorted_rows, slot_start, tile_slot, tile_rows, slot_list of a launch (unused ones: a stand-in)."""
    stand_in = meta.slot_start
    return (meta.sorted_rows, meta.slot_start, meta.tile_slot if table else stand_in,
            meta.tile_rows if table else stand_in, slot_list if slot_list is not None else stand_in)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots default to tf32 on the GPU; keep fp32 exact so fp32 tests and the reference agree.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _pdl_options(cfg: KernelConfig, device: torch.device) -> dict:
    """Launch options for programmatic dependent launch: `cfg.pdl` on a Hopper or newer GPU."""
    on = cfg.pdl and device.type == "cuda" and _hopper_or_newer(
        device.index if device.index is not None else torch.cuda.current_device())
    return dict(USE_GDC=True, launch_pdl=True) if on else dict(USE_GDC=False)


def _split_k(meta: LoRABatchMeta, K: int, rank_blocks: int, cfg: KernelConfig, device: torch.device) -> int:
    """Split K so that shrink launches enough programs to keep the GPU's memory system busy."""
    max_splits = triton.cdiv(K, cfg.shrink_block_k)
    if cfg.shrink_split_k > 0:
        return min(cfg.shrink_split_k, max_splits)
    programs = sum(n for n, *_ in _launches(meta, expand=False)) * rank_blocks
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    splits = triton.cdiv(cfg.target_programs_per_sm * sms, max(programs, 1))
    return max(1, min(max_splits, _at_most_steps(splits, max_splits, cfg.shrink_max_steps)))


def _at_most_steps(splits: int, blocks: int, max_steps: int) -> int:
    """`splits`, raised so that no program loops over more than `max_steps` of the `blocks` (0: no cap).
    A long K (down_proj) or N (gate/up) then gets more, shorter programs than a short one."""
    return max(splits, triton.cdiv(blocks, max_steps)) if max_steps > 0 else splits


def _columns_per_program(programs: int, N: int, block_n: int, per_sm: int, device: torch.device,
                         max_steps: int = 0) -> int:
    """Expand columns per program: split N only as far as needed for about `per_sm` programs per SM
    (and at most `max_steps` column blocks per program)."""
    n_blocks = triton.cdiv(N, block_n)
    target = 1  # on the CPU (interpreter) one program per tile, unless max_steps asks for more
    if device.type == "cuda":
        target = triton.cdiv(per_sm * torch.cuda.get_device_properties(device).multi_processor_count, max(programs, 1))
    splits = max(1, min(n_blocks, _at_most_steps(target, n_blocks, max_steps)))
    return triton.cdiv(n_blocks, splits) * block_n


def _run_expand(y, lora_b, scaling, lora_rank, meta, cfg, mask_rank, u=None, x=None, lora_a=None, segments=None):
    """Every launch of the expand kernel for a step: fused (x and lora_a given) or from shrink's u,
    optionally over merged-projection segments (column edges, scaling `[G, L]`)."""
    fused = u is None
    N = lora_b.shape[1]
    block_n = min(cfg.fused_block_n if fused else cfg.expand_block_n, max(16, triton.next_power_of_2(N)))
    segments = tuple(segments or ())
    while any(e % block_n for e in segments) and block_n > 16:
        block_n //= 2  # every column block must lie in one segment
    if any(e % block_n for e in segments):
        raise ValueError(f"segment edges {segments} must be multiples of 16")
    launches = _launches(meta, expand=True)
    per_sm = cfg.fused_programs_per_sm if fused else cfg.expand_programs_per_sm
    n_per_program = _columns_per_program(sum(n for n, *_ in launches), N, block_n, per_sm, y.device,
                                         0 if fused else cfg.expand_max_steps)
    stand_in = y  # for the pointers the variant does not read
    xs = (x.stride(0), x.stride(1)) if fused else (0, 0)
    a_s = (lora_a.stride(0), lora_a.stride(1), lora_a.stride(2)) if fused else (0, 0, 0)
    us = (0, 0, 0) if fused else (u.stride(0), u.stride(1), u.stride(2))
    # A plain projection is one segment [0, N); merged ones read scaling row g for segment g.
    seg_args = (*(segments + (N, N))[:2], scaling.stride(0) if segments else 0)
    for programs, tiles_per_slot, table, slot_list, class_rows in launches:
        _lora_expand_kernel[(programs, triton.cdiv(N, n_per_program))](
            x if fused else stand_in, lora_a if fused else stand_in, stand_in if fused else u, lora_b, y, scaling,
            lora_rank, *_meta_tensors(meta, table, slot_list),
            x.shape[1] if fused else 0, N, lora_b.shape[2], tiles_per_slot, n_per_program, *seg_args,
            *xs, *a_s, *us, lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
            TILE_TABLE=table, USE_SLOT_LIST=slot_list is not None, CLASS_MAX_ROWS=class_rows, MASK_RANK=mask_rank,
            FUSED=fused, SPLIT_K=1 if fused else u.shape[0], BLOCK_M=meta.block_m,
            BLOCK_N=block_n, BLOCK_R=padded_rank(lora_b.shape[2]), BLOCK_K=cfg.fused_block_k if fused else 16,
            DOT_PRECISION=_dot_precision(lora_b.dtype),
            num_warps=cfg.fused_num_warps if fused else cfg.expand_num_warps,
            num_stages=cfg.fused_num_stages if fused else cfg.expand_num_stages,
            **_pdl_options(cfg, y.device),
        )
    return y


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, lora_rank: torch.Tensor, meta: LoRABatchMeta,
    cfg: KernelConfig | None = None, mask_rank: bool = True,
) -> torch.Tensor:
    """Shrink `u = x @ A[slot].T` per row, as fp32 split-K partials.

    Args:
        x: `[M, K]` activations.
        lora_a: `[L, r_max, K]` stacked A weights.
        lora_rank: `[L]` int32 real rank per slot (0: slot absent in this layer).
        meta: the step's `LoRABatchMeta`.
        mask_rank: read each slot's rank and mask past it. False promises that every slot a row
            uses has zero weights past its rank (the bank's layout) and about r_max real columns:
            the kernels then skip the rank load, a dependent memory round trip.

    Returns:
        `[S, M, r_pad]` fp32 partials (sum over S is u); only rows with a slot and columns below
        that slot's rank are written.
    """
    cfg = cfg or get_kernel_config(x.device)
    M, K = x.shape
    r_pad = padded_rank(lora_a.shape[1])
    rank_blocks = r_pad // BLOCK_R
    split = _split_k(meta, K, rank_blocks, cfg, x.device)
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.shrink_block_k) * cfg.shrink_block_k
    split = triton.cdiv(K, k_per_split)
    u = torch.empty(split, M, r_pad, dtype=torch.float32, device=x.device)
    for programs, tiles_per_slot, table, slot_list, class_rows in _launches(meta, expand=False):
        _lora_shrink_kernel[(programs, split, rank_blocks)](
            x, lora_a, u, lora_rank,
            *_meta_tensors(meta, table, slot_list),
            K, lora_a.shape[1], tiles_per_slot, k_per_split,
            x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
            u.stride(0), u.stride(1), u.stride(2),
            TILE_TABLE=table, USE_SLOT_LIST=slot_list is not None, CLASS_MAX_ROWS=class_rows, MASK_RANK=mask_rank,
            BLOCK_M=meta.block_m, BLOCK_R=BLOCK_R, BLOCK_K=cfg.shrink_block_k,
            DOT_PRECISION=_dot_precision(x.dtype),
            num_warps=cfg.shrink_num_warps, num_stages=cfg.shrink_num_stages,
            **_pdl_options(cfg, x.device),
        )
    return u


def lora_expand(
    u: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, lora_rank: torch.Tensor,
    y: torch.Tensor, meta: LoRABatchMeta, cfg: KernelConfig | None = None, mask_rank: bool = True,
    segments: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """Expand in place: `y[m] += scaling[s] * u[m] @ B[s].T` for every row m with a slot s.

    Args:
        u: `[S, M, r_pad]` fp32 partials from `lora_shrink` (of A stacked `[L, G * r_max, K]` for G
            merged segments).
        lora_b: `[L, N, r_max]` stacked B weights.
        scaling: `[L]` scale per slot.
        lora_rank: `[L]` int32 real rank per slot.
        y: `[M, N]` output, updated in place (rows without a slot are untouched).
        meta: the step's `LoRABatchMeta`.
        mask_rank: as in `lora_shrink`.
        segments: merged projections (e.g. q/k/v as one `[M, N_q + N_k + N_v]` output): the inner
            column edges, one or two of them, multiples of 16. Segment g uses u's columns
            `[g * r_max, (g + 1) * r_max)` (shrink of A stacked `[L, G * r_max, K]`), B's columns of
            the segment, and `scaling[g]` (scaling `[G, L]`). Needs `mask_rank=False`.

    Returns:
        `y`.
    """
    width = (len(segments or ()) + 1) * lora_b.shape[2]  # G * r_max columns of u are read
    if u.dim() != 3 or u.shape[1] != y.shape[0] or u.shape[2] < width:
        raise ValueError(f"u must be lora_shrink's partials [S, M = {y.shape[0]}, >= {width}], got {tuple(u.shape)}")
    if segments is not None:
        if mask_rank:
            raise ValueError("segments need mask_rank=False (uniform ranks, zero-padded weights)")
        if not 1 <= len(segments) <= 2 or scaling.dim() != 2 or scaling.shape[0] != len(segments) + 1:
            raise ValueError(f"segments {tuple(segments)} need scaling [len(segments) + 1, L], got "
                             f"{tuple(scaling.shape)}")
    return _run_expand(y, lora_b, scaling, lora_rank, meta, cfg or get_kernel_config(y.device), mask_rank, u=u,
                       segments=segments)


def lora_fused(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, lora_rank: torch.Tensor,
    y: torch.Tensor, meta: LoRABatchMeta, cfg: KernelConfig | None = None, mask_rank: bool = True,
) -> torch.Tensor:
    """Shrink and expand in one kernel: `y[m] += scaling[s] * (x[m] @ A[s].T) @ B[s].T` in place.

    Same arguments as `lora_shrink` + `lora_expand` (x `[M, K]`, lora_a `[L, r_max, K]`, lora_b
    `[L, N, r_max]`, scaling `[L]`, lora_rank `[L]`, y `[M, N]`); one launch per grid-mode launch
    instead of two, and u never leaves the registers. Returns `y`.
    """
    return _run_expand(y, lora_b, scaling, lora_rank, meta, cfg or get_kernel_config(y.device), mask_rank,
                       x=x, lora_a=lora_a)
