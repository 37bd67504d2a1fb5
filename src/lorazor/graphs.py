"""CUDA-graph capture and replay of the decode step, per batch bucket (and grid layout).

The captured step (`exact` and `full` grids) is: the StepTrim decision (the release policy on the
previous hidden states, applied one-way to the per-row release state), the LoRA step metadata from
the resulting row -> slot map, the KV-cache position writes, the decoder with the batched LoRA
layers, and the LM head on each row's last hidden state. Inputs, release state and policy tensors
live in static buffers; a replay serves any tokens, positions, adapter mix and policy parameters
without recapture. One graph per (bucket, policy class, class of the number of distinct adapters
in the batch: 16, 32, 64, ... up to the bank's slots, which bounds the exact grid's tile table).

The paper's grid modes (`active_rows`, `two_class`) fix their launch shape on the host: the release
decision and their metadata are computed outside the graph (one host sync per step) into static
buffers, and a graph is captured per (bucket, row bound R, class layout), as in the paper's
Algorithm 1. So is a custom policy that is not `graph_safe`.

All graphs share one memory pool. Each bucket owns a persistent KV cache of its size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from lorazor_kernels import LoRABatchMeta

from .kv_cache import KVCache
from .policies.base import ReleasePolicy, ReleaseState, release_step


def batch_bucket(batch_size: int) -> int:
    """Captured batch sizes: 1, 2, 4, 8, then multiples of 16 (pads at most 15 rows past 8)."""
    if batch_size <= 8:
        return 1 << (batch_size - 1).bit_length()
    return -(-batch_size // 16) * 16


def cache_bucket(length: int) -> int:
    """KV-cache lengths are multiples of 64, so nearby prompt + max_new_tokens share graphs."""
    return -(-length // 64) * 64


@dataclass
class _Bucket:
    cache: KVCache
    tokens: torch.Tensor
    positions: torch.Tensor
    write_pos: torch.Tensor
    row_slot: torch.Tensor  # the step's row -> slot map when it is decided outside the graph
    step_index: torch.Tensor  # 0-d decode step index, read by in-graph release decisions
    hidden_in: torch.Tensor | None = None  # the previous step's final hidden states
    state: ReleaseState | None = None  # static release state of the generate call in flight
    policy_tensors: dict = field(default_factory=dict)  # policy class -> static copies of `bound`
    graphs: dict = field(default_factory=dict)  # key -> (graph, step slot, static meta)
    # Every graph of the bucket writes its outputs here, so a bucket holds one `[B, V]` logits
    # buffer, not one per graph (~66 MB each for Llama-3.2-3B at batch 256).
    hidden_out: torch.Tensor | None = None
    logits_out: torch.Tensor | None = None


def capture_graph(step, pool, measure_memory: bool = True):
    """Capture `step()` (no arguments) as a CUDA graph in memory pool `pool`, after two warm-up runs
    on a side stream (Triton compiles, cuBLAS picks algorithms). The step must be idempotent for its
    inputs: the warm-ups run it for real. Returns (graph, what the captured call returned, seconds,
    bytes the capture reserved: measured only with `measure_memory`, which empties the allocator's
    cache first and costs time per capture)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if measure_memory:
        # Release what the warm-up cached, so the reserved-memory delta is the graph's own pool.
        torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        result = step()
    end.record()
    end.synchronize()
    nbytes = torch.cuda.memory_reserved() - reserved if measure_memory else 0
    return graph, result, start.elapsed_time(end) / 1e3, nbytes


