"""Per-step batch metadata for the grouped LoRA kernels, built once per step and shared by every layer.

All tensors are computed on the device from `row_slot` with sort/scatter/cumsum/searchsorted: no host
sync, so building the metadata can live inside a captured CUDA graph (`exact` and `full` modes).
On a GPU whose `KernelConfig.one_program_meta` is on, `exact` and `full` steps of up to 1024 rows
are built by one Triton program instead (`meta_kernel.py`), checked against this torch build.
`active_rows` and `two_class` need the largest group size on the host to pick their row bound R, as
the paper's host-side scheduler does: building them costs one sync per step (never per layer).

Semantics (what the kernels read):
    key            = where(row_slot >= 0, row_slot, L)      # no-adapter rows sort last
    sorted_rows    = stable argsort(key)                      # [M] rows grouped by slot
    slot_start[s]  = first position of slot s in sorted_rows  # [L + 1], slot_start[L] = rows with LoRA
    exact tiles:   tile t holds the rows tile_rows[t, :] (-1: empty lane) of slot s = tile_slot[t],
                   at most BM rows of one slot; tile_slot[t] = -1 past the last real tile. Rows are
                   stored per tile so a kernel program reaches its rows in one load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernel_config import get_kernel_config
from .meta_kernel import MAX_ROWS, MAX_SLOTS, build_meta_tensors, fits_one_program

GRID_MODES = ("full", "active_rows", "two_class", "exact")
# Row bounds are 16 * 2^k (paper eq. 7); 16 is also the smallest legal tl.dot dimension.
MIN_ROW_BOUND = 16
# two_class: slots with at most this many rows form the small class (paper eq. 4).
SMALL_CLASS_ROWS = 16
# two_class: capacity C of the compact large-class slot list (paper 3.1.3).
LARGE_CLASS_CAPACITY = 16
# two_class is enabled only with at least this many small slots (paper 3.1.3).
MIN_SMALL_SLOTS = 8
BUILDERS = ("auto", "torch", "triton")


def row_bound(max_rows: int, num_rows: int) -> int:
    """Smallest supported bound 16 * 2^k >= max_rows, or M itself (paper eq. 7-8)."""
    bound = MIN_ROW_BOUND
    while bound < max_rows and bound < num_rows:
        bound *= 2
    return min(bound, max(num_rows, 1)) if max_rows > 0 else MIN_ROW_BOUND


@dataclass
class LoRABatchMeta:
    """Metadata for one step. Tensors live on the batch's device; ints are launch geometry.

    Attributes:
        grid: one of `GRID_MODES`.
        num_rows: M, rows (tokens) in the step.
        num_slots: L, adapter slots of the bank.
        block_m: row-tile height BM the tile table and slot-tile grids were built for.
        sorted_rows: `[M]` int64 row indices grouped by slot, no-adapter rows last.
        slot_start: `[L + 1]` int64 start of each slot's group in `sorted_rows`.
        tile_slot: `[T]` int32 slot of each exact tile (-1: exits), `exact` only.
        tile_rows: `[T, BM]` int32 rows of each exact tile (-1: empty lane), `exact` only.
        row_bound: R, the shared row bound (`full`: M; `active_rows`/`two_class`: 16 * 2^k).
        large_slots: `[C]` int32 compact list of large-class slots (-1 padded), `two_class` only.
        class_split: whether this step runs the two-class expand (`two_class` only).
        has_lora: False when no row has an adapter (the layers then skip LoRA entirely);
            None when unknown on the host (`exact`/`full` never sync to find out).
    """

    grid: str
    num_rows: int
    num_slots: int
    block_m: int
    sorted_rows: torch.Tensor
    slot_start: torch.Tensor
    row_slot: torch.Tensor
    tile_slot: torch.Tensor | None = None
    tile_rows: torch.Tensor | None = None
    row_bound: int = 0
    large_slots: torch.Tensor | None = None
    class_split: bool = False
    has_lora: bool | None = None

    @property
    def num_tiles(self) -> int:
        """Exact tiles launched (`exact` only): the tile table's length."""
        return self.tile_slot.shape[0]


