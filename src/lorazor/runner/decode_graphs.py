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

from ..policies.base import ReleasePolicy, ReleaseState
from .graphs import StepGraphs
from .kv_cache import KVCache
from .release import decide_release


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
    graphs: dict = field(default_factory=dict)  # key -> (graph, the step's row -> slot map)
    static_meta: dict = field(default_factory=dict)  # key -> host-built metadata refreshed per replay
    # Every graph of the bucket writes its outputs here, so a bucket holds one `[B, V]` logits
    # buffer, not one per graph (~66 MB each for Llama-3.2-3B at batch 256).
    hidden_out: torch.Tensor | None = None
    logits_out: torch.Tensor | None = None


class DecodeGraphs(StepGraphs):
    """Lazily captured decode-step graphs of `generate()`, one bucket per (batch, cache length).

    Args:
        runner: the `ModelRunner` whose `decode_step` is captured.
    """

    def __init__(self, runner):
        super().__init__(runner, measure_memory=True)
        # What the next capture runs (set by `step` just before `_replay`).
        self._policy: ReleasePolicy | None = None
        self._decide = False
        self._meta: LoRABatchMeta | None = None

    def cache(self, batch_size: int, max_len: int, device: torch.device) -> KVCache:
        """The persistent KV cache of the (batch, length) bucket; prefill writes into it eagerly."""
        return self._bucket((batch_size, max_len), device).cache

    def _bucket(self, size, device=None) -> _Bucket:
        if size not in self.buckets:
            batch_size, max_len = size
            device = device if device is not None else self.runner.device
            cache = self.runner.new_cache(batch_size, max_len, device)
            zeros = lambda dtype: torch.zeros(batch_size, dtype=dtype, device=device)  # noqa: E731
            self.buckets[size] = _Bucket(cache, zeros(torch.long), zeros(torch.long), zeros(torch.long),
                                         zeros(torch.int32), torch.zeros((), dtype=torch.long, device=device))
        return self.buckets[size]

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
        return self.runner.context.meta_on_device and (policy is None or policy.graph_safe)

    def _layout(self, row_slot: torch.Tensor):
        """Graph key and host-built metadata of a step whose slot map was decided outside the graph."""
        context = self.runner.context
        if not context.enabled:
            return ("backbone",), None
        if context.meta_on_device:
            return ("device, eager release", context.slot_bound), None
        meta = context.build(row_slot)
        return (meta.row_bound, meta.class_split, meta.has_lora), meta

    def _fill(self, bucket: _Bucket, inputs) -> None:
        tokens, positions, write_pos = inputs
        bucket.tokens.copy_(tokens)
        bucket.positions.copy_(positions)
        bucket.write_pos.copy_(write_pos)

    def _step_function(self, bucket: _Bucket, key):
        if bucket.logits_out is None:
            # Allocated outside the graph pool and counted once as graph memory.
            before = torch.cuda.memory_allocated()
            bucket.logits_out, bucket.hidden_out = self.runner.new_step_outputs(bucket.tokens.shape[0])
            self.capture_bytes += torch.cuda.memory_allocated() - before
        policy, decide, meta = self._policy, self._decide, self._meta
        static_meta = None
        if meta is not None:
            # Static copies whose contents are refreshed before every replay of this layout.
            static_meta = bucket.static_meta[key] = LoRABatchMeta(
                **{k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in meta.__dict__.items()})
        # A graph-safe policy reads the bucket's static copies of its bound tensors.
        bound = bucket.policy_tensors[type(policy)] if decide and policy is not None else None

        def step():
            # Replays are idempotent for one step's inputs (release is one-way, cache writes repeat),
            # so the warm-up runs leave the same state as a single replay would.
            if decide:
                saved = None
                if bound is not None:
                    saved, policy.bound = policy.bound, bound
                try:
                    row_slot = decide_release(policy, bucket.step_index, bucket.hidden_in, bucket.state,
                                              compiled=self.runner.config.compile)
                finally:
                    if saved is not None:
                        policy.bound = saved
            else:
                row_slot = bucket.row_slot
            _, hidden = self.runner.decode_step(bucket.tokens, bucket.positions, bucket.write_pos, bucket.cache,
                                                row_slot, meta=static_meta, logits_out=bucket.logits_out)
            bucket.hidden_out.copy_(hidden)
            return row_slot

        return step

    def step(self, tokens, positions, write_pos, cache: KVCache, state: ReleaseState,
             policy: ReleasePolicy | None, step: int, hidden: torch.Tensor):
        """Decide the step's adapters and replay the decode step of `cache`'s bucket.

        `state` must be the static state `begin_call` returned; `hidden` `[B, H]` is the previous
        step's final hidden state (the policy's input). Returns (logits, hidden, row -> slot map of the step), all
        static buffers overwritten by the next replay.
        """
        bucket = self.buckets[(cache.batch_size, cache.max_len)]
        self._fill(bucket, (tokens, positions, write_pos))
        context = self.runner.context
        decide = context.enabled and self._in_graph(policy)
        meta = None
        if decide:
            if policy is not None and policy.reads_hidden:  # else the step never reads it
                if bucket.hidden_in is None:
                    bucket.hidden_in = torch.empty_like(hidden)
                bucket.hidden_in.copy_(hidden)
            bucket.step_index.fill_(step)
            key = ("device", type(policy) if policy is not None else None, context.slot_bound)
        else:
            if context.enabled:
                bucket.row_slot.copy_(decide_release(policy, step, hidden, state))
            else:
                bucket.row_slot.fill_(-1)  # no row holds an adapter any more
            key, meta = self._layout(bucket.row_slot)
        static_meta = bucket.static_meta.get(key)
        if static_meta is not None:  # a captured layout: refresh its metadata before the replay
            for name in ("sorted_rows", "slot_start", "row_slot", "large_slots"):
                src = getattr(meta, name)
                if src is not None:
                    getattr(static_meta, name).copy_(src)
        self._policy, self._decide, self._meta = policy, decide, meta
        row_slot = self._replay(bucket, key)
        return bucket.logits_out, bucket.hidden_out, row_slot

    def clear(self) -> None:
        """Drop every captured graph (the KV caches stay); the next step recaptures."""
        super().clear()
        for bucket in self.buckets.values():
            bucket.static_meta.clear()
            bucket.hidden_out = bucket.logits_out = None
