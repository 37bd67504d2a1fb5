"""What the engine's two graph families share: buckets of static buffers, one graph per (bucket,
graph key), lazy capture, capture up front, replay.

A subclass builds a bucket's buffers (`_bucket`), copies a step's inputs into them (`_fill`) and
says what a graph of the bucket runs (`_step_function`); every bucket dataclass has a `graphs` dict.
"""

from __future__ import annotations

from ..graphs import capture_graph


def graph_key(context) -> tuple:
    """The graph a step needs besides its bucket: whether any row has LoRA and, if so, the class of
    the number of distinct adapters (which bounds the `exact` grid's tile table)."""
    return (context.enabled, context.slot_bound if context.enabled else None)


class StepGraphs:
    """Args: model: the `LoRazorModel`; cache: the engine's `PagedKVCache`; pool: the graph memory
    pool; capture: False runs a bucket's step eagerly instead of replaying a graph (the CPU tests
    check the padding with it)."""

    def __init__(self, model, cache, pool, capture: bool = True):
        self.model = model
        self.cache = cache
        self.pool = pool
        self.capture = capture
        self.buckets: dict = {}
        self.captured = 0
        self.capture_time = 0.0

    def _bucket(self, size: int, block_tables):
        raise NotImplementedError

    def _fill(self, bucket, inputs) -> None:
        raise NotImplementedError

    def _step_function(self, bucket):
        raise NotImplementedError

    def _replay(self, bucket) -> None:
        """Run the bucket's step for the inputs just filled: its graph for this step's key
        (captured on first use), or eagerly without capture."""
        if not self.capture:
            self._step_function(bucket)()
            return
        key = graph_key(self.model.context)
        if key not in bucket.graphs:
            bucket.graphs[key] = self._capture(bucket)
        bucket.graphs[key].replay()

    def _capture(self, bucket):
        graph, _, seconds, _ = capture_graph(self._step_function(bucket), self.pool, measure_memory=False)
        self.captured += 1
        self.capture_time += seconds
        return graph

    def capture_sizes(self, sizes, block_tables, keys) -> None:
        """Capture the graph of every bucket in `sizes` for every key, on padding-only inputs."""
        context = self.model.context
        for size in sizes:
            bucket = self._bucket(size, block_tables)
            self._fill(bucket, None)
            for key in keys:
                if key not in bucket.graphs:
                    context.enabled, context.slot_bound = key
                    bucket.graphs[key] = self._capture(bucket)
