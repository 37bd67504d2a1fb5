"""One engine step as tensors, run through the model's shared step machinery.

Per scheduled token: its id, its position in its request, its LoRA slot (the request's adapter while
the request holds it: prefill always, decode forward d while d is before the release step, -1
after), and its flat position in the paged KV pool. The StepTrim decision for a decode forward is
taken here, once per request and step, before the forward that it concerns.

Two kinds of step, each run by the forward `generate()` also uses:
- decode-only (every request computes one token): `LoRazorModel.decode_step`, the step `generate()`
  decodes with; on the GPU replayed from a CUDA graph per batch bucket (`graphs.py`);
- with prefill chunks: the packed forward `generate()` prefills with (`packed_forward`); on the GPU
  padded to a token bucket and replayed from a CUDA graph (`mixed_graphs.py`).
On the CPU both run eagerly. Block tables live in one persistent device table, one row per running request, rewritten only
where a request gained blocks, so a step uploads a few small arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .paged import PAGED_KWARG, PagedKVCache, PagedStep
from .scheduler import Chunk


def decide_release(chunk: Chunk) -> None:
    """StepTrim for the decode forwards in this chunk, each decided once, before it runs (a recomputed
    request replays its decisions): a fixed length k keeps the adapter while d < k; a learned head
    keeps it while w . h + b >= tau on the final hidden state of the forward before (evaluated on
    the device in that step, `LoRazorEngine._read_step`)."""
    request = chunk.request
    if request.adapter is None or request.release_step >= 0:
        return
    first_decode = len(request.prompt)
    for position in range(max(chunk.start, first_decode), chunk.start + chunk.num_tokens):
        d = position - first_decode
        if d < request.decided:
            continue
        request.decided = d + 1
        if request.release_k is not None:
            release = d >= request.release_k
        elif request.head is not None:
            release = not request.next_keep
        else:
            release = False
        if release:
            request.release_step = d
            return


class BlockTables:
    """Block tables of the running requests: a host copy and a device copy `[rows + 1, width]`
    (the last row: the scratch block only, for graph padding rows)."""

    def __init__(self, max_rows: int, width: int, scratch_block: int, device):
        self.host = np.full((max_rows + 1, width), scratch_block, dtype=np.int32)
        self.device = torch.from_numpy(self.host).to(device)
        self.scratch_row = max_rows
        self._free = list(range(max_rows - 1, -1, -1))
        self._dirty = False

    def row_of(self, request) -> int:
        """The request's row, brought up to date with its block table (assigned on first use)."""
        if request.table_row is None:
            request.table_row = self._free.pop()
            request.table_synced = 0
        table = request.block_table
        if request.table_synced != len(table):
            self.host[request.table_row, request.table_synced:len(table)] = table[request.table_synced:]
            request.table_synced = len(table)
            self._dirty = True
        return request.table_row

    def release(self, request) -> None:
        """Free the request's row. Its stale contents stay: only rows of scheduled requests are
        read, and a row is rewritten from block 0 when it is assigned again."""
        if request.table_row is not None:
            self._free.append(request.table_row)
            request.table_row = None

    def upload(self) -> torch.Tensor:
        if self._dirty:
            self.device.copy_(torch.from_numpy(self.host))
            self._dirty = False
        return self.device


@dataclass
class StepInputs:
    """Host view of one step: per token id, position, slot, flat pool position; per chunk its table
    row, first position, token count and packed index of its last token; distinct adapters."""

    ids: list[int]
    positions: list[int]
    slots: list[int]
    slot_mapping: list[int]
    chunks: list[tuple[int, int, int]]
    last: list[int]
    num_adapters: int

    @property
    def decode_only(self) -> bool:
        return len(self.ids) == len(self.chunks)


def prepare(model, cache: PagedKVCache, tables: BlockTables, chunks: list[Chunk]) -> StepInputs:
    ids, positions, names, pool_positions, rows, last = [], [], [], [], [], []
    page = cache.block_size
    for chunk in chunks:
        request = chunk.request
        decide_release(chunk)
        row = tables.row_of(request)
        table, start = request.block_table, chunk.start
        # Plain Python on purpose: a step has up to max_num_batched_tokens tokens, and per-chunk
        # tensor or numpy calls cost more than these loops. Decode tokens (one per chunk, most
        # chunks) skip the loops.
        if chunk.num_tokens == 1:
            pool_positions.append(table[start // page] * page + start % page)
            ids.append(request.tokens[start])
            positions.append(start)
            names.append(request.adapter if request.uses_adapter_at(start) else None)
        else:
            span = range(start, start + chunk.num_tokens)
            pool_positions.extend(table[p // page] * page + p % page for p in span)
            ids.extend(request.tokens[start:start + chunk.num_tokens])
            positions.extend(span)
            names.extend(request.adapter if request.uses_adapter_at(p) else None for p in span)
        rows.append((row, start, chunk.num_tokens))
        last.append(len(ids) - 1)
    # Loads the step's adapters that are not in GPU slots (before the forward that reads them).
    distinct = [n for n in dict.fromkeys(names) if n is not None]
    model.registry.make_resident(distinct)
    slot_of = model.bank.slot_of
    slots = [-1 if n is None else slot_of[n] for n in names]
    return StepInputs(ids, positions, slots, pool_positions, rows, last, len(distinct))


def packed_forward(model, cache: PagedKVCache, ids, positions, token_slot, last, logits_out=None):
    """The packed forward `generate()` prefills with (`_decoder_forward`), over the paged pool
    (`cache.step` set): returns (logits, hidden) at the packed indices `last`."""
    hidden = model._decoder_forward(ids[None], positions[None], cache.packed_mask(ids.shape[0]), cache, token_slot,
                                    1, **{PAGED_KWARG: cache})
    with torch.inference_mode():
        hidden = hidden[0].index_select(0, last)
        return model._head(hidden, logits_out), hidden


def run_step(model, cache: PagedKVCache, tables: BlockTables, chunks: list[Chunk], graphs=None):
    """Forward the scheduled chunks; returns `[len(chunks), V]` logits and `[len(chunks), H]` final
    hidden states at each chunk's last token (views of static buffers after a graph replay: read
    them before the next step)."""
    device = model.device
    inputs = prepare(model, cache, tables, chunks)
    # The host knows how many distinct adapters the step uses: no sync to bound the exact grid.
    model.context.set_distinct(inputs.num_adapters)
    block_tables = tables.upload()
    if graphs is not None:
        if inputs.decode_only and graphs.serves(len(chunks)):
            return graphs.run(inputs, block_tables)
        if not inputs.decode_only and graphs.mixed.serves(len(inputs.ids)):
            return graphs.mixed.run(inputs, block_tables)
    slot_mapping = torch.tensor(inputs.slot_mapping, dtype=torch.long, device=device)
    step = PagedStep.build(cache, inputs.chunks, slot_mapping, block_tables, device)
    cache.step = step
    ids = torch.tensor(inputs.ids, dtype=torch.long, device=device)
    positions = torch.tensor(inputs.positions, dtype=torch.long, device=device)
    token_slot = torch.tensor(inputs.slots, dtype=torch.int32, device=device)
    try:
        if inputs.decode_only:
            # The decode step `generate()` runs: one token per row.
            hidden, logits = model.decode_step(ids, positions, step.slot_mapping, cache, token_slot)
            return logits, hidden
        last = torch.tensor(inputs.last, dtype=torch.long, device=device)
        return packed_forward(model, cache, ids, positions, token_slot, last)
    finally:
        cache.step = None
