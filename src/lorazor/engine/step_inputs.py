"""One engine step as host lists, ready for the runner (`ModelRunner.run_paged_step`).

Per scheduled token: its id, its position in its request, its LoRA slot (the request's adapter while
the request holds it: prefill always, decode forward d while d is before the release step, -1
after), and its flat position in the paged KV pool. Block tables live in one persistent device
table, one row per running request, rewritten only where a request gained blocks, so a step uploads
a few small arrays.

StepTrim: the decision for decode forward d is taken on the device at the end of the step that ran
forward d - 1 (`runner/release.py`, the same `policy.keep` `generate()` calls) and recorded on the
request when that step is read back (`Request.record_decision`); a forward's slot follows it here.

With async scheduling a step is prepared before the step in flight is read back, so a decode row's
input token (and the decision for its forward) may still be on the device: such a token is listed
in `StepInputs.pending`, prepared as the adapter's slot, and filled in on the device from the step
in flight (`ModelRunner.run_paged_step`'s `pending`).
"""

from __future__ import annotations

from dataclasses import dataclass, field


from ..runner import BlockTables
from .scheduler import Chunk


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
    # (token index, request) of each token still on the device: the output of the step in flight.
    pending: list = field(default_factory=list)

    @property
    def decode_only(self) -> bool:
        return len(self.ids) == len(self.chunks)


def prepare(registry, block_size: int, tables: BlockTables, chunks: list[Chunk]) -> StepInputs:
    """The step's host lists. Its adapters are in GPU slots already (the engine's load phase)."""
    ids, positions, names, pool_positions, rows, last, pending = [], [], [], [], [], [], []
    page = block_size
    for chunk in chunks:
        request = chunk.request
        row = tables.row_of(request)
        table, start = request.block_table, chunk.start
        # Plain Python on purpose: a step has up to max_num_batched_tokens tokens, and per-chunk
        # tensor or numpy calls cost more than these loops. Decode tokens (one per chunk, most
        # chunks) skip the loops.
        if chunk.num_tokens == 1:
            pool_positions.append(table[start // page] * page + start % page)
            if start < len(request.tokens):
                ids.append(request.tokens[start])
            else:  # the output of the step in flight
                pending.append((len(ids), request))
                ids.append(0)
            positions.append(start)
            names.append(request.adapter if request.uses_adapter_at(start) else None)
        else:
            end = start + chunk.num_tokens
            position = start
            while position < end:  # block by block: a run of consecutive pool positions each
                run = min(end, (position // page + 1) * page) - position
                first = table[position // page] * page + position % page
                pool_positions.extend(range(first, first + run))
                position += run
            ids.extend(request.tokens[start:end])
            positions.extend(range(start, end))
            # Prompt positions always use the adapter; only recomputed decode positions (after a
            # preemption) depend on the release step.
            prompt_part = max(0, min(end, len(request.prompt)) - start)
            names.extend([request.adapter] * prompt_part)
            recomputed = range(start + prompt_part, end)
            names.extend(request.adapter if request.uses_adapter_at(p) else None for p in recomputed)
        rows.append((row, start, chunk.num_tokens))
        last.append(len(ids) - 1)
    distinct = [n for n in dict.fromkeys(names) if n is not None]
    slot_of = registry.bank.slot_of
    slots = [-1 if n is None else slot_of[n] for n in names]
    return StepInputs(ids, positions, slots, pool_positions, rows, last, len(distinct), pending)
