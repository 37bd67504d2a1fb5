"""Prometheus metrics of a served engine (`GET /metrics`), in a registry of their own."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    """Running / waiting requests, KV blocks in use, adapters in GPU slots (set when scraped);
    generated tokens and finished requests (counters; take `rate()` for tokens/s); TTFT and TPOT."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self):
        self.registry = registry = CollectorRegistry()
        self.gauges = {key: Gauge(f"lorazor_{metric}", text, registry=registry) for key, metric, text in (
            ("running", "requests_running", "Requests running"), ("waiting", "requests_waiting", "Requests waiting"),
            ("kv_blocks_used", "kv_blocks_used", "KV cache blocks in use"),
            ("kv_blocks_total", "kv_blocks_total", "KV cache blocks"),
            ("adapters_resident", "adapters_resident", "Adapters in GPU slots"))}
        self.tokens = Counter("lorazor_generation_tokens", "Generated tokens", registry=registry)
        self.finished = Counter("lorazor_requests_finished", "Finished requests", ["reason"], registry=registry)
        self.ttft = Histogram("lorazor_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("lorazor_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=registry)

    def observe(self, out) -> None:
        """Record a finished request."""
        self.tokens.inc(len(out.token_ids))
        self.finished.labels(reason=out.finish_reason).inc()
        if out.ttft is not None:
            self.ttft.observe(out.ttft)
        if out.tpot is not None:
            self.tpot.observe(out.tpot)

    def render(self, stats: dict) -> bytes:
        """The exposition text, with the gauges set from the engine's `stats` (`engine_stats`)."""
        for key, gauge in self.gauges.items():
            gauge.set(stats[key])
        return generate_latest(self.registry)
