"""Prometheus metrics of a served engine (`GET /metrics`): vLLM's metric set under the `lorazor:` prefix.

Names, suffixes and labels follow vLLM's (`vllm:num_requests_running` is `lorazor:num_requests_running`
here), so dashboards and gateway routers that read vLLM's metrics read these with the prefix changed;
`lorazor:lora_requests_info` carries the running and waiting adapters as vLLM's does. StepTrim adds
`lorazor:lora_decode_steps_total` (decode steps that ran an adapter), `lorazor:adapter_decode_steps_total`
(decode steps of adapter requests) and `lorazor:released_requests_total`; the share of decode LoRA
skipped is `1 - lora_decode_steps / adapter_decode_steps`. The prefix cache's counters are vLLM's:
`lorazor:prefix_cache_queries_total` (prompt tokens looked up) and `lorazor:prefix_cache_hits_total`
(of those, found cached). Where adapters live, for routers that place requests by residency (vLLM's
names, as llm-d's lora-load-state scorer reads them): `lorazor:lora_adapter_loaded{adapter_name,
level}` (1 per adapter per level, "gpu" or "cpu"), `lorazor:num_gpu_loaded_lora_adapters`,
`lorazor:max_gpu_lora_adapters`, and the histogram `lorazor:lora_adapter_load_seconds{source}`
("disk" or "cpu"). docs/serving.md lists every metric.
"""

from __future__ import annotations

import time

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import disable_created_metrics
from prometheus_client.core import HistogramMetricFamily

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
PREFIX = "lorazor:"

# One sample per counter, as vLLM exposes them (no `_created` series).
disable_created_metrics()


