"""One engine step as host lists, ready for the runner's `PagedSteps`: its inputs and its picks.

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
in flight (`PagedSteps.forward`'s `previous`).
"""

from __future__ import annotations

from ..runner import Picks, StepInputs
from .request import Status
from .scheduler import Chunk


class TableRows:
    """Which row of the runner's block tables each running request has, and which of its blocks that
    row holds already: a step lists only the cells that changed (`StepInputs.table_writes`)."""

    def __init__(self, max_rows: int):
        self._free = list(range(max_rows - 1, -1, -1))

    def row_of(self, request, writes: list) -> int:
        """The request's row (assigned on first use); its new blocks appended to `writes`."""
        if request.table_row is None:
            request.table_row = self._free.pop()
            request.table_synced = 0
        table = request.block_table
        if request.table_synced != len(table):
            writes.append((request.table_row, request.table_synced, table[request.table_synced:]))
            request.table_synced = len(table)
        return request.table_row

    def release(self, request) -> None:
        """Free the request's row; it is rewritten from block 0 when it is assigned again."""
        if request.table_row is not None:
            self._free.append(request.table_row)
            request.table_row = None


def prepare(registry, block_size: int, tables: TableRows, chunks: list[Chunk]) -> StepInputs:
    """The step's host lists. Its adapters are in GPU slots already (the engine's load phase)."""
    ids, positions, names, pool_positions, rows, last, pending, writes = [], [], [], [], [], [], [], []
    page = block_size
    for chunk in chunks:
        request = chunk.request
        row = tables.row_of(request, writes)
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
    return StepInputs(ids, positions, slots, pool_positions, rows, last, len(distinct), pending, writes)


def picks_of(chunks: list[Chunk], slot_of: dict) -> Picks:
    """What the step's producing rows need picked (`runner.Picks`): each chunk that ends at its
    request's last known token produces one."""
    rows = [i for i, c in enumerate(chunks) if c.request.status is Status.RUNNING
            and c.start + c.num_tokens >= c.request.num_tokens]
    requests = [chunks[i].request for i in rows]
    greedy = [j for j, r in enumerate(requests) if r.plain_greedy]
    sampled = [j for j, r in enumerate(requests) if r.sampling is not None]
    # Grouped by policy (None: fixed lengths only); the forward decided is d = tokens generated so
    # far, those still on the device included.
    decisions: dict = {}
    for j, r in enumerate(requests):
        if r.needs_decisions:
            policy = None if r.release is not None else r.policy
            decisions.setdefault(policy, []).append((j, slot_of[r.adapter], len(r.output) + r.pending, r.release))
    return Picks(rows, requests, greedy, sampled, [requests[j].sampling for j in sampled], decisions)
