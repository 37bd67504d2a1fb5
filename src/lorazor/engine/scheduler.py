"""Which requests run this step, and how many of their tokens (iteration-level scheduling).

Every step:
1. Running requests first, oldest first: a decoding request needs one token, a request whose prompt
   is still being prefilled gets the next chunk, all within the token budget
   (`max_num_batched_tokens`).
2. When the KV pool cannot hold a running request's tokens, the newest running request is
   preempted: its blocks are freed and it goes back to the front of the queue, to be recomputed
   later. Nothing is dropped.
3. With budget left, waiting requests are admitted first come, first served, while the sequence
   budget (`max_num_seqs`) and the pool allow. A request admitted takes the longest chain of its
   full blocks the prefix cache holds (`blocks.py`) and computes only the rest; at least its last
   token is computed, so its first sampled token has logits. A request whose adapter would need a GPU slot that
   running requests hold (`max_adapters` distinct adapters) waits at the front of the queue
   without blocking later requests whose adapters are already running. A prompt longer than the
   budget is prefilled in chunks over several steps.
4. With async scheduling a step is scheduled while the one before is still on the GPU: a running
   request whose tokens there reach its `max_new_tokens` gets no more, and where the pool would need
   a preemption the engine first reads that step back (`schedule(preempt=False)` returns None).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from ..adapters.read_ahead import READ_AHEAD
from .blocks import BlockPool, block_hashes
from .outputs import postprocess
from .request import Request, RequestOutput, Status


@dataclass
class Chunk:
    """`num_tokens` of `request`'s tokens from position `start`, computed in this step."""

    request: Request
    start: int
    num_tokens: int


class Scheduler:
    """FCFS admission under a token budget and a sequence budget, chunked prefill, preemption."""

    def __init__(self, pool: BlockPool, max_num_seqs: int, max_num_batched_tokens: int, max_adapters: int,
                 on_free=None, adapter_ready=None):
        """`on_free(request)`: called when a request leaves the running set (finished, aborted or
        preempted) with its blocks freed, so per-running-request state (a block-table row) goes too.
        `adapter_ready(name, read)`: whether an adapter loads without a disk read now (else, with
        `read`, its read starts on a host thread: `AdapterRegistry.host_ready`); its requests wait."""
        self.pool = pool
        self.adapter_ready = adapter_ready or (lambda name, read: True)
        self.on_free = on_free or (lambda request: None)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_adapters = max_adapters
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.finished: list[Request] = []  # finished since the engine last took them (`take_finished`)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def finish(self, request: Request, reason: str) -> None:
        """End a request ("stop", "length", "abort", "error", ...): out of the queues, its blocks
        freed, its status and finish reason set; the engine takes it from `finished`."""
        self.remove(request)
        request.status = Status.FINISHED
        request.finish_reason = reason
        request.finish_time = time.monotonic()
        self.finished.append(request)

    def take_finished(self) -> list[Request]:
        """The requests finished since the last call (the engine forgets them and releases their
        adapters)."""
        finished, self.finished = self.finished, []
        return finished

    def update_from_output(self, step) -> list[RequestOutput]:
        """A launched step read back (`outputs.postprocess`): each request's token appended and its
        stop checks run; those that stop are finished here. Returns an output per request that got a
        token or finished."""
        return postprocess(step, self.finish)

    def remove(self, request: Request) -> None:
        """Take a request out (finished or aborted) and free its blocks (its full ones stay cached)."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._release_blocks(request)
        self.on_free(request)

    def _release_blocks(self, request: Request) -> None:
        self.cache_blocks(request)
        self.pool.free(request.block_table)
        request.blocks_cached = 0

    def cache_blocks(self, request: Request) -> None:
        """Put the request's full blocks whose KV is computed (or queued) and whose identity is
        known into the prefix cache (cheap when no block filled since the last call)."""
        if not self.pool.enable_caching:
            return
        size = self.pool.block_size
        full = min(request.num_computed, request.cacheable_len) // size
        if full <= request.blocks_cached:
            return
        hashes = block_hashes(request.block_hashes, request.tokens, size, request.cache_identity, full)
        for i in range(request.blocks_cached, full):
            self.pool.cache(request.block_table[i], hashes[i])
        request.blocks_cached = full

    def _cache_hits(self, request: Request) -> list[int]:
        """The cached blocks a request being admitted can start from (none once it computed some)."""
        if not self.pool.enable_caching or request.num_computed:
            return []
        size = self.pool.block_size
        # At least one token is computed: the step must give the request logits to sample from.
        usable = min(request.num_tokens - 1, request.cacheable_len) // size
        return self.pool.lookup(block_hashes(request.block_hashes, request.tokens, size, request.cache_identity,
                                             usable)[:usable])

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._release_blocks(request)
        self.on_free(request)
        request.num_computed = 0
        request.status = Status.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def schedule(self, preempt: bool = True) -> list[Chunk] | None:
        """The step's chunks. With `preempt=False` (a step is in flight, whose tokens the running
        requests still wait for) returns None instead of preempting; the caller reads that step
        back and schedules again."""
        budget = self.max_num_batched_tokens
        chunks: list[Chunk] = []
        preempted = set()
        for request in list(self.running):
            if budget == 0:
                break
            if request in preempted:
                continue  # preempted below for an older request
            if request.has_all_tokens:
                continue  # its last token is on the device: it finishes when that step is read back
            n = min(request.num_tokens - request.num_computed, budget)
            while not self.pool.grow(request.block_table, request.num_computed + n):
                if not preempt:
                    return None
                victim = self.running[-1]
                self._preempt(victim)
                preempted.add(victim)
                if victim is request:
                    break
            if request not in preempted:
                chunks.append(Chunk(request, request.num_computed, n))
                budget -= n
        # Slots held by running requests (one that released its adapter holds none): counted only
        # when some request waits, not on every decode step.
        adapters = {r.adapter for r in self.running if r.holds_adapter} if self.waiting else set()
        skipped = []  # waiting requests whose adapter is on disk, or needs a slot that running requests hold
        cold = 0  # of them, those on disk: the first READ_AHEAD start their reads
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.popleft()
            if request.adapter is not None and not self.adapter_ready(request.adapter, cold < READ_AHEAD):
                # Its folder is being read on a host thread: the steps go on without it meanwhile.
                cold += 1
                skipped.append(request)
                continue
            if request.adapter is not None and request.adapter not in adapters and len(adapters) >= self.max_adapters:
                # It waits for a slot without blocking later requests whose adapters are in use;
                # it keeps its place at the front, so it is admitted first once a slot frees.
                skipped.append(request)
                continue
            hits = self._cache_hits(request)
            start = max(request.num_computed, len(hits) * self.pool.block_size)
            n = min(request.num_tokens - start, budget)
            if not self.pool.allocate(request.block_table, hits, start + n):
                self.waiting.appendleft(request)
                break
            request.num_computed = start
            request.blocks_cached = len(hits)
            if request.num_cached_tokens is None:  # its first admission (not a preempted one's return)
                request.num_cached_tokens = start
                self.pool.queries += request.num_tokens
                self.pool.hits += start
            request.status = Status.RUNNING
            self.running.append(request)
            if request.adapter is not None:
                adapters.add(request.adapter)
            chunks.append(Chunk(request, request.num_computed, n))
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return chunks
