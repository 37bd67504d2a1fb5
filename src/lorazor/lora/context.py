"""StepContext: the per-step LoRA metadata shared by every BatchedLoRALinear of a model.

`begin(row_slot)` builds the kernels' `LoRABatchMeta` once per forward (per step, never per layer);
each layer reads `context.meta`. The build is device-only for the `exact` and `full` grids, so it can
sit inside a captured CUDA graph and is replayed with the graph.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from lorazor_kernels import LoRABatchMeta, build_batch_meta, slot_bound_class


class StepContext:
    """Holds the metadata of the forward in flight.

    Args:
        num_slots: L, slots in the adapter bank.
        grid: kernel grid mode.
        backend: "triton" or "reference".
        block_m: row-tile height of the kernels.
    """

    def __init__(self, num_slots: int, grid: str, backend: str, block_m: int = 16):
        self.num_slots = num_slots
        self.grid = grid
        self.backend = backend
        self.block_m = block_m
        self.meta: LoRABatchMeta | None = None
        # False when no row of the batch has an adapter: the layers then run the backbone alone.
        self.enabled = True
        # `exact` grid: at most this many distinct slots in the batch (None: any of the bank's).
        self.slot_bound: int | None = None

    def begin_batch(self, row_slot: torch.Tensor) -> None:
        """Per call (one host sync, never per step): whether any row has an adapter, and the class
        of the number of distinct adapters, which bounds the `exact` tile table. A bank of 128 slots
        serving a batch of 3 adapters then launches the grid of 16, not 128 (release only lowers it)."""
        self.set_distinct(torch.unique(row_slot[row_slot >= 0]).numel())

    def set_distinct(self, distinct: int) -> None:
        """`begin_batch` for a caller that knows how many distinct adapters its rows use (no sync)."""
        self.enabled = distinct > 0
        # None when no row has an adapter: the backbone-only step has no tile table to bound.
        self.slot_bound = slot_bound_class(distinct, self.num_slots) if self.grid == "exact" and distinct else None

    @property
    def meta_on_device(self) -> bool:
        """Whether building the metadata needs no host sync (so it can be captured in a graph)."""
        return self.grid in ("exact", "full")

    def slot_bound_classes(self) -> list[int | None]:
        """Every `slot_bound` a batch can get (one set of graphs each)."""
        if self.grid != "exact":
            return [None]
        return sorted({slot_bound_class(n, self.num_slots) for n in range(1, self.num_slots + 1)})

    def build(self, row_slot: torch.Tensor, tokens_per_row: int = 1) -> LoRABatchMeta:
        token_slot = row_slot if tokens_per_row == 1 else row_slot.repeat_interleave(tokens_per_row)
        # The bound comes from the batch itself (`begin_batch`) and release only lowers it: no check.
        return build_batch_meta(token_slot, self.num_slots, self.grid, self.block_m, self.slot_bound,
                                check_bound=False)

    def begin(self, row_slot: torch.Tensor, tokens_per_row: int = 1, meta: LoRABatchMeta | None = None) -> None:
        """Set the metadata of the forward about to run (no context manager: torch.compile-friendly)."""
        if not self.enabled:
            self.meta = None
        else:
            self.meta = meta if meta is not None else self.build(row_slot, tokens_per_row)

    @contextmanager
    def step(self, row_slot: torch.Tensor, tokens_per_row: int = 1, meta: LoRABatchMeta | None = None):
        """Run one forward with `row_slot` `[B]` (int, -1 = no LoRA) repeated over each row's tokens.

        `meta`: metadata prepared by the caller (the graph runner's static buffers); built here if None.
        """
        self.begin(row_slot, tokens_per_row, meta)
        try:
            yield self.meta
        finally:
            self.meta = None
