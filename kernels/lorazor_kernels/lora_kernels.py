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
                      one launch per projection (merged q/k/v or gate/up included: a program shrinks
                      once per segment it covers) and no u round trip through memory; when a launch
                      has too few tiles to fill the GPU, N is split over more programs, each
                      recomputing its tile's small shrink.
Launch geometry and the entry points are in `lora_launch.py`.
Ranks are padded only inside the kernels to a dot-legal power of two >= 16. With MASK_RANK, loads
past a slot's real rank are masked, so a rank-8 adapter reads rank-8 bytes even in a bank whose
largest rank is 64; without it (uniform-rank banks, zeros past each rank) the rank load is skipped.
"""

from __future__ import annotations

import triton
import triton.language as tl

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
                  DOT_PRECISION: tl.constexpr, WRITE_ONLY: tl.constexpr):
    """y[rows, n0:n0 + BN] += scale * u @ b_tile (WRITE_ONLY: y[...] = scale * u @ b_tile)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    acc = tl.dot(u, b_tile, input_precision=DOT_PRECISION)  # [BM, BR] @ [BR, BN]
    y_tile = y_rows + offs_n[None, :] * stride_yn
    mask = mask_m[:, None] & (offs_n < N)[None, :]
    if WRITE_ONLY:
        tl.store(y_tile, (acc * scale).to(y_tile.dtype.element_ty), mask=mask)
    else:
        y_old = tl.load(y_tile, mask=mask, other=0.0)
        tl.store(y_tile, (y_old.to(tl.float32) + acc * scale).to(y_old.dtype), mask=mask)


@triton.jit
def _expand_rows(
    u, b_slot, y_rows, mask_m, offs_r, mask_r, scale, n_lo, n_hi, N, stride_br, stride_bn, stride_yn,
    b_first, n_first, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    WRITE_ONLY: tl.constexpr,
):
    """y[rows, n_lo:n_hi] += scale * u @ B[slot, :, r].T, with u `[BM, BR]` in the weights' dtype.

    `b_first`: B's tile at column n_first (the program's first block, loaded before the wait for
    the kernel ahead), used when this range starts there.
    """
    start = n_lo
    if n_lo == n_first:
        _expand_block(u, b_first, y_rows, mask_m, scale, n_lo, N, stride_yn, BLOCK_N, DOT_PRECISION, WRITE_ONLY)
        start = n_lo + BLOCK_N
    for n0 in range(start, tl.minimum(n_hi, N), BLOCK_N):
        b_tile = _load_b(b_slot, offs_r, mask_r, n0, N, stride_br, stride_bn, BLOCK_N)
        _expand_block(u, b_tile, y_rows, mask_m, scale, n0, N, stride_yn, BLOCK_N, DOT_PRECISION, WRITE_ONLY)


