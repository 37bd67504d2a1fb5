"""`bench_serving.py --replicas N`: what adapter affinity buys on Ray Serve (loopback only, bounded).

The same Poisson arrivals, each request for one adapter drawn uniformly from the testbed's four, go
to `lorazor serve --testbed --replicas N` twice: with adapter affinity (Serve's multiplexing routes
a request to a replica that holds its adapter) and with `--no-affinity` (any replica). Each replica
has fewer GPU slots (`--max-loras`) than the adapters in use, so a request routed to a replica
without its adapter costs an adapter load. Reported per mode: adapter loads per request (summed
over the replicas from Ray's metrics export), P50/P90 TTFT and achieved req/s.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx

# Seconds of reads of Ray's export after the last request (replicas set their gauges every 2 s; the
# benchmark sets Ray's report interval to 1 s).
METRICS_WINDOW_S = 15.0


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def adapter_loads(metrics_url: str) -> dict[str, float]:
    """Adapter loads so far per replica, from Ray's Prometheus export."""
    text = httpx.get(metrics_url, timeout=30).text
    loads = {}
    for line in text.splitlines():
        if line.startswith("ray_lorazor_lora_adapter_loads{"):
            replica = re.search(r'replica="([^"]+)"', line).group(1)
            loads[replica] = float(line.split()[-1])
    return loads


def settled_loads(metrics_url: str) -> dict[str, float]:
    """Adapter loads per replica: the largest value each replica's (cumulative) gauge shows over
    `METRICS_WINDOW_S` of reads (Ray's export shows a gauge only for a while after it was set)."""
    seen: dict[str, float] = {}
    deadline = time.monotonic() + METRICS_WINDOW_S
    while time.monotonic() < deadline:
        for replica, value in adapter_loads(metrics_url).items():
            seen[replica] = max(value, seen.get(replica, 0.0))
        time.sleep(1.0)
    return seen


def serve(args, affinity: bool):
    """Start `lorazor serve --replicas`; returns (process, url, metrics url)."""
    from lorazor.ray import LOOPBACK_ONLY_ENV

    port, metrics_port = free_port(), free_port()
    env = {**os.environ, **LOOPBACK_ONLY_ENV, "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_metrics_report_interval_ms": "1000"}
    command = [sys.executable, "-m", "lorazor", "serve", "--testbed", "--served-model-name", "base",
               "--replicas", str(args.replicas), "--max-loras", str(args.max_loras), "--max-adapters-per-replica",
               str(args.max_loras), "--in-process", "--port", str(port), "--ray-metrics-port", str(metrics_port),
               "--log-level", "warning"] + ([] if affinity else ["--no-affinity"])
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url, f"http://127.0.0.1:{metrics_port}/metrics"
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"lorazor serve --replicas did not come up (exit code {proc.poll()})")


def stop(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)


def main(args) -> list[dict]:
    """Both modes at `args.rates[0]`; returns the rows (also printed as JSON lines)."""
    import json
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import engine_workload as wl
    from http_load import http_open_loop

    from lorazor.testbed import load_tokenizer, make_tasks

    tokenizer = load_tokenizer()
    tasks = make_tasks()
    names = sorted(tasks)
    rng = random.Random(0)
    rate = float(args.rates.split(",")[0])
    offsets = wl.poisson_arrivals(rate, args.seconds, seed=1)
    requests = []
    for i in range(len(offsets)):
        name = rng.choice(names)
        example = tasks[name].split("validation")[i % 50]
        requests.append(dict(adapter=name, prompt_ids=tokenizer(example["prompt"])["input_ids"],
                             max_new_tokens=args.max_new_tokens or 8, release=None))
    rows = []
    pool = ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(time.sleep, [0.0] * args.clients))
    try:
        for affinity in (True, False):
            proc, url, metrics_url = serve(args, affinity)
            try:
                row = http_open_loop(pool, url, requests, offsets)
                loads = settled_loads(metrics_url)
            finally:
                stop(proc)
            rows.append(dict(affinity=affinity, rate=rate, requests=len(requests), replicas=args.replicas,
                             max_loras=args.max_loras, adapters=len(names), adapter_loads=sum(loads.values()),
                             loads_per_request=sum(loads.values()) / len(requests), loads_by_replica=loads, **row))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        pool.shutdown()
    return rows
