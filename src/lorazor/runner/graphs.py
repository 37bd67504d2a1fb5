"""The one CUDA-graph base under every graph family of the runner.

A family (`decode_graphs.py`: `generate()`'s decode step on the contiguous cache; `paged_graphs.py`:
the engine's decode-only and packed steps on the paged cache) keeps *buckets* of static buffers,
one per padded size: a batch bucket (1, 2, 4, 8, then multiples of 16 rows) or a token bucket
(multiples of `TOKEN_BUCKET` tokens). A bucket holds one graph per *graph key*: whether any row has
LoRA and, with the `exact` grid, the class of the number of distinct adapters in the step (16, 32,
64, ... up to the bank's slots; it bounds the grid's tile table). A family says how to build a
bucket (`_bucket`), how to copy a step's inputs into it (`_fill`) and what a graph of it runs
(`_step_function`); this base captures lazily or up front, replays, and counts. All graphs of a
family share one memory pool.
"""

from __future__ import annotations

import torch

# Token buckets of packed steps (prefill chunks beside decode rows) are multiples of this.
TOKEN_BUCKET = 256


def batch_bucket(batch_size: int) -> int:
    """Captured batch sizes: 1, 2, 4, 8, then multiples of 16 (pads at most 15 rows past 8)."""
    if batch_size <= 8:
        return 1 << (batch_size - 1).bit_length()
    return -(-batch_size // 16) * 16


def cache_bucket(length: int) -> int:
    """Contiguous KV-cache lengths are multiples of 64, so nearby prompt + max_new_tokens share graphs."""
    return -(-length // 64) * 64


def token_bucket(num_tokens: int) -> int:
    return -(-num_tokens // TOKEN_BUCKET) * TOKEN_BUCKET


def graph_key(context) -> tuple:
    """The graph a step needs besides its bucket: whether any row has LoRA and, if so, the class of
    the number of distinct adapters (which bounds the `exact` grid's tile table)."""
    return (context.enabled, context.slot_bound if context.enabled else None)


def capture_graph(step, pool, measure_memory: bool = True):
    """Capture `step()` (no arguments) as a CUDA graph in memory pool `pool`, after one warm-up run
    on a side stream (Triton compiles, cuBLAS picks algorithms, torch.compile traces: all on the
    first call). The step must be idempotent for its inputs: the warm-up runs it for real. Returns
    (graph, what the captured call returned, seconds, bytes the capture reserved: measured only with
    `measure_memory`, which empties the allocator's cache first and costs time per capture)."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
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


class StepGraphs:
    """Buckets of static buffers and their graphs, keyed by size then graph key.

    Args:
        runner: the `ModelRunner` whose forwards the graphs hold.
        pool: the graph memory pool (None: a fresh one).
        capture: False runs a bucket's step eagerly instead of replaying a graph (the CPU tests
            check the padding with it).
        measure_memory: measure the memory each capture reserves (`capture_bytes`; slower).
    """

    def __init__(self, runner, pool=None, capture: bool = True, measure_memory: bool = False):
        self.runner = runner
        self.capture = capture
        self.pool = pool if pool is not None or not capture else torch.cuda.graph_pool_handle()
        self.measure_memory = measure_memory
        self.buckets: dict = {}
        self.captured = 0
        self.capture_seconds = 0.0
        self.capture_bytes = 0

    # ---- what a family provides ------------------------------------------------------------------
    def _bucket(self, size: int, *args):
        raise NotImplementedError

    def _fill(self, bucket, inputs) -> None:
        raise NotImplementedError

    def _step_function(self, bucket, key):
        raise NotImplementedError

    # ---- shared ----------------------------------------------------------------------------------
    def _replay(self, bucket, key=None):
        """Run the bucket's step for the inputs just filled: its graph for `key` (default: the
        LoRA context's `graph_key`), captured on first use, or eagerly without capture. Returns
        what the captured step returned."""
        key = graph_key(self.runner.context) if key is None else key
        if not self.capture:
            return self._step_function(bucket, key)()
        if key not in bucket.graphs:
            bucket.graphs[key] = self._capture(bucket, key)
        graph, result = bucket.graphs[key]
        graph.replay()
        return result

    def _capture(self, bucket, key):
        graph, result, seconds, nbytes = capture_graph(self._step_function(bucket, key), self.pool,
                                                       self.measure_memory)
        self.captured += 1
        self.capture_seconds += seconds
        self.capture_bytes += nbytes
        return graph, result

    def capture_sizes(self, sizes, keys, *bucket_args) -> None:
        """Capture the graph of every bucket in `sizes` for every (enabled, slot bound) key, on
        padding-only inputs."""
        context = self.runner.context
        for size in sizes:
            bucket = self._bucket(size, *bucket_args)
            self._fill(bucket, None)
            for key in keys:
                if key not in bucket.graphs:
                    context.enabled, context.slot_bound = key
                    bucket.graphs[key] = self._capture(bucket, key)

    def num_graphs(self) -> int:
        return sum(len(b.graphs) for b in self.buckets.values())

    def clear(self) -> None:
        """Drop every captured graph (buffers and caches stay); the next step recaptures."""
        for bucket in self.buckets.values():
            bucket.graphs.clear()
        # A pool whose graphs are all gone cannot take new captures: start a fresh one.
        if self.capture:
            self.pool = torch.cuda.graph_pool_handle()
        self.capture_bytes = 0
