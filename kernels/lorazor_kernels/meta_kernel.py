"""The step metadata of the `exact` and `full` grids in one Triton launch (one program).

`meta.build_batch_meta` builds the same tensors from torch ops: a sort, a scatter, cumsums, a
searchsorted and gathers, about 25 small kernels (75 us of a Llama decode step at batch 256 on the
H200, measured by `benchmarks/probes/profile_step.py`). Here one program does it all, for steps of up to
`MAX_ROWS` rows and banks of up to `MAX_SLOTS` slots (every decode batch LoRazor captures); larger
ones (prefill) take the torch path, which stays the reference the tests compare against.

Everything lives in the program's registers; the only memory round trips are the row -> slot load
and the tile table's gather of `sorted_rows`:
    key[m]        = row_slot[m] if >= 0 else L   (rows past the batch: L too, after every real row)
    sorted_rows   = sort(key * BLOCK_ROWS + m) % BLOCK_ROWS      (stable: ties keep row order)
    count[s]      = histogram(key)[s];  slot_start[s] = sum over s' < s of count[s']
    tile_end[s]   = sum over s' <= s of ceil(count[s'] / BM)
    slot of tile t = #{s : tile_end[s] <= t} (a prefix of the slots, as tile_end never falls), the
    tile's first row in sorted order = the counts of that prefix + (t - its last tile_end) * BM
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Limits of the one-program build: beyond them its [tiles, slots] comparisons outgrow one program's registers.
MAX_ROWS = 1024
MAX_SLOTS = 1023
TILE_CHUNK = 32
# The smallest sort width: steps of 1 to 64 rows share one compile (a 64-wide sort costs the one program
# next to nothing).
MIN_BLOCK_ROWS = 64


# M and T change with every bucket: not specialized on, so one compile serves a BLOCK_ROWS class.
@triton.jit(do_not_specialize=["M", "T"])
def _batch_meta_kernel(
    row_slot_ptr, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr, needed_ptr,
    M, L, T,
    BLOCK_ROWS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, TILE_CHUNK: tl.constexpr, BM: tl.constexpr,
    TILES: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_ROWS)
    slot_of_row = tl.load(row_slot_ptr + rows, mask=rows < M, other=-1)
    key = tl.where((slot_of_row >= 0) & (rows < M), tl.minimum(slot_of_row, L), L).to(tl.int32)
    order = tl.sort(key * BLOCK_ROWS + rows)
    tl.store(sorted_rows_ptr + rows, (order % BLOCK_ROWS).to(tl.int64), mask=rows < M)
    slots = tl.arange(0, BLOCK_SLOTS)
    count = tl.histogram(key, BLOCK_SLOTS)  # key <= L < BLOCK_SLOTS
    tl.store(slot_start_ptr + slots, (tl.cumsum(count, 0) - count).to(tl.int64), mask=slots <= L)
    if TILES:
        count = tl.where(slots < L, count, 0)
        tile_end = tl.cumsum((count + BM - 1) // BM, 0)
        tl.store(needed_ptr, tl.max(tile_end, 0))
        tl.debug_barrier()  # sorted_rows is gathered below
        lanes = tl.arange(0, BM)
        for t0 in range(0, T, TILE_CHUNK):
            t = t0 + tl.arange(0, TILE_CHUNK)
            before = tile_end[None, :] <= t[:, None]  # [tiles, slots]: the slots wholly before tile t
            slot = tl.sum(before.to(tl.int32), axis=1)
            first_tile = tl.max(tl.where(before, tile_end[None, :], 0), axis=1)
            group_lo = tl.sum(tl.where(before, count[None, :], 0), axis=1)
            group_hi = group_lo + tl.sum(tl.where(slots[None, :] == slot[:, None], count[None, :], 0), axis=1)
            valid = (slot < L) & (t < T)
            p = (group_lo + (t - first_tile) * BM)[:, None] + lanes[None, :]
            in_tile = valid[:, None] & (p < group_hi[:, None])
            tile_rows = tl.load(sorted_rows_ptr + p, mask=in_tile, other=-1)
            tl.store(tile_rows_ptr + t[:, None] * BM + lanes[None, :], tile_rows.to(tl.int32), mask=(t < T)[:, None])
            tl.store(tile_slot_ptr + t, tl.where(valid, slot, -1), mask=t < T)


def fits_one_program(num_rows: int, num_slots: int) -> bool:
    """Whether `build_meta_tensors` takes this step (else the torch build does)."""
    return 0 < num_rows <= MAX_ROWS and 0 < num_slots <= MAX_SLOTS


def build_meta_tensors(row_slot: torch.Tensor, num_slots: int, block_m: int, num_tiles: int | None):
    """(sorted_rows int64 [M], slot_start int64 [L + 1], tile_slot int32 [T] | None, tile_rows int32
    [T, BM] | None, tiles needed int32 [1] | None) in one launch; tiles only when `num_tiles` is given."""
    M = row_slot.shape[0]
    device = row_slot.device
    sorted_rows = torch.empty(M, dtype=torch.int64, device=device)
    slot_start = torch.empty(num_slots + 1, dtype=torch.int64, device=device)
    tiles = num_tiles is not None
    T = num_tiles if tiles else 0
    tile_slot = torch.empty(max(T, 1), dtype=torch.int32, device=device)
    tile_rows = torch.empty(max(T, 1), block_m, dtype=torch.int32, device=device)
    needed = torch.empty(1, dtype=torch.int32, device=device)
    _batch_meta_kernel[(1,)](
        row_slot, sorted_rows, slot_start, tile_slot, tile_rows, needed, M, num_slots, T,
        BLOCK_ROWS=max(MIN_BLOCK_ROWS, triton.next_power_of_2(M)), BLOCK_SLOTS=triton.next_power_of_2(num_slots + 1),
        TILE_CHUNK=TILE_CHUNK, BM=block_m, TILES=tiles, num_warps=8,
    )
    if not tiles:
        return sorted_rows, slot_start, None, None, None
    return sorted_rows, slot_start, tile_slot[:T], tile_rows[:T], needed