class ServerMetrics:
    """The metrics of one served model (`model_name` label on every series)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str):
        self.registry = registry = CollectorRegistry()
        label = ["model_name"]
        self.model_name = model_name

        def gauge(name, text, labels=()):
            return Gauge(PREFIX + name, text, label + list(labels), registry=registry)

        def counter(name, text, labels=()):
            return Counter(PREFIX + name, text, label + list(labels), registry=registry)

        def histogram(name, text):
            return Histogram(PREFIX + name, text, label, buckets=LATENCY_BUCKETS, registry=registry)

        self.running = gauge("num_requests_running", "Requests in the running batch")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent")
        self.kv_blocks = gauge("kv_cache_blocks", "KV-cache blocks in the pool")
        self.resident = gauge("lora_adapters_resident", "Adapters in GPU slots")
        self.lora_info = gauge("lora_requests_info", "Running and waiting adapters (value: time of the scrape)",
                               ["running_lora_adapters", "waiting_lora_adapters", "max_lora"])
        self.adapter_loaded = gauge("lora_adapter_loaded", "1 for each adapter and level it is resident at",
                                    ["adapter_name", "level"])
        self.gpu_loaded = gauge("num_gpu_loaded_lora_adapters", "Adapters in GPU slots")
        self.max_gpu = gauge("max_gpu_lora_adapters", "GPU adapter slots (max_loras)")
        self._load_times: dict = {}  # the engine's load-time histogram at the last scrape
        registry.register(_LoadSeconds(self))
        self.preemptions = counter("num_preemptions", "Preemptions (a request recomputed later)")
        self.adapter_loads = counter("lora_adapter_loads", "Adapter weights copied into a GPU slot")
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.success = counter("request_success", "Finished requests", ["finished_reason"])
        self.lora_decode_steps = counter("lora_decode_steps", "Decode steps of adapter requests that ran the adapter")
        self.adapter_decode_steps = counter("adapter_decode_steps", "Decode steps of adapter requests")
        self.released = counter("released_requests", "Requests that released their adapter (StepTrim)")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token")
        self.tpot = histogram("time_per_output_token_seconds", "Time per output token after the first")
        self.e2e = histogram("e2e_request_latency_seconds", "Time from arrival to the last token")
        self.queue = histogram("request_queue_time_seconds", "Time from arrival to the first scheduled step")
        # Engine counters already added (the engine counts; each scrape adds what is new).
        self._engine_counters = {"preemptions": self.preemptions, "adapter_loads": self.adapter_loads,
                                 "prefix_cache_queries": self.cache_queries, "prefix_cache_hits": self.cache_hits}
        self._seen = dict.fromkeys(self._engine_counters, 0)
        self.mirror = None  # another recorder of finished requests (Ray's metrics, in lorazor.ray)
        for metric in (
            self.preemptions,
            self.adapter_loads,
            self.cache_queries,
            self.cache_hits,
            self.prompt_tokens,
            self.generation_tokens,
            self.lora_decode_steps,
            self.adapter_decode_steps,
            self.released,
            self.ttft,
            self.tpot,
            self.e2e,
            self.queue,
        ):
            metric.labels(model_name)  # every series present from the start, at zero

    def observe(self, out, prompt_tokens: int) -> None:
        """Record a finished request (finished normally, aborted or failed)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(out.num_tokens)
        self.success.labels(m, out.finish_reason or "abort").inc()
        self.lora_decode_steps.labels(m).inc(out.lora_decode_steps)
        self.adapter_decode_steps.labels(m).inc(out.decode_steps)
        if out.release_step >= 0:
            self.released.labels(m).inc()
        for histogram, value in ((self.ttft, out.ttft), (self.tpot, out.tpot)):
            if value is not None:
                histogram.labels(m).observe(value)
        if out.finish_time is not None:
            self.e2e.labels(m).observe(out.finish_time - out.arrival_time)
        if out.scheduled_time is not None:
            self.queue.labels(m).observe(out.scheduled_time - out.arrival_time)
        if self.mirror is not None:
            self.mirror.observe(out, prompt_tokens)

    def observe_left(self, prompt_tokens: int, generated: int, arrival_time: float) -> None:
        """Record a request whose client went away before it finished (counted as aborted)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generated)
        self.success.labels(m, "abort").inc()
        self.e2e.labels(m).observe(time.monotonic() - arrival_time)
        if self.mirror is not None:
            self.mirror.observe_left(prompt_tokens, generated, arrival_time)

    def render(self, stats: dict) -> bytes:
        """The exposition text, with the gauges set from the engine's `stats` (`engines.engine_stats`)."""
        m = self.model_name
        self.running.labels(m).set(stats["running"])
        self.waiting.labels(m).set(stats["waiting"])
        self.kv_usage.labels(m).set(stats["kv_blocks_used"] / max(stats["kv_blocks_total"], 1))
        self.kv_blocks.labels(m).set(stats["kv_blocks_total"])
        self.resident.labels(m).set(stats["adapters_resident"])
        self.lora_info.clear()
        self.lora_info.labels(m, ",".join(stats["running_adapters"]), ",".join(stats["waiting_adapters"]),
                              str(stats["max_loras"])).set(time.time())
        residency = stats["residency"]
        self.adapter_loaded.clear()
        for name, (on_gpu, on_cpu) in residency.items():
            for level, resident in (("gpu", on_gpu), ("cpu", on_cpu)):
                if resident:
                    self.adapter_loaded.labels(m, name, level).set(1)
        self.gpu_loaded.labels(m).set(sum(on_gpu for on_gpu, _ in residency.values()))
        self.max_gpu.labels(m).set(stats["max_loras"])
        self._load_times = stats["load_times"]
        for key, counter in self._engine_counters.items():
            counter.labels(m).inc(max(stats[key] - self._seen[key], 0))
            self._seen[key] = max(stats[key], self._seen[key])
        return generate_latest(self.registry)


class _LoadSeconds:
    """`lorazor:lora_adapter_load_seconds{model_name, source}`: the engine's own histogram of load
    times (`AdapterRegistry.load_times`, cumulative since it started), exported as it was at the
    last scrape (the engine may run in another process)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        family = HistogramMetricFamily(PREFIX + "lora_adapter_load_seconds",
                                       "Host time to load an adapter into a GPU slot, by source (disk or cpu)",
                                       labels=["model_name", "source"])
        times = self.metrics._load_times
        for source in ("disk", "cpu"):
            counts = times.get("counts", {}).get(source, [0] * (len(times.get("buckets", ())) + 1))
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, times.get("buckets", ())), "+Inf"], counts):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric([self.metrics.model_name, source], buckets, times.get("sums", {}).get(source, 0.0))
        yield family
