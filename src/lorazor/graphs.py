"""CUDA-graph capture and replay of the decode step, per batch bucket (and grid layout).

The captured step is: write the new tokens' positions into the KV cache, build the LoRA step
metadata from the row -> slot map (device-only for `exact` and `full`), run the decoder with the
batched LoRA layers, and the LM head on each row's last hidden state. Inputs and outputs live in
static buffers; a replay serves any tokens, positions and adapter mix without recapture.

The paper's grid modes (`active_rows`, `two_class`) fix their launch shape on the host: their
metadata is built outside the graph (one host sync per step) into static buffers, and a graph is
captured per (bucket, row bound R, class layout), as in the paper's Algorithm 1.

All graphs share one memory pool. Each bucket owns a persistent KV cache of its size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from lorazor_kernels import LoRABatchMeta

from .kv_cache import KVCache


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
    row_slot: torch.Tensor
    graphs: dict = field(default_factory=dict)  # layout key -> (graph, hidden, logits, static meta)


class DecodeGraphs:
    """Lazily captured decode-step graphs of one `LoRazorModel`.

    Args:
        model: the `LoRazorModel` whose `decode_step` is captured.
    """

    def __init__(self, model):
        self.model = model
        self.pool = torch.cuda.graph_pool_handle()
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    def cache(self, batch_size: int, max_len: int, device: torch.device) -> KVCache:
        """The persistent KV cache of the (batch, length) bucket; prefill writes into it eagerly."""
        key = (batch_size, max_len)
        if key not in self.buckets:
            cache = self.model.new_cache(batch_size, max_len, device)
            zeros = lambda dtype: torch.zeros(batch_size, dtype=dtype, device=device)  # noqa: E731
            self.buckets[key] = _Bucket(cache, zeros(torch.long), zeros(torch.long), zeros(torch.long),
                                        zeros(torch.int32))
        return self.buckets[key].cache

    def _layout(self, row_slot: torch.Tensor):
        """Graph key and host-built metadata for the paper's modes; (None, None) for device modes."""
        context = self.model.context
        if not context.enabled:
            return "backbone", None
        if context.meta_on_device:
            return "device", None
        meta = context.build(row_slot)
        return (meta.row_bound, meta.class_split, meta.has_lora), meta

    def _capture(self, bucket: _Bucket, meta: LoRABatchMeta | None):
        static_meta = None
        if meta is not None:
            # Static copies whose contents are refreshed before every replay of this layout.
            static_meta = LoRABatchMeta(**{k: (v.clone() if isinstance(v, torch.Tensor) else v)
                                           for k, v in meta.__dict__.items()})

        def step():
            return self.model.decode_step(bucket.tokens, bucket.positions, bucket.write_pos, bucket.cache,
                                          bucket.row_slot, meta=static_meta)

        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        # Warm up on a side stream (Triton compiles, cuBLAS picks algorithms) before capturing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                step()
        torch.cuda.current_stream().wait_stream(side)
        # Release what the warm-up cached, so the reserved-memory delta is the graph's own pool.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden, logits = step()
        end.record()
        end.synchronize()
        self.capture_seconds += start.elapsed_time(end) / 1e3
        self.capture_bytes += torch.cuda.memory_reserved() - reserved
        return graph, hidden, logits, static_meta

    def step(self, tokens, positions, write_pos, cache: KVCache, row_slot):
        """Replay the decode step of `cache`'s bucket for these inputs; returns (hidden, logits).

        The outputs are static buffers, overwritten by the next replay.
        """
        bucket = self.buckets[(cache.batch_size, cache.max_len)]
        bucket.tokens.copy_(tokens)
        bucket.positions.copy_(positions)
        bucket.write_pos.copy_(write_pos)
        bucket.row_slot.copy_(row_slot)
        key, meta = self._layout(bucket.row_slot)
        if key not in bucket.graphs:
            bucket.graphs[key] = self._capture(bucket, meta)
        graph, hidden, logits, static_meta = bucket.graphs[key]
        if static_meta is not None:
            for name in ("sorted_rows", "slot_start", "row_slot", "large_slots"):
                src = getattr(meta, name)
                if src is not None:
                    getattr(static_meta, name).copy_(src)
        graph.replay()
        return hidden, logits

    def clear(self) -> None:
        """Drop every captured graph (the KV caches stay); the next step recaptures."""
        for bucket in self.buckets.values():
            bucket.graphs.clear()
        # A pool whose graphs are all gone cannot take new captures: start a fresh one.
        self.pool = torch.cuda.graph_pool_handle()

    def num_graphs(self) -> int:
        return sum(len(b.graphs) for b in self.buckets.values())
