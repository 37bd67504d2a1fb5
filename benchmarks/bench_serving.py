"""HTTP serving against the in-process engine at the same Poisson rates (loopback only, bounded).

    python benchmarks/bench_serving.py --out benchmarks/results/serving            # H200
    python benchmarks/bench_serving.py --testbed --rates 2,4 --seconds 2 --out /tmp/s  # CPU, the testbed
    python benchmarks/bench_serving.py --tiny --rates 2,4 --seconds 2 --out /tmp/s     # CPU, the GPU run's logic

For each offered rate, the same arrivals and requests run twice on one engine:
1. In process: requests join `engine.step()` at their arrival times (`engine_workload.run_open_loop`).
2. Over HTTP: `lorazor.serve.build_app` under uvicorn on 127.0.0.1, in this process, over a second
   copy of the engine in a process of its own (`EngineProcess`, as `lorazor serve` runs it;
   `--engine thread` serves the first copy from a thread of this process instead). Each request
   is a streaming `POST /v1/completions` with the prompt as token ids, sent at its arrival time by
   an async httpx client in one of `--clients` child processes (so the clients do not share the
   server's GIL). TTFT runs from the send to the first streamed chunk; TPOT from there to the last
   chunk, per token.
`--workload shared-prefix` sends the prefix cache's trace (`engine_workload.build_shared_prefix`);
`--no-prefix-caching` turns the cache off in both engines (run it twice to compare).
It reports achieved req/s, P50/P90/P99 TTFT and TPOT per rate and path. The *knee* is the offered
rate at which P90 TTFT crosses `--ttft-slo` (interpolated between the tested rates; past
saturation TTFT grows with the queue). The target is an HTTP knee at least 0.9x the in-process
knee.

The GPU model is the Llama-3.2-3B shape with random bf16 weights and 128 random rank-8 adapters, on
the bench workload (EOS ignored). It has no tokenizer: text is the space-separated token ids.
`--testbed` serves the shipped testbed on the CPU with its own tokenizer.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import socket
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import engine_workload as wl  # noqa: E402
from http_load import http_open_loop  # noqa: E402
from common import environment, write_results  # noqa: E402



class TokenIdText:
    """A stand-in tokenizer for a random-weight model: text is the token ids, space-separated."""

    eos_token_id = None
    pad_token_id = 0
    chat_template = None

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(str(i) for i in ids)

    def __call__(self, text, **_) -> dict:
        return {"input_ids": [int(t) for t in text.split()]}


def build(args):
    """(engine, tokenizer, adapter names, vocab size)."""
    if args.testbed:
        from lorazor import LoRazorEngine, LoRazorModel
        from lorazor.testbed import load

        peft_model, tokenizer, _ = load()
        model = LoRazorModel.from_peft(peft_model)
        engine = LoRazorEngine(model, max_num_seqs=32, max_num_batched_tokens=512, num_kv_blocks=1024,
                               enable_prefix_caching=args.prefix_caching)
        return engine, tokenizer, model.adapter_names, tokenizer.vocab_size
    from bench_engine import setup

    # The engine benchmark's model and engine (exact grid): 3B shape and 128 adapters, or --tiny.
    _, engine, names, vocab, _ = setup(argparse.Namespace(
        part="exact", tiny=args.tiny, kv_gb=args.kv_gb, compile=False, max_num_batched_tokens=None, max_num_seqs=None,
        workload=args.workload, prefix_caching=args.prefix_caching))
    engine.warm_up()
    return engine, TokenIdText(), names, vocab


def engine_factory(args):
    """(engine, tokenizer) as `build` makes them: what the engine process runs."""
    engine, tokenizer, _, _ = build(args)
    return engine, tokenizer


def serving_engine(engine, args):
    """What the HTTP server serves: `engine` itself (`--engine thread`), or a copy of it built in a
    process of its own."""
    if args.engine == "thread":
        return engine
    import functools

    from lorazor.engine import EngineProcess

    from lorazor.serve.engines import process_hooks

    return EngineProcess(functools.partial(process_hooks, engine_factory, argparse.Namespace(
        testbed=args.testbed, tiny=args.tiny, kv_gb=args.kv_gb, workload=args.workload,
        prefix_caching=args.prefix_caching)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine, tokenizer, **app_kwargs):
    import httpx
    import uvicorn

    from lorazor.serve import build_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(engine, tokenizer, **app_kwargs), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return server, thread, url
        except httpx.HTTPError:
            time.sleep(0.05)
    raise TimeoutError(f"the server at {url} did not come up")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--testbed", action="store_true", help="the shipped testbed on the CPU")
    ap.add_argument("--tiny", action="store_true", help="the GPU run's logic on a tiny random model (CPU)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/serving"))
    ap.add_argument("--rates", default="25,50,100,150,200")
    ap.add_argument("--seconds", type=float, default=8.0, help="arrival window per rate")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="cap on output lengths (0: the workload's)")
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="P90 TTFT (s) that defines the knee")
    ap.add_argument("--clients", type=int, default=4, help="client processes sending the HTTP requests")
    ap.add_argument("--engine", choices=["process", "thread"], default="process",
                    help="where the HTTP server's engine runs (process: lorazor serve's default)")
    ap.add_argument("--replicas", type=int, default=0,
                    help="instead: lorazor serve --testbed --replicas N on Ray, adapter affinity on vs off "
                         "(serving_replicas.py; the first rate only)")
    ap.add_argument("--max-loras", type=int, default=2, help="with --replicas: GPU slots per replica")
    ap.add_argument("--workload", choices=["mixed", "shared-prefix"], default="mixed",
                    help="the requests: the paper's mixed trace, or the prefix cache's shared-prefix trace")
    ap.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                    help="the engines' prefix cache (default: on, the engine's default)")
    ap.add_argument("--kv-gb", type=float, default=16.0,
                    help="each engine's KV pool (two engines share the GPU: the in-process one and the server's)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.replicas:
        return replicas_main(args, t0)
    engine, tokenizer, names, vocab = build(args)
    rates = [float(x) for x in args.rates.split(",")]
    # Each rate sends requests of its own: the HTTP server's engine keeps its prefix cache between
    # rates (the in-process engine's open loop starts cold), so no rate may replay another's prompts.
    count = 4 * int(sum(rates) * args.seconds * 1.5 / 4 + 4)
    if args.workload == "shared-prefix":
        workload, identities = wl.build_shared_prefix(count, vocab, min(len(names), 128))
    else:
        workload = wl.build(count, vocab)
        identities = wl.assign(workload, len(names))
    if args.testbed or args.tiny:  # small models on the CPU: scale the lengths down (keeping a shared head)
        for r in workload:
            r.prompt = r.prompt[:24] if args.workload == "mixed" else r.prompt[:24] + r.prompt[-8:]
            r.max_new_tokens = min(r.max_new_tokens, 16)
    if args.max_new_tokens:
        for r in workload:
            r.max_new_tokens = min(r.max_new_tokens, args.max_new_tokens)
    ks = wl.release_lengths(workload) if args.workload == "mixed" else {}
    requests = [dict(prompt_ids=r.prompt, adapter=names[i], max_new_tokens=r.max_new_tokens,
                     release=ks.get(r.group), pad_token_id=0) for r, i in zip(workload, identities)]
    server, thread, url = start_server(serving_engine(engine, args), tokenizer)
    rows = []
    pool = ProcessPoolExecutor(args.clients, mp_context=multiprocessing.get_context("spawn"))
    list(pool.map(time.sleep, [0.0] * args.clients))  # start the client processes before any timing
    try:
        used = 0
        for rate in rates:
            offsets = wl.poisson_arrivals(rate, args.seconds, seed=int(rate))
            batch = requests[used:used + len(offsets)]
            used += len(offsets)
            for path in ("in_process", "http"):
                if path == "in_process":
                    row = wl.run_open_loop(engine, batch, offsets)
                else:
                    row = http_open_loop(pool, url, batch, offsets)
                rows.append(dict(path=path, rate=rate, **row))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        pool.shutdown()
        server.should_exit = True
        thread.join(timeout=10)
    knees = {p: wl.knee([(r["rate"], r["ttft_p90"]) for r in rows if r["path"] == p], args.ttft_slo)
             for p in ("in_process", "http")}
    ratio = knees["http"][0] / knees["in_process"][0] if knees["in_process"][0] else float("nan")
    meta = dict(environment(), testbed=args.testbed, tiny=args.tiny, seconds=args.seconds, ttft_slo=args.ttft_slo,
                clients=args.clients, engine=args.engine, workload=args.workload, prefix_caching=args.prefix_caching,
                knees={p: k for p, (k, _) in knees.items()}, knees_crossed={p: c for p, (_, c) in knees.items()},
                knee_ratio=ratio, total_s=time.perf_counter() - t0)
    title = "testbed, CPU" if args.testbed else "tiny model, CPU" if args.tiny else "Llama-3.2-3B shape, 128 adapters"
    lines = [f"# HTTP vs in-process serving ({title})",
             "", f"commit {meta['commit']}, {meta.get('gpu', 'CPU')}, torch {meta['torch']}; the server's engine "
                 f"runs {'in a process of its own' if args.engine == 'process' else 'on a thread of its process'}; "
                 f"workload {args.workload}, prefix cache {'on' if args.prefix_caching else 'off'}",
             "",
             "| rate | path | achieved req/s | TTFT p50 | TTFT p90 | TTFT p99 | TPOT p50 | TPOT p90 | TPOT p99 |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']:.0f} | {r['path']} | {r['achieved_req_s']:.1f} | " + " | ".join(
            f"{r[k]:.3f}" for k in ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99")) + " |")
    shown = {p: f"{k:.1f}" + ("" if crossed else "+") for p, (k, crossed) in knees.items()}
    lines += ["", f"Knee (offered req/s where P90 TTFT crosses {args.ttft_slo:g} s; + = not crossed by the highest "
                  f"rate): in process {shown['in_process']}, HTTP {shown['http']}, ratio {ratio:.2f} (target >= 0.90)."]
    cache = "on" if args.prefix_caching else "off"
    name = "serving" if args.workload == "mixed" else f"serving_{args.workload}_{cache}"
    write_results(args.out, name, rows, meta, "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


def replicas_main(args, t0: float) -> None:
    import serving_replicas

    rows = serving_replicas.main(args)
    meta = dict(environment(), replicas=args.replicas, max_loras=args.max_loras, seconds=args.seconds,
                clients=args.clients, total_s=time.perf_counter() - t0)
    lines = [
        f"# Adapter affinity on Ray Serve ({args.replicas} replicas of the testbed, CPU)",
        "",
        f"commit {meta['commit']}, {meta.get('gpu', 'CPU')}, torch {meta['torch']}; {rows[0]['adapters']} adapters "
        f"used uniformly, {args.max_loras} GPU slots per replica, {rows[0]['requests']} requests at "
        f"{rows[0]['rate']:g} req/s",
        "",
        "| affinity | adapter loads | loads per request | achieved req/s | TTFT p50 | TTFT p90 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {'on' if r['affinity'] else 'off'} | {r['adapter_loads']:.0f} | {r['loads_per_request']:.2f} "
                     f"| {r['achieved_req_s']:.1f} | {r['ttft_p50']:.3f} | {r['ttft_p90']:.3f} |")
    write_results(args.out, "serving_replicas", rows, meta, "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
