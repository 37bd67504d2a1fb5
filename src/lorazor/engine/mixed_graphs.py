"""CUDA graphs for the engine's steps with prefill chunks (full graphs, per token bucket).

Eagerly, a step that packs prefill chunks beside decode rows is bound by the host: measured on the
H200 (Llama-3.2-3B shape, ~1,500 tokens), about 25 ms of GPU work behind about 70 ms of Python and
launches, plus a Triton compile whenever a new token count picks new launch constants. Here the
packed step is padded to a token bucket (multiples of `TOKEN_BUCKET`) and captured once per
(bucket, whether any token has LoRA, class of the number of distinct adapters). Everything that
varies is data in static buffers: token ids, positions, pool positions, adapter slots, the
attention tiles (padded with empty tiles), and the packed index of each request's last token.

Padding tokens compute nothing anyone reads: they use no adapter, write their keys and values to the
scratch block, and their attention output is zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from .paged import PagedKVCache, PagedStep, tile_columns
from .runner import packed_forward
from .step_graphs import StepGraphs

TOKEN_BUCKET = 256


def token_bucket(num_tokens: int) -> int:
    return -(-num_tokens // TOKEN_BUCKET) * TOKEN_BUCKET


@dataclass
class _Bucket:
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


class MixedStepGraphs(StepGraphs):
    """Graphs of packed steps up to `max_tokens` tokens and `max_rows` requests.

    Args:
        model: the `LoRazorModel`. cache: the engine's `PagedKVCache`.
        max_tokens: `max_num_batched_tokens`. max_rows: `max_num_seqs`.
        pool: the CUDA graph memory pool shared with the decode graphs.
        capture: False runs the same padded step eagerly instead of replaying a graph (the CPU tests
            check the padding with it).
    """

    def __init__(self, model, cache: PagedKVCache, max_tokens: int, max_rows: int, pool, capture: bool = True):
        super().__init__(model, cache, pool, capture)
        self.max_bucket = token_bucket(max_tokens)
        self.max_rows = max_rows

    def serves(self, num_tokens: int) -> bool:
        return token_bucket(num_tokens) <= self.max_bucket

    def bucket_sizes(self) -> list[int]:
        return list(range(TOKEN_BUCKET, self.max_bucket + 1, TOKEN_BUCKET))

    def _bucket(self, tokens: int, block_tables: torch.Tensor) -> _Bucket:
        if tokens not in self.buckets:
            device = self.model.device
            decode_cap = min(self.max_rows, tokens)
            prefill_cap = tokens // self.cache.block_q + min(self.max_rows, tokens)
            staging = torch.zeros(4 * tokens + 4 * (decode_cap + prefill_cap) + self.max_rows, dtype=torch.long,
                                  device=device)
            ints = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
            decode = tuple(ints(decode_cap) for _ in range(4))
            prefill = tuple(ints(prefill_cap) for _ in range(4))
            slot_mapping = torch.zeros(tokens, dtype=torch.long, device=device)
            step = PagedStep(slot_mapping, block_tables, decode, prefill, self.cache.block_q, zero_fill=True)
            self.buckets[tokens] = _Bucket(tokens, decode_cap, prefill_cap, staging,
                                           torch.zeros(tokens, dtype=torch.long, device=device),
                                           torch.zeros(tokens, dtype=torch.long, device=device), slot_mapping,
                                           ints(tokens), torch.zeros(self.max_rows, dtype=torch.long, device=device),
                                           step)
        return self.buckets[tokens]

    def _fill(self, bucket: _Bucket, inputs) -> None:
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
        bucket.staging.copy_(torch.from_numpy(host))
        staged = bucket.staging[:4 * T].view(4, T)
        for target, source in zip((bucket.ids, bucket.positions, bucket.slot_mapping, bucket.token_slot), staged):
            target.copy_(source)
        offset = 4 * T
        for tiles, cap in ((bucket.step.decode_tiles, bucket.decode_cap), (bucket.step.prefill_tiles,
                                                                          bucket.prefill_cap)):
            for target, source in zip(tiles, bucket.staging[offset:offset + 4 * cap].view(4, cap)):
                target.copy_(source)
            offset += 4 * cap
        bucket.last.copy_(bucket.staging[offset:])

    def run(self, inputs, block_tables: torch.Tensor):
        """Replay the packed step for `inputs` (a `runner.StepInputs`); returns (logits, hidden) of
        each request's last token, views of static buffers."""
        bucket = self._bucket(token_bucket(len(inputs.ids)), block_tables)
        self._fill(bucket, inputs)
        self._replay(bucket)
        rows = len(inputs.last)
        return bucket.logits[:rows], bucket.hidden[:rows]

    def _step_function(self, bucket: _Bucket):
        """The step a graph of `bucket` holds: the shared packed forward on the bucket's buffers."""
        if bucket.logits is None:
            bucket.hidden, bucket.logits = self.model.new_step_outputs(self.max_rows)

        def step():
            self.cache.step = bucket.step
            try:
                _, hidden = packed_forward(self.model, self.cache, bucket.ids, bucket.positions, bucket.token_slot,
                                           bucket.last, logits_out=bucket.logits)
                bucket.hidden.copy_(hidden)
            finally:
                self.cache.step = None

        return step