@triton.jit
def _zero_rows(j, sorted_rows_ptr, no_slot_start_ptr, M, y_ptr, stride_ym, stride_yn, n_lo, n_hi,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr):
    """Write zeros into y[rows, n_lo:n_hi] for the j-th run of BLOCK_M rows without a slot (they sort
    last in `sorted_rows`, from position `slot_start[L]`): the write-only expand's rows without LoRA."""
    pos = tl.load(no_slot_start_ptr) + j * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = pos < M
    rows = tl.load(sorted_rows_ptr + pos, mask=mask_m, other=0).to(tl.int64)
    _dependent_launch_prologue(USE_GDC)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=y_ptr.dtype.element_ty)
    for n0 in range(n_lo, n_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        tl.store(y_ptr + rows[:, None] * stride_ym + offs_n[None, :] * stride_yn, zeros,
                 mask=mask_m[:, None] & (offs_n < n_hi)[None, :])


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


# The row count and the tile table's length change with every batch bucket and adapter class:
# specializing on them (== 1, divisible by 16) would compile the kernel again for many buckets of a
# warm-up. Neither feeds an address, so nothing is lost by treating them as plain integers.
@triton.jit(do_not_specialize=["M", "n_tiles"])
def _lora_expand_kernel(
    x_ptr, a_ptr, u_ptr, b_ptr, y_ptr, scaling_ptr, rank_ptr,
    sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
    K, N, r_max, tiles_per_slot, n_per_program, seg_n1, seg_n2, stride_sg, M, num_slots, n_tiles,
    stride_xm, stride_xk, stride_al, stride_ar, stride_ak, stride_us, stride_um, stride_ur,
    stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
    TILE_TABLE: tl.constexpr, USE_SLOT_LIST: tl.constexpr, CLASS_MAX_ROWS: tl.constexpr, MASK_RANK: tl.constexpr,
    FUSED: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_GDC: tl.constexpr, WRITE_ONLY: tl.constexpr,
):
    """Expand a tile into y. FUSED: shrink the tile over all of K first (x, A); else sum the SPLIT_K
    fp32 partials `u [SPLIT_K, M, R]` that the shrink kernel wrote.

    y's columns are up to three segments [0, seg_n1), [seg_n1, seg_n2), [seg_n2, N); a plain
    projection is one segment (seg_n1 = seg_n2 = N). Segment g reads its own r_max columns of u
    (`u[:, g * r_max :]`; FUSED: shrinks with rows `[g * r_max, (g + 1) * r_max)` of A) and its own
    scaling row (`scaling_ptr + g * stride_sg`): merged projections, e.g. q/k/v in one output.
    Segment edges are multiples of BLOCK_N.

    WRITE_ONLY (exact grid): y is overwritten with the delta, never read; every row gets
    written, so y may start uninitialized: rows of the tile table get their delta (zeros where the
    slot's rank is 0), and the programs past the table's `n_tiles` write zeros into the rows without
    a slot. The model's GEMM then adds x @ W.T to it (`KernelConfig.gemm_adds_lora`).
    """
    pid = tl.program_id(0)
    pid_n = tl.program_id(1)
    # A program covers n_per_program columns in BLOCK_N steps: fewer, longer programs amortize the
    # tile lookup and keep several independent B loads in flight.
    n_lo = pid_n * n_per_program
    n_hi = tl.minimum(n_lo + n_per_program, N)
    if WRITE_ONLY:
        if pid >= n_tiles:
            _zero_rows(pid - n_tiles, sorted_rows_ptr, slot_start_ptr + num_slots, M, y_ptr, stride_ym, stride_yn,
                       n_lo, n_hi, BLOCK_M, BLOCK_N, USE_GDC)
            return
    slot, rows, mask_m, rank = _tile(
        pid, rank_ptr, r_max, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, slot_list_ptr,
        tiles_per_slot, TILE_TABLE, USE_SLOT_LIST, CLASS_MAX_ROWS, MASK_RANK, BLOCK_M,
    )
    if WRITE_ONLY:
        if slot < 0:  # past the table's last real tile: no rows
            return
    elif rank == 0:
        return
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    slot64 = slot.to(tl.int64)
    b_slot = b_ptr + slot64 * stride_bl
    y_rows = y_ptr + rows[:, None] * stride_ym
    # The first B tile before the wait for the kernel ahead (adapter weights never depend on it).
    b_first = _load_b(b_slot, offs_r, mask_r, n_lo, N, stride_br, stride_bn, BLOCK_N)
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
        if lo < hi:  # u and scaling once per segment this program touches
            if FUSED:  # the segment's u shrunk here over all of K, from its r_max rows of A
                u = _shrink_rows(
                    x_ptr + rows[:, None] * stride_xm,
                    a_ptr + slot64 * stride_al + (seg * r_max + offs_r)[:, None] * stride_ar,
                    mask_m, mask_r, 0, K, K, stride_xk, stride_ak, BLOCK_M, BLOCK_R, BLOCK_K, DOT_PRECISION, False,
                )
            else:
                u = _load_u(u_ptr + seg * r_max * stride_ur, rows, mask_m, offs_r, mask_r,
                            stride_us, stride_um, stride_ur, SPLIT_K, BLOCK_M, BLOCK_R)
            scale = tl.load(scaling_ptr + seg * stride_sg + slot).to(tl.float32)
            _expand_rows(
                u.to(b_ptr.dtype.element_ty), b_slot, y_rows, mask_m, offs_r, mask_r, scale, lo, hi, N,
                stride_br, stride_bn, stride_yn, b_first, n_lo, BLOCK_M, BLOCK_N, DOT_PRECISION, WRITE_ONLY,
            )
