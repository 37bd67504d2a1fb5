"""CUDA graphs for the engine's decode-only steps.

A decode-only step (every scheduled request computes one token) is `LoRazorModel.decode_step`, the
step `generate()` replays, over the paged cache. It is captured once per (batch bucket, whether any
row has LoRA, class of the number of distinct adapters) and replayed for any requests: tokens,
positions, pool positions, adapter slots and block-table rows are copied into the bucket's static
buffers, block tables are one persistent device table, and the attention loops to each row's length
read on the device. Requests joining and leaving never trigger a recapture; padding rows of a bucket
write and read only the pool's scratch block.

Steps with prefill chunks replay graphs per token bucket (`mixed_graphs.py`), from the same pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..graphs import batch_bucket
from .mixed_graphs import MixedStepGraphs
from .paged import PagedKVCache, PagedStep
from .step_graphs import StepGraphs


@dataclass
class _Bucket:
    inputs: torch.Tensor  # [5, B] int64 staging: tokens, positions, pool positions, slots, table rows
    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    row_slot: torch.Tensor
    step: PagedStep
    hidden: torch.Tensor
    logits: torch.Tensor
    graphs: dict = field(default_factory=dict)


class PagedDecodeGraphs(StepGraphs):
    """Lazily captured step graphs of one engine: decode-only steps here, packed steps in `mixed`.

    Args:
        model: the `LoRazorModel`.
        cache: the engine's `PagedKVCache`.
        max_batch: the most requests a step can hold (`max_num_seqs`).
        max_tokens: the most tokens a step can hold (`max_num_batched_tokens`).
    """

    def __init__(self, model, cache: PagedKVCache, max_batch: int, max_tokens: int):
        super().__init__(model, cache, torch.cuda.graph_pool_handle())
        self.grid = model.context.grid  # graphs hold this grid's kernels: a new grid needs new graphs
        self.max_bucket = batch_bucket(max_batch)
        self.mixed = MixedStepGraphs(model, cache, max_tokens, max_batch, self.pool)

    @property
    def num_captures(self) -> int:
        return self.captured + self.mixed.captured

    @property
    def capture_seconds(self) -> float:
        return self.capture_time + self.mixed.capture_time

    def serves(self, batch: int) -> bool:
        return batch_bucket(batch) <= self.max_bucket

    def _bucket(self, size: int, block_tables: torch.Tensor) -> _Bucket:
        if size not in self.buckets:
            device = self.model.device
            inputs = torch.zeros(5, size, dtype=torch.long, device=device)
            ints = lambda: torch.zeros(size, dtype=torch.int32, device=device)  # noqa: E731
            rows, q_index, pos, ones = ints(), torch.arange(size, dtype=torch.int32, device=device), ints(), ints() + 1
            empty = tuple(torch.zeros(0, dtype=torch.int32, device=device) for _ in range(4))
            slot_mapping = torch.zeros(size, dtype=torch.long, device=device)
            step = PagedStep(slot_mapping, block_tables, (rows, q_index, pos, ones), empty, self.cache.block_q)
            hidden, logits = self.model.new_step_outputs(size)
            self.buckets[size] = _Bucket(inputs, torch.zeros(size, dtype=torch.long, device=device),
                                         torch.zeros(size, dtype=torch.long, device=device), slot_mapping, ints(),
                                         step, hidden, logits)
        return self.buckets[size]

    def run(self, inputs, block_tables: torch.Tensor):
        """Replay the step for `inputs` (a decode-only `runner.StepInputs`); returns (logits `[n, V]`,
        hidden `[n, H]`), views of the bucket's static outputs."""
        n = len(inputs.ids)
        bucket = self._bucket(batch_bucket(n), block_tables)
        self._fill(bucket, inputs)
        self._replay(bucket)
        return bucket.logits[:n], bucket.hidden[:n]

    def _fill(self, bucket: _Bucket, inputs) -> None:
        """Copy a step's inputs into the bucket's static buffers (one upload); rows past the step's
        requests are padding: token 0 at position 0, writing and reading the scratch block."""
        size = bucket.tokens.shape[0]
        n = 0 if inputs is None else len(inputs.ids)
        host = np.empty((5, size), dtype=np.int64)
        host[:, n:] = np.array([[0], [0], [self.cache.scratch_block * self.cache.block_size], [-1],
                                [bucket.step.block_tables.shape[0] - 1]])
        if inputs is not None:
            host[0, :n] = inputs.ids
            host[1, :n] = inputs.positions
            host[2, :n] = inputs.slot_mapping
            host[3, :n] = inputs.slots
            host[4, :n] = [row for row, _, _ in inputs.chunks]
        bucket.inputs.copy_(torch.from_numpy(host))
        rows, _, pos, _ = bucket.step.decode_tiles
        for target, source in ((bucket.tokens, 0), (bucket.positions, 1), (bucket.slot_mapping, 2),
                               (bucket.row_slot, 3), (rows, 4), (pos, 1)):
            target.copy_(bucket.inputs[source])

    def capture_all(self, block_tables: torch.Tensor, batch_sizes=None) -> int:
        """Capture every graph a step can need up front (each batch bucket up to `max_num_seqs`, or
        those of `batch_sizes`, and each token bucket of packed steps; each class of distinct
        adapters, and backbone only), so serving never captures. Returns how many were captured."""
        context = self.model.context
        saved = context.enabled, context.slot_bound
        sizes = sorted({batch_bucket(b) for b in (batch_sizes or range(1, self.max_bucket + 1))})
        keys = [(True, bound) for bound in context.slot_bound_classes()] + [(False, None)]
        before = self.num_captures
        try:
            self.capture_sizes(sizes, block_tables, keys)
            self.mixed.capture_sizes(self.mixed.bucket_sizes(), block_tables, keys)
        finally:
            context.enabled, context.slot_bound = saved
        return self.num_captures - before

    def _step_function(self, bucket: _Bucket):
        def step():
            # Writes the same pool positions on every run: the warm-ups leave what one replay would.
            self.cache.step = bucket.step
            try:
                hidden, _ = self.model.decode_step(bucket.tokens, bucket.positions, bucket.slot_mapping, self.cache,
                                                   bucket.row_slot, logits_out=bucket.logits)
                bucket.hidden.copy_(hidden)
            finally:
                self.cache.step = None

        return step

    def num_graphs(self) -> int:
        return sum(len(b.graphs) for b in list(self.buckets.values()) + list(self.mixed.buckets.values()))
