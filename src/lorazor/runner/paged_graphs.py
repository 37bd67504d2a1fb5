"""CUDA graphs of the engine's steps over the paged KV cache, on the runner's one graph base.

- Decode-only steps (every scheduled request computes one token) run the runner's `decode_step`,
  the step `generate()` replays, per batch bucket (`PagedDecodeGraphs`).
- Steps that pack prefill chunks beside decode rows run the runner's `packed_forward` padded to a
  token bucket (`PackedStepGraphs`). Eagerly such a step is bound by the host: measured on the H200
  (Llama-3.2-3B shape, ~1,500 tokens), about 25 ms of GPU work behind about 70 ms of Python and
  launches, plus a Triton compile whenever a new token count picks new launch constants.

Everything that varies is data in a bucket's static buffers: token ids, positions, pool positions,
adapter slots, block-table rows, attention tiles (padded with empty tiles) and the packed index of
each request's last token; block tables are one persistent device table. Requests joining and
leaving never trigger a recapture. Padding rows and tokens compute nothing anyone reads: they use
no adapter and write and read only the pool's scratch block (their attention output is zero).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from lorazor_kernels import fill_pending, slot_bound_class, warm_up_fill

from .graphs import TOKEN_BUCKET, StepGraphs, batch_bucket, token_bucket
from .paged_cache import PagedKVCache, PagedStep, tile_columns
from .uploads import upload_into

log = logging.getLogger("lorazor.engine")


class SharedOutputs:
    """One (hidden `[R, H]`, logits `[R, V]`) pair that every graph of an engine writes its step's
    outputs into (the first rows). A step's outputs are read, or what reads them is queued, before
    the next step runs, so the buckets need not hold a pair each: with a 128k vocabulary a logits
    row is 256 KB, and 35 decode buckets plus 16 token buckets (512 seats, 4,096 tokens) would hold
    over 4 GB of them."""

    def __init__(self, runner, rows: int):
        self.runner, self.rows = runner, rows
        self._pair = None

    def views(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n > self.rows:
            raise ValueError(f"{n} rows exceed the shared step outputs' {self.rows}")
        if self._pair is None:
            self._pair = self.runner.new_step_outputs(self.rows)
        logits, hidden = self._pair
        return logits[:n], hidden[:n]


def decode_bucket(batch: int) -> int:
    """The engine's decode-step buckets: `batch_bucket`'s, from 2 rows (a single row pads to two), so
    a compiled step (whose batch is dynamic, and torch.compile always specializes a size of 1) needs
    no compile of its own for one row."""
    return max(2, batch_bucket(batch))


def paged_step(cache: PagedKVCache, bucket, forward):
    """The step a graph of `bucket` holds: `forward()` (returning the final hidden states) with the
    bucket's attention metadata set on the cache, its hidden states into the bucket's buffer. It
    writes the same pool positions on every run: the warm-ups leave what one replay would."""
    def step():
        cache.step = bucket.step
        try:
            bucket.hidden.copy_(forward())
        finally:
            cache.step = None

    return step


def reachable_keys(context, rows: int) -> list[tuple]:
    """The graph keys a step of at most `rows` requests can have: backbone only, and each class of
    distinct adapters up to the class of `rows` (a bucket of 8 rows never sees 32 adapters)."""
    top = slot_bound_class(min(rows, context.num_slots), context.num_slots)
    bounds = [b for b in context.slot_bound_classes() if b is None or b <= top]
    return [(True, bound) for bound in bounds] + [(False, None)]


@dataclass
class PendingTokens:
    """A step's input tokens that are outputs of the step before, still on the device (the engine's
    async scheduling prepares a step before it reads the one in flight back).

    Attributes:
        index: `[3, k]` long: each such token's index in this step, the index of its token in
            `values`, and of the release decision for its forward (-1: none, it keeps its adapter).
        values: the step before's sampled tokens and release decisions (1: keep), long.
    """

    index: torch.Tensor
    values: torch.Tensor

    def fill(self, ids: torch.Tensor, slots: torch.Tensor) -> None:
        """Write the tokens into `ids` and drop the adapter (slot -1) of the forwards whose
        decision released it; `slots` was prepared as if every such forward kept it. One launch
        on a GPU (`lorazor_kernels.fill_pending`)."""
        fill_pending(ids, slots, self.index, self.values)


@dataclass
class _DecodeBucket:
    # The step's inputs, uploaded as two copies: [3, B] int64 (tokens, positions, pool positions) and
    # [3, B] int32 (slots, table rows, positions); the tensors below are their rows, so no copy kernel
    # runs between the upload and the graph.
    inputs: torch.Tensor
    inputs32: torch.Tensor
    tokens: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    row_slot: torch.Tensor
    step: PagedStep
    hidden: torch.Tensor
    logits: torch.Tensor
    graphs: dict = field(default_factory=dict)


@dataclass
class _PackedBucket:
    tokens: int
    decode_cap: int
    prefill_cap: int
    staging: torch.Tensor  # int64: ids, positions, pool positions, slots | tiles | last
    ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_slot: torch.Tensor
    last: torch.Tensor
    step: PagedStep
    hidden: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    graphs: dict = field(default_factory=dict)


class PackedStepGraphs(StepGraphs):
    """Graphs of packed steps up to `max_tokens` tokens and `max_rows` requests.

    Args:
        runner: the `ModelRunner`. cache: the engine's `PagedKVCache`.
        max_tokens: `max_num_batched_tokens`. max_rows: `max_num_seqs`.
        pool: the CUDA graph memory pool (shared with the decode graphs).
        capture: False runs the same padded step eagerly instead of replaying a graph.
    """

    def __init__(self, runner, cache: PagedKVCache, max_tokens: int, max_rows: int, pool=None, capture: bool = True,
                 outputs: SharedOutputs | None = None):
        super().__init__(runner, pool, capture)
        self.cache = cache
        self.max_bucket = token_bucket(max_tokens)
        self.max_rows = max_rows
        self.outputs = outputs or SharedOutputs(runner, max_rows)

    def serves(self, num_tokens: int) -> bool:
        return token_bucket(num_tokens) <= self.max_bucket

    def bucket_sizes(self) -> list[int]:
        return list(range(TOKEN_BUCKET, self.max_bucket + 1, TOKEN_BUCKET))

    def _bucket(self, tokens: int, block_tables: torch.Tensor) -> _PackedBucket:
        if tokens not in self.buckets:
            device = self.runner.device
            decode_cap = min(self.max_rows, tokens)
            prefill_cap = tokens // self.cache.block_q + min(self.max_rows, tokens)
            staging = torch.zeros(4 * tokens + 4 * (decode_cap + prefill_cap) + self.max_rows, dtype=torch.long,
                                  device=device)
            ints = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
            decode = tuple(ints(decode_cap) for _ in range(4))
            prefill = tuple(ints(prefill_cap) for _ in range(4))
            slot_mapping = torch.zeros(tokens, dtype=torch.long, device=device)
            step = PagedStep(slot_mapping, block_tables, decode, prefill, self.cache.block_q, zero_fill=True)
            self.buckets[tokens] = _PackedBucket(tokens, decode_cap, prefill_cap, staging,
                                                 torch.zeros(tokens, dtype=torch.long, device=device),
                                                 torch.zeros(tokens, dtype=torch.long, device=device), slot_mapping,
                                                 ints(tokens),
                                                 torch.zeros(self.max_rows, dtype=torch.long, device=device), step)
        return self.buckets[tokens]

    def _fill(self, bucket: _PackedBucket, inputs) -> None:
        """One upload of the step's inputs into the bucket's buffers (padding where the step ends)."""
        T, scratch_row = bucket.tokens, bucket.step.block_tables.shape[0] - 1
        host = np.zeros(bucket.staging.shape[0], dtype=np.int64)
        tok = host[:4 * T].reshape(4, T)
        tok[2] = self.cache.scratch_block * self.cache.block_size
        tok[3] = -1
        decode, prefill = tile_columns(inputs.chunks, self.cache.block_q) if inputs else (([],) * 4, ([],) * 4)
        offset = 4 * T
        for columns, cap in ((decode, bucket.decode_cap), (prefill, bucket.prefill_cap)):
            part = host[offset:offset + 4 * cap].reshape(4, cap)
            part[0] = scratch_row  # empty tiles (count 0) of the scratch row: programs that exit at once
            for i, column in enumerate(columns):
                part[i, :len(column)] = column
            offset += 4 * cap
        if inputs is not None:
            n = len(inputs.ids)
            tok[0, :n], tok[1, :n], tok[2, :n], tok[3, :n] = inputs.ids, inputs.positions, inputs.slot_mapping, \
                inputs.slots
            host[offset:offset + len(inputs.last)] = inputs.last
        upload_into(bucket.staging, host)
        staged = bucket.staging[:4 * T].view(4, T)
        for target, source in zip((bucket.ids, bucket.positions, bucket.slot_mapping, bucket.token_slot), staged):
            target.copy_(source)
        offset = 4 * T
        for tiles, cap in ((bucket.step.decode_tiles, bucket.decode_cap),
                           (bucket.step.prefill_tiles, bucket.prefill_cap)):
            for target, source in zip(tiles, bucket.staging[offset:offset + 4 * cap].view(4, cap)):
                target.copy_(source)
            offset += 4 * cap
        bucket.last.copy_(bucket.staging[offset:])

    def run(self, inputs, block_tables: torch.Tensor, pending: PendingTokens | None = None):
        """Replay the packed step for `inputs` (the engine's `StepInputs`; `pending`: its tokens still
        on the device); returns (logits, hidden) of each request's last token, views of the shared
        static outputs (valid until the next step runs)."""
        bucket = self._bucket(token_bucket(len(inputs.ids)), block_tables)
        self._fill(bucket, inputs)
        if pending is not None:
            pending.fill(bucket.ids, bucket.token_slot)
        self._replay(bucket)
        rows = len(inputs.last)
        return bucket.logits[:rows], bucket.hidden[:rows]

    def _step_function(self, bucket: _PackedBucket, key):
        """The step a graph of `bucket` holds: the runner's packed forward on the bucket's buffers."""
        if bucket.logits is None:
            bucket.logits, bucket.hidden = self.outputs.views(self.max_rows)

        # Token counts here are padded to buckets: the compiled step (if any) serves them all.
        return paged_step(self.cache, bucket, lambda: self.runner.packed_forward(
            self.cache, bucket.ids, bucket.positions, bucket.token_slot, bucket.last, logits_out=bucket.logits,
            compile=True)[1])


class PagedDecodeGraphs(StepGraphs):
    """Lazily captured step graphs of one engine: decode-only steps here, packed steps in `packed`.

    Args:
        runner: the `ModelRunner`.
        cache: the engine's `PagedKVCache`.
        max_batch: the most requests a step can hold (`max_num_seqs`).
        max_tokens: the most tokens a step can hold (`max_num_batched_tokens`).
        capture: False runs the same padded steps eagerly instead of replaying graphs (the CPU tests
            check the buckets with it).
    """

    def __init__(self, runner, cache: PagedKVCache, max_batch: int, max_tokens: int, capture: bool = True):
        super().__init__(runner, capture=capture)
        self.cache = cache
        self.grid = runner.context.grid  # graphs hold this grid's kernels: a new grid needs new graphs
        self.max_bucket = decode_bucket(max_batch)
        self.outputs = SharedOutputs(runner, max(self.max_bucket, max_batch))
        self.packed = PackedStepGraphs(runner, cache, max_tokens, max_batch, self.pool, capture=capture,
                                       outputs=self.outputs)

    @property
    def num_captures(self) -> int:
        return self.captured + self.packed.captured

    @property
    def total_capture_seconds(self) -> float:
        return self.capture_seconds + self.packed.capture_seconds

    def serves(self, batch: int) -> bool:
        return decode_bucket(batch) <= self.max_bucket

    def _bucket(self, size: int, block_tables: torch.Tensor) -> _DecodeBucket:
        if size not in self.buckets:
            device = self.runner.device
            inputs = torch.zeros(3, size, dtype=torch.long, device=device)
            inputs32 = torch.zeros(3, size, dtype=torch.int32, device=device)
            tokens, positions, slot_mapping = inputs
            row_slot, rows, pos = inputs32
            q_index = torch.arange(size, dtype=torch.int32, device=device)
            ones = torch.ones(size, dtype=torch.int32, device=device)
            empty = tuple(torch.zeros(0, dtype=torch.int32, device=device) for _ in range(4))
            step = PagedStep(slot_mapping, block_tables, (rows, q_index, pos, ones), empty, self.cache.block_q)
            logits, hidden = self.outputs.views(size)
            self.buckets[size] = _DecodeBucket(inputs, inputs32, tokens, positions, slot_mapping, row_slot, step,
                                               hidden, logits)
        return self.buckets[size]

    def run(self, inputs, block_tables: torch.Tensor, pending: PendingTokens | None = None):
        """Replay the step for `inputs` (a decode-only `StepInputs`; `pending`: its tokens still on
        the device); returns (logits `[n, V]`, hidden `[n, H]`), views of the shared static outputs
        (valid until the next step runs)."""
        n = len(inputs.ids)
        bucket = self._bucket(decode_bucket(n), block_tables)
        self._fill(bucket, inputs)
        if pending is not None:
            pending.fill(bucket.tokens, bucket.row_slot)
        self._replay(bucket)
        return bucket.logits[:n], bucket.hidden[:n]

    def _fill(self, bucket: _DecodeBucket, inputs) -> None:
        """Copy a step's inputs into the bucket's static buffers (one upload); rows past the step's
        requests are padding: token 0 at position 0, writing and reading the scratch block."""
        size = bucket.tokens.shape[0]
        n = 0 if inputs is None else len(inputs.ids)
        host = np.empty((3, size), dtype=np.int64)
        host32 = np.empty((3, size), dtype=np.int32)
        host[:, n:] = np.array([[0], [0], [self.cache.scratch_block * self.cache.block_size]])
        host32[:, n:] = np.array([[-1], [bucket.step.block_tables.shape[0] - 1], [0]])
        if inputs is not None:
            host[0, :n] = inputs.ids
            host[1, :n] = host32[2, :n] = inputs.positions
            host[2, :n] = inputs.slot_mapping
            host32[0, :n] = inputs.slots
            host32[1, :n] = [row for row, _, _ in inputs.chunks]
        upload_into(bucket.inputs, host)
        upload_into(bucket.inputs32, host32)

    def capture_all(self, block_tables: torch.Tensor, batch_sizes=None) -> int:
        """Capture every graph a step can need up front (each batch bucket up to `max_num_seqs`, or
        those of `batch_sizes`, and each token bucket of packed steps; each class of distinct
        adapters, and backbone only), so serving never captures. Returns how many were captured."""
        context = self.runner.context
        saved = context.enabled, context.slot_bound
        sizes = sorted({decode_bucket(b) for b in (batch_sizes or range(1, self.max_bucket + 1))})
        before, start = self.num_captures, time.perf_counter()
        packed = self.packed.bucket_sizes()

        def progress(kind: str, size: int, done: int) -> None:  # a cold compiled start takes minutes
            log.info("warm-up: %s %d captured (%d of %d buckets, %d graphs, %.0f s)", kind, size, done,
                     len(sizes) + len(packed), self.num_captures - before, time.perf_counter() - start)

        try:
            for i, size in enumerate(sizes):
                self.capture_sizes([size], reachable_keys(context, size), block_tables)
                progress("decode batch", size, i + 1)
            for i, size in enumerate(packed):
                self.packed.capture_sizes([size], reachable_keys(context, min(size, self.packed.max_rows)),
                                          block_tables)
                progress("packed tokens", size, len(sizes) + i + 1)
        finally:
            context.enabled, context.slot_bound = saved
        # The async steps' token fill runs before a graph, not in it: compiled now, not on the first request.
        warm_up_fill(self.runner.device)
        return self.num_captures - before

    def _step_function(self, bucket: _DecodeBucket, key):
        return paged_step(self.cache, bucket, lambda: self.runner.decode_step(
            bucket.tokens, bucket.positions, bucket.slot_mapping, self.cache, bucket.row_slot,
            logits_out=bucket.logits)[1])

    def num_graphs(self) -> int:
        return super().num_graphs() + self.packed.num_graphs()