def tile_table_size(num_rows: int, num_slots: int, block_m: int, max_active_slots: int | None = None) -> int:
    """Upper bound on exact tiles: the full row tiles plus one partial tile per slot in use."""
    active = min(num_slots, num_rows, num_slots if max_active_slots is None else max_active_slots)
    return -(-num_rows // block_m) + active


def slot_bound_class(distinct_slots: int, num_slots: int, smallest: int = 16) -> int:
    """The `max_active_slots` class of a batch using `distinct_slots` slots: a power of two
    >= max(distinct_slots, smallest), at most `num_slots` (a few classes, so a few graphs)."""
    bound = smallest
    while bound < distinct_slots:
        bound *= 2
    return min(bound, num_slots)


def build_batch_meta(row_slot: torch.Tensor, num_slots: int, grid: str = "exact", block_m: int = 16,
                     max_active_slots: int | None = None, builder: str = "auto",
                     check_bound: bool = True) -> LoRABatchMeta:
    """Build the step metadata from the per-row slot map.

    Args:
        row_slot: `[M]` int slot per row (-1: no adapter). Values must be < `num_slots`.
        num_slots: L, the number of slots in the adapter bank.
        grid: grid mode, one of `GRID_MODES`.
        block_m: row-tile height BM (a power of two >= 16).
        max_active_slots: `exact` only: at most this many distinct slots appear in `row_slot` (known
            on the host, e.g. from a request batch's adapter names). It bounds the tile table, and so
            the launch grid and the split sizes chosen from it: a bank of 128 slots serving one
            adapter launches 16 + 8 tiles, not 16 + 128. None: every slot may appear. A batch that
            breaks the bound raises ValueError when `check_bound` (a host sync; skipped during CUDA
            graph capture), and fails a device-side assert otherwise (never a silently dropped row).
        builder: `exact`/`full` only: "torch" (sort, scatter, cumsum: the reference), "triton" (one
            program, `meta_kernel.py`; steps up to 1024 rows and 1023 slots) or "auto" (triton on a
            GPU whose `KernelConfig.one_program_meta` is on and when the step fits, else torch).
        check_bound: check `max_active_slots` on the host (callers that know the bound holds, such as
            a model step that derived it from the batch, pass False: no sync in the decode step).

    Returns:
        A `LoRABatchMeta` shared by every LoRA layer of the step.
    """
    if grid not in GRID_MODES:
        raise ValueError(f"grid must be one of {GRID_MODES}, got {grid!r}")
    if block_m < MIN_ROW_BOUND or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= {MIN_ROW_BOUND}, got {block_m}")
    if row_slot.dim() != 1:
        raise ValueError(f"row_slot must be 1-D [M], got shape {tuple(row_slot.shape)}")
    if builder not in BUILDERS:
        raise ValueError(f"builder must be one of {BUILDERS}, got {builder!r}")
    if grid == "exact" and max_active_slots is not None and max_active_slots < 1:
        raise ValueError(f"max_active_slots must be >= 1 or None, got {max_active_slots}")
    if (grid == "exact" and max_active_slots is not None and check_bound
            and not (row_slot.is_cuda and torch.cuda.is_current_stream_capturing())):
        distinct = int(torch.unique(row_slot[row_slot >= 0]).numel())
        if distinct > max_active_slots:
            raise ValueError(f"row_slot uses {distinct} distinct slots but max_active_slots={max_active_slots}")
    num_rows = row_slot.shape[0]
    if grid in ("exact", "full") and _use_one_program(builder, row_slot, num_rows, num_slots):
        return _build_in_one_program(row_slot, num_slots, grid, block_m, max_active_slots)
    device = row_slot.device
    key = torch.where(row_slot >= 0, row_slot.long(), torch.full_like(row_slot, num_slots, dtype=torch.long))
    # 32-bit keys: half the radix passes of 64-bit ones (the int64 sort took 28 us of a decode step at M=256).
    sorted_rows = torch.sort(key.int(), stable=True).indices
    counts = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    slot_start = torch.zeros(num_slots + 1, dtype=torch.long, device=device)
    torch.cumsum(counts[:num_slots], 0, out=slot_start[1:])
    meta = LoRABatchMeta(grid, num_rows, num_slots, block_m, sorted_rows, slot_start, row_slot)

    if grid == "exact":
        tiles = (counts[:num_slots] + block_m - 1) // block_m
        tile_end = torch.cumsum(tiles, 0)
        num_tiles = tile_table_size(num_rows, num_slots, block_m, max_active_slots)
        _assert_tiles_fit(tile_end[-1], num_tiles, num_rows, num_slots, max_active_slots)
        t = torch.arange(num_tiles, device=device)
        slot_of_tile = torch.searchsorted(tile_end, t, right=True)
        valid = slot_of_tile < num_slots
        slot_c = slot_of_tile.clamp(max=num_slots - 1)
        first_tile = tile_end[slot_c] - tiles[slot_c]
        pos = (slot_start[slot_c] + (t - first_tile) * block_m)[:, None] + torch.arange(block_m, device=device)
        in_tile = valid[:, None] & (pos < slot_start[slot_c + 1][:, None])
        rows = sorted_rows[pos.clamp(max=max(num_rows - 1, 0))]
        meta.tile_rows = torch.where(in_tile, rows, -1).to(torch.int32)
        meta.tile_slot = torch.where(valid, slot_of_tile, -1).to(torch.int32)
    elif grid == "full":
        meta.row_bound = max(num_rows, 1)
    else:
        # The paper's modes pick their launch shape on the host: one sync per step.
        group = counts[:num_slots]
        max_rows = int(group.max()) if num_slots else 0
        meta.has_lora = max_rows > 0
        meta.row_bound = row_bound(max_rows, num_rows)
        if grid == "two_class":
            small = int(((group > 0) & (group <= SMALL_CLASS_ROWS)).sum())
            large_mask = group > SMALL_CLASS_ROWS
            n_large = int(large_mask.sum())
            meta.class_split = small >= MIN_SMALL_SLOTS and 1 <= n_large <= LARGE_CLASS_CAPACITY
            if meta.class_split:
                large = torch.full((LARGE_CLASS_CAPACITY,), -1, dtype=torch.int32, device=device)
                ids = torch.nonzero(large_mask).squeeze(1).to(torch.int32)
                large[: ids.numel()] = ids
                meta.large_slots = large
    return meta


def _use_one_program(builder: str, row_slot: torch.Tensor, num_rows: int, num_slots: int) -> bool:
    if builder == "torch":
        return False
    fits = fits_one_program(num_rows, num_slots)
    if builder == "triton":
        if not fits:
            raise ValueError(f"the one-program build takes 1..{MAX_ROWS} rows and "
                             f"1..{MAX_SLOTS} slots, got {num_rows} rows and {num_slots} slots")
        return True
    if row_slot.device.type != "cuda" or not fits:
        return False
    return get_kernel_config(row_slot.device).one_program_meta


def _build_in_one_program(row_slot, num_slots, grid, block_m, max_active_slots) -> LoRABatchMeta:
    num_rows = row_slot.shape[0]
    num_tiles = tile_table_size(num_rows, num_slots, block_m, max_active_slots) if grid == "exact" else None
    sorted_rows, slot_start, tile_slot, tile_rows, needed = build_meta_tensors(row_slot, num_slots, block_m, num_tiles)
    meta = LoRABatchMeta(grid, num_rows, num_slots, block_m, sorted_rows, slot_start, row_slot, tile_slot, tile_rows)
    if grid == "full":
        meta.row_bound = num_rows
    else:
        _assert_tiles_fit(needed[0], num_tiles, num_rows, num_slots, max_active_slots)
    return meta


def _assert_tiles_fit(tiles_needed: torch.Tensor, num_tiles: int, num_rows: int, num_slots: int,
                      max_active_slots: int | None) -> None:
    """With a bound below the bank, fail (asynchronously: no host sync, capturable) when the batch
    needs more tiles than the table holds, instead of silently dropping rows."""
    if max_active_slots is not None and max_active_slots < min(num_slots, num_rows):
        torch._assert_async(tiles_needed <= num_tiles, "row_slot uses more distinct slots than max_active_slots")