class DecodeGraphs:
    """Lazily captured decode-step graphs of one `LoRazorModel`.

    Args:
        model: the `LoRazorModel` whose `decode_step` is captured.
    """

    def __init__(self, model):
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.capture_seconds = 0.0  # every capture of this model, cumulative
        self.capture_bytes = 0  # GPU memory the live graphs reserved (reset by `clear`)

    def cache(self, batch_size: int, max_len: int, device: torch.device) -> KVCache:
        """The persistent KV cache of the (batch, length) bucket; prefill writes into it eagerly."""
        key = (batch_size, max_len)
        if key not in self.buckets:
            cache = self.model.new_cache(batch_size, max_len, device)
            zeros = lambda dtype: torch.zeros(batch_size, dtype=dtype, device=device)  # noqa: E731
            self.buckets[key] = _Bucket(cache, zeros(torch.long), zeros(torch.long), zeros(torch.long),
                                        zeros(torch.int32), torch.zeros((), dtype=torch.long, device=device))
        return self.buckets[key].cache

    def begin_call(self, cache: KVCache, state: ReleaseState, policy: ReleasePolicy | None) -> ReleaseState:
        """Load a generate call's release state and bound policy tensors into the bucket's static
        buffers (once per call); returns the static state the decode loop must use from then on."""
        bucket = self.buckets[(cache.batch_size, cache.max_len)]
        if bucket.state is None:
            bucket.state = state.clone()
        else:
            bucket.state.copy_(state)
        if policy is not None and self._in_graph(policy):
            static = bucket.policy_tensors.get(type(policy))
            if static is None or static.keys() != policy.bound.keys() or any(
                    static[k].shape != v.shape for k, v in policy.bound.items()):
                if static is not None:  # a new shape: the old graphs read the old buffers
                    bucket.graphs = {k: v for k, v in bucket.graphs.items() if k[1:2] != (type(policy),)}
                bucket.policy_tensors[type(policy)] = {k: v.clone() for k, v in policy.bound.items()}
            else:
                for k, v in policy.bound.items():
                    static[k].copy_(v)
        return bucket.state

    def _in_graph(self, policy: ReleasePolicy | None) -> bool:
        """Whether the release decision of a step is captured (device-built metadata, safe policy)."""
        return self.model.context.meta_on_device and (policy is None or policy.graph_safe)

    def _layout(self, row_slot: torch.Tensor):
        """Graph key and host-built metadata of a step whose slot map was decided outside the graph."""
        context = self.model.context
        if not context.enabled:
            return ("backbone",), None
        if context.meta_on_device:
            return ("device, eager release", context.slot_bound), None
        meta = context.build(row_slot)
        return (meta.row_bound, meta.class_split, meta.has_lora), meta

    def _capture(self, bucket: _Bucket, meta: LoRABatchMeta | None, policy, decide: bool):
        if bucket.logits_out is None:
            # Allocated outside the graph pool and counted once as graph memory.
            before = torch.cuda.memory_allocated()
            bucket.hidden_out, bucket.logits_out = self.model.new_step_outputs(bucket.tokens.shape[0])
            self.capture_bytes += torch.cuda.memory_allocated() - before
        static_meta = None
        if meta is not None:
            # Static copies whose contents are refreshed before every replay of this layout.
            static_meta = LoRABatchMeta(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                           for k, v in meta.__dict__.items()})

        def step():
            # Replays are idempotent for one step's inputs (release is one-way, cache writes repeat),
            # so the warm-up runs below leave the same state as a single replay would.
            row_slot = (release_step(policy, bucket.step_index, bucket.hidden_in, bucket.state,
                                     compiled=self.model.config.compile) if decide else bucket.row_slot)
            hidden, _ = self.model.decode_step(bucket.tokens, bucket.positions, bucket.write_pos,
                                               bucket.cache, row_slot, meta=static_meta,
                                               logits_out=bucket.logits_out)
            bucket.hidden_out.copy_(hidden)
            return row_slot

        saved = None
        if decide and policy is not None:
            saved, policy.bound = policy.bound, bucket.policy_tensors[type(policy)]
        try:
            graph, row_slot, seconds, nbytes = capture_graph(step, self.pool)
        finally:
            if saved is not None:
                policy.bound = saved
        self.capture_seconds += seconds
        self.capture_bytes += nbytes
        return graph, row_slot, static_meta

    def step(self, tokens, positions, write_pos, cache: KVCache, state: ReleaseState,
             policy: ReleasePolicy | None, step: int, hidden: torch.Tensor):
        """Decide the step's adapters and replay the decode step of `cache`'s bucket.

        `state` must be the static state `begin_call` returned; `hidden` `[B, H]` is the previous
        step's final hidden state (the policy's input). Returns (hidden, logits, row -> slot map of the step), all
        static buffers overwritten by the next replay.
        """
        bucket = self.buckets[(cache.batch_size, cache.max_len)]
        bucket.tokens.copy_(tokens)
        bucket.positions.copy_(positions)
        bucket.write_pos.copy_(write_pos)
        decide = self.model.context.enabled and self._in_graph(policy)
        if decide:
            if policy is not None and policy.reads_hidden:  # else the step never reads it
                if bucket.hidden_in is None:
                    bucket.hidden_in = torch.empty_like(hidden)
                bucket.hidden_in.copy_(hidden)
            bucket.step_index.fill_(step)
            key = ("device", type(policy) if policy is not None else None, self.model.context.slot_bound)
            meta = None
        else:
            if self.model.context.enabled:
                bucket.row_slot.copy_(release_step(policy, step, hidden, state))
            else:
                bucket.row_slot.fill_(-1)  # no row holds an adapter any more
            key, meta = self._layout(bucket.row_slot)
        if key not in bucket.graphs:
            bucket.graphs[key] = self._capture(bucket, meta, policy, decide)
        graph, row_slot, static_meta = bucket.graphs[key]
        if static_meta is not None:
            for name in ("sorted_rows", "slot_start", "row_slot", "large_slots"):
                src = getattr(meta, name)
                if src is not None:
                    getattr(static_meta, name).copy_(src)
        graph.replay()
        return bucket.hidden_out, bucket.logits_out, row_slot

    def clear(self) -> None:
        """Drop every captured graph (the KV caches stay); the next step recaptures."""
        for bucket in self.buckets.values():
            bucket.graphs.clear()
            bucket.hidden_out = bucket.logits_out = None
        # A pool whose graphs are all gone cannot take new captures: start a fresh one.
        self.pool = torch.cuda.graph_pool_handle()
        self.capture_bytes = 0

    def num_graphs(self) -> int:
        return sum(len(b.graphs) for b in self.buckets.values())
