"""The HTTP server's own cost, on the CPU: the engine's step replaced by a synthetic one.

    python benchmarks/probes/serve_overhead.py --step-ms 8 --rates 100,200,300 --clients 1
    python benchmarks/probes/serve_overhead.py --step-ms 6 --busy-ms 3 --releases 6 --rates 150 --clients 2
    ... --engine thread    # the server's engine on a thread of its process (default: a process of its own)

The synthetic step waits `--step-ms` with the GIL released (as the GPU wait does) and gives every
unfinished request one token, up to 256 at a time: the token rate of the H200 engine at a
fraction of its cost, so what limits the HTTP path here is the server (and the clients), not a
model. It reports the same rows as bench_serving.py: in-process and HTTP open loop per rate.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))
import bench_serving as bs  # noqa: E402
import engine_workload as wl  # noqa: E402


def _busy(ms: float) -> None:
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        pass


def synthetic_step(engine, step_ms: float, rows: int, busy_ms: float = 0.0, releases: int = 1):
    """A step that costs `step_ms` of GIL-free waiting in `releases` parts, with `busy_ms` of Python
    (holding the GIL, as the engine's scheduling and launches do) spread between them, and emits
    one token per running request."""
    def step():
        for _ in range(releases):
            _busy(busy_ms / releases)
            time.sleep(step_ms / 1000 / releases)
        now = time.monotonic()
        outputs = []
        for request in list(engine.requests.values())[:rows]:
            request.append(7)
            if request.first_token_time is None:
                request.first_token_time = now
            if len(request.output) >= request.plan.max_new_tokens:
                engine._finish(request, "length")
            outputs.append(request.report([7]))
        return outputs
    return step


def synthetic_setup(args):
    """(engine, tokenizer, adapter names, vocab size): the tiny engine with the synthetic step."""
    engine, tokenizer, names, vocab = bs.build(argparse.Namespace(testbed=False, tiny=True))
    engine.step = synthetic_step(engine, args.step_ms, args.rows, args.busy_ms, args.releases)
    return engine, tokenizer, names, vocab


def synthetic_engine(args):
    """(engine, tokenizer): what the engine process runs."""
    return synthetic_setup(args)[:2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--step-ms", type=float, default=8.0)
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--rates", default="100,200,300")
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--clients", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--busy-ms", type=float, default=0.0, help="Python work per step, holding the GIL")
    ap.add_argument("--releases", type=int, default=1, help="GIL-free waits per step (the step's syncs)")
    ap.add_argument("--switch-interval", default="app", help="build_app's switch_interval: app (its default), "
                    "none (Python's 5 ms) or seconds")
    ap.add_argument("--engine", choices=["process", "thread"], default="process",
                    help="where the HTTP server's engine runs")
    args = ap.parse_args()
    engine, tokenizer, names, vocab = synthetic_setup(args)
    rates = [float(x) for x in args.rates.split(",")]
    # Requests of its own per rate: the HTTP engine keeps its prefix cache between rates.
    workload = wl.build(4 * int(sum(rates) * args.seconds * 1.5 / 4 + 4), vocab)
    requests = [dict(prompt_ids=r.prompt[:16], adapter=names[0], max_new_tokens=min(r.max_new_tokens,
                     args.max_new_tokens), release="never", pad_token_id=0) for r in workload]
    app_kwargs = {} if args.switch_interval == "app" else dict(
        switch_interval=None if args.switch_interval == "none" else float(args.switch_interval))
    served = engine
    if args.engine == "process":
        import functools

        from lorazor.engine import EngineProcess

        from lorazor.serve.engines import process_hooks

        served = EngineProcess(functools.partial(process_hooks, synthetic_engine, args))
    server, thread, url = bs.start_server(served, tokenizer, **app_kwargs)
    pool = ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(time.sleep, [0.0] * args.clients))
    try:
        used = 0
        for rate in rates:
            offsets = wl.poisson_arrivals(rate, args.seconds, seed=int(rate))
            batch = requests[used:used + len(offsets)]
            used += len(offsets)
            for path in ("in_process", "http"):
                row = (wl.run_open_loop(engine, batch, offsets) if path == "in_process"
                       else bs.http_open_loop(pool, url, batch, offsets))
                print(f"rate {rate:5.0f} {path:10s} achieved {row['achieved_req_s']:6.1f} req/s  TTFT p50 "
                      f"{row['ttft_p50']:.3f} p90 {row['ttft_p90']:.3f}  TPOT p50 {row['tpot_p50'] * 1e3:.1f} ms "
                      f"p90 {row['tpot_p90'] * 1e3:.1f} ms", flush=True)
    finally:
        pool.shutdown()
        server.should_exit = True
        thread.join(timeout=10)


if __name__ == "__main__":
    main()
