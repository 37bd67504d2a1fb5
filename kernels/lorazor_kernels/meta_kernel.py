"""The step metadata of the `exact` and `full` grids in one Triton launch (one program).

`meta.build_batch_meta` builds the same tensors from torch ops: a sort, a scatter, cumsums, a
searchsorted and gathers, about 25 small kernels (75 us of a Llama decode step at batch 256 on the
H200, measured by `benchmarks/profile_step.py`). Here one program does it all, for steps of up to
`MAX_ROWS` rows and banks of up to `MAX_SLOTS` slots (every decode batch LoRazor captures); larger
ones (prefill) take the torch path, which stays the reference the tests compare against.

Every count is a comparison summed over chunks, so no step needs a gather from registers:
    key[m]        = row_slot[m] if >= 0 else L
    pos[m]        = #{j : key[j] < key[m]} + #{j < m : key[j] == key[m]}   (stable sort position)
    sorted_rows[pos[m]] = m
    slot_start[s] = #{j : key[j] < s}
    tile_end[s]   = sum over s' <= s of ceil(count[s'] / BM)             (scratch)
    slot of tile t = #{s : tile_end[s] <= t}, first tile of that slot = max{tile_end[s] <= t}
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Limits of the one-program build: beyond them the comparisons outgrow one program's registers.
MAX_ROWS = 1024
MAX_SLOTS = 1023
ROW_CHUNK = 32
SLOT_CHUNK = 64
TILE_CHUNK = 64


@triton.jit
def _keys(row_slot_ptr, rows, M, L):
    """Sort key of each row: its slot, L without an adapter, L + 1 past the batch (never counted)."""
    slot = tl.load(row_slot_ptr + rows, mask=rows < M, other=-1)
    return tl.where(rows < M, tl.where(slot >= 0, slot, L), L + 1)


@triton.jit
def _batch_meta_kernel(
    row_slot_ptr, sorted_rows_ptr, slot_start_ptr, tile_end_ptr, tile_slot_ptr, tile_rows_ptr, needed_ptr,
    M, L, T,
    BLOCK_ROWS: tl.constexpr, BLOCK_SLOTS: tl.constexpr, ROW_CHUNK: tl.constexpr, SLOT_CHUNK: tl.constexpr,
    TILE_CHUNK: tl.constexpr, BM: tl.constexpr, TILES: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_ROWS)
    key = _keys(row_slot_ptr, rows, M, L)
    slots = tl.arange(0, BLOCK_SLOTS)
    pos = tl.zeros([BLOCK_ROWS], dtype=tl.int32)
    below = tl.zeros([BLOCK_SLOTS], dtype=tl.int32)  # rows whose key is below each slot: slot_start
    count = tl.zeros([BLOCK_SLOTS], dtype=tl.int32)  # rows of each slot
    for j0 in range(0, M, ROW_CHUNK):
        j = j0 + tl.arange(0, ROW_CHUNK)
        kj = _keys(row_slot_ptr, j, M, L)
        ahead = (kj[None, :] < key[:, None]) | ((kj[None, :] == key[:, None]) & (j[None, :] < rows[:, None]))
        pos += tl.sum(ahead.to(tl.int32), axis=1)
        below += tl.sum((kj[None, :] < slots[:, None]).to(tl.int32), axis=1)
        if TILES:
            count += tl.sum((kj[None, :] == slots[:, None]).to(tl.int32), axis=1)
    tl.store(sorted_rows_ptr + pos, rows.to(tl.int64), mask=rows < M)
    tl.store(slot_start_ptr + slots, below.to(tl.int64), mask=slots <= L)
    if TILES:
        tiles = tl.where(slots < L, (count + BM - 1) // BM, 0)
        tile_end = tl.cumsum(tiles, 0)
        tl.store(tile_end_ptr + slots, tile_end, mask=slots < L)
        tl.store(needed_ptr, tl.max(tile_end, 0))
        tl.debug_barrier()  # sorted_rows, slot_start and tile_end are read back below
        lanes = tl.arange(0, BM)
        for t0 in range(0, T, TILE_CHUNK):
            t = t0 + tl.arange(0, TILE_CHUNK)
            slot = tl.zeros([TILE_CHUNK], dtype=tl.int32)
            first = tl.zeros([TILE_CHUNK], dtype=tl.int32)
            for s0 in range(0, L, SLOT_CHUNK):
                s = s0 + tl.arange(0, SLOT_CHUNK)
                ends = tl.load(tile_end_ptr + s, mask=s < L, other=2147483647)
                done = ends[None, :] <= t[:, None]
                slot += tl.sum(done.to(tl.int32), axis=1)
                first = tl.maximum(first, tl.max(tl.where(done, ends[None, :], 0), axis=1))
            valid = (slot < L) & (t < T)
            slot_c = tl.minimum(slot, L - 1)
            group_lo = tl.load(slot_start_ptr + slot_c, mask=t < T, other=0)
            group_hi = tl.load(slot_start_ptr + slot_c + 1, mask=t < T, other=0)
            p = (group_lo + (t - first) * BM)[:, None] + lanes[None, :]
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
    tile_end = torch.empty(num_slots, dtype=torch.int32, device=device)
    needed = torch.empty(1, dtype=torch.int32, device=device)
    _batch_meta_kernel[(1,)](
        row_slot, sorted_rows, slot_start, tile_end, tile_slot, tile_rows, needed, M, num_slots, T,
        BLOCK_ROWS=triton.next_power_of_2(M), BLOCK_SLOTS=triton.next_power_of_2(num_slots + 1),
        ROW_CHUNK=ROW_CHUNK, SLOT_CHUNK=SLOT_CHUNK, TILE_CHUNK=TILE_CHUNK, BM=block_m, TILES=tiles, num_warps=8,
    )
    if not tiles:
        return sorted_rows, slot_start, None, None, None
    return sorted_rows, slot_start, tile_slot[:T], tile_rows[:T], needed
