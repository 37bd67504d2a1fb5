"""The device side of the engine's steps, in one owner: the paged KV pool, the block tables, the step
graphs, the release policies bound to the adapter slots and the grammar bitmask buffers.

The engine hands over host lists (`StepInputs`: what each scheduled token is, where its KV goes;
`Picks`: what each producing row needs picked) and gets back a `LaunchedStep` whose values it reads
once. Two calls per step, so the engine can read the step before back between them (a grammar's
mask needs the request's last token) while the GPU runs this step's forward:

    logits, hidden = steps.forward(inputs, previous)     # queued, no host sync
    launched = steps.pick(picks, logits, hidden)        # queued, one non-blocking copy to the host
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .block_tables import BlockTables
from .grammar import MaskBuffers, apply_masks
from .launched import LaunchedStep, Picks, launch_picks
from .release import BoundPolicies


@dataclass
class StepInputs:
    """Host view of one step: per token its id, position, slot, flat pool position; per chunk its
    table row, first position, token count and packed index of its last token; distinct adapters;
    the block-table cells that changed (`(row, first block index, blocks)`)."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    slot_mapping: list[int]
    chunks: list[tuple[int, int, int]]
    last: list[int]
    num_adapters: int
    # (token index, request) of each token still on the device: the output of the step in flight.
    pending: list = field(default_factory=list)
    table_writes: list = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        """One token per chunk."""
        return len(self.ids) == len(self.chunks)


class PagedSteps:
    """The engine's device state and its step launches.

    Args:
        runner: the `ModelRunner`.
        bank: the LoRA slot bank (the policies bind to its slots).
        num_blocks, block_size: the paged KV pool.
        max_rows, max_tokens: the engine's seats and tokens per step (the graphs' buckets).
        max_blocks_per_row: the block tables' width.
    """

    def __init__(self, runner, bank, num_blocks: int, block_size: int, max_rows: int, max_tokens: int,
                 max_blocks_per_row: int):
        self.runner = runner
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.cache = runner.new_paged_cache(num_blocks, block_size)
        self.tables = BlockTables(max_rows, max_blocks_per_row, num_blocks, runner.device)
        self.graphs = runner.paged_graphs(self.cache, max_rows, max_tokens)
        self.policies = BoundPolicies(bank, runner.device)
        self.masks = MaskBuffers()  # host bitmasks of constrained rows (`grammar.py`)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def warm_up(self, batch_sizes=None) -> int:
        """Capture the step graphs now (`PagedDecodeGraphs.capture_all`); 0 without graphs."""
        if self.graphs is None:
            return 0
        return self.graphs.capture_all(self.tables.upload(), batch_sizes)

    def forward(self, inputs: StepInputs, previous: LaunchedStep | None = None):
        """Queue the step's forward (`previous`: the step in flight, whose tokens some decode rows
        take as input). Returns `[chunks, V]` logits and `[chunks, H]` hidden states at each chunk's
        last token (graph buffers: valid until the next step runs)."""
        self.tables.write(inputs.table_writes)  # first: the engine counts these cells as written
        if self.graphs is not None and self.graphs.grid != self.runner.context.grid:
            # `model.reconfigure(grid=...)` since the capture: the old graphs run the old kernels.
            self.graphs = self.runner.paged_graphs(self.cache, self.max_rows, self.max_tokens)
        pending = None if previous is None else previous.pending_for(inputs)
        return self.runner.run_paged_step(self.cache, inputs, self.tables.upload(), self.graphs, pending)

    def pick(self, picks: Picks, logits: torch.Tensor, hidden: torch.Tensor) -> LaunchedStep:
        """Queue the step's picks (`launched.launch_picks`) with its constrained rows' bitmasks
        applied first."""
        mask = None
        if picks.constrained_rows:
            def mask(values):
                apply_masks(values, picks.constraints, picks.constrained_rows, self.masks)
        return launch_picks(picks, logits, hidden, self.policies, mask)
