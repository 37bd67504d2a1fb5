"""Probe: is an offline engine trace bound by the GPU or by the host, and what are its steps?

    python benchmarks/probes/trace_busy.py --out /tmp/probe [--compile {auto,on,off}] [--workload decode-heavy]
    python benchmarks/probes/trace_busy.py --tiny --requests 16 --out /tmp/probe   # the logic, on the CPU

`bench_engine.py`'s engine and workload (LoRazor: `exact` + StepTrim, 128 adapters, graphs captured
first). Runs the offline trace step by step and records every `engine.step()`'s wall time, the
tokens it scheduled and whether it was decode-only. Over a window of steps inside the trace (on the
GPU, from step requests / 8 on) it records the CUDA kernels alone with torch.profiler: GPU busy / wall over the
window says how much of the trace the GPU waits for the host. A trace whose steps' GPU time sums
to far less than its wall time is host- or schedule-bound, not kernel-bound.
Writes `trace_busy{tag}.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
import engine_workload as wl  # noqa: E402
from bench_engine import offline_requests, setup  # noqa: E402
from common import environment  # noqa: E402
from host_trace import record_steps  # noqa: E402
from step_roofline import profile_steps  # noqa: E402


def summarize(walls: list[float], kinds: list[tuple[int, bool]]) -> dict:
    """Step counts, wall time and tokens by step kind (decode-only or with prefill chunks)."""
    out = {}
    for label, decode_only in (("decode", True), ("mixed", False)):
        picked = [(w, n) for w, (n, d) in zip(walls, kinds) if d == decode_only]
        if picked:
            out[label] = dict(steps=len(picked), wall_s=round(sum(w for w, _ in picked), 3),
                              median_ms=round(1e3 * statistics.median(w for w, _ in picked), 3),
                              tokens_mean=round(sum(n for _, n in picked) / len(picked), 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on this machine (checks the logic)")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--workload", choices=sorted(wl.SHAPES), default="mixed")
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--window", type=int, default=200, help="steps recorded by the profiler (GPU only)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model, engine, names, vocab, shape = setup(argparse.Namespace(
        part="exact", tiny=args.tiny, kv_gb=32.0, compile=args.compile, max_num_batched_tokens=None, max_num_seqs=None))
    warm_start = time.perf_counter()
    graphs = engine.warm_up()
    warm_s = time.perf_counter() - warm_start
    workload = wl.build(args.requests, vocab, shape=args.workload)
    if args.tiny:
        for r in workload:
            r.prompt, r.max_new_tokens = r.prompt[:16], min(r.max_new_tokens, 8)
    ks = wl.release_lengths(workload, wl.TARGET_SKIPS[args.workload])
    requests = offline_requests(workload, wl.assign(workload, len(names)), names, ks, True)
    engine.generate(requests[:64])  # the eager prefill path's first Triton compiles, outside the timings
    engine.pool.reset_cache()  # the trace starts cold: the warm-up ran its first requests

    steps = record_steps(engine)  # (decode rows, prefill tokens, running) per scheduled step
    for request in requests:
        engine.add_request(**request)
    walls, window = [], None
    window_steps = min(args.window, 2) if args.tiny else args.window  # a tiny trace has ~10 steps in all
    start = time.perf_counter()
    while engine.has_unfinished():
        if window is None and torch.cuda.is_available() and len(walls) >= len(requests) // 8:
            window = profile_steps(engine, window_steps, cpu=False)  # steps well inside the trace
            walls += [window["profiled_wall_ms"] / 1e3] * window_steps
            continue
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    # (tokens, decode-only) per step; the last schedule() call may have had nothing new to run
    kinds = [(decode + prefill, prefill == 0) for decode, prefill, _ in steps[:len(walls)]]
    result = dict(environment(), compile=model.config.compile, workload=args.workload, requests=len(requests),
                  warm_up_s=round(warm_s, 2), graphs=graphs, total_s=round(total, 3),
                  req_s=round(len(requests) / total, 2), steps=len(walls), by_kind=summarize(walls, kinds),
                  window=window, window_gpu_busy_share=(round(window["gpu_busy_ms"] / window["profiled_wall_ms"], 3)
                                                        if window else None), **shape)
    print(json.dumps(result, indent=1), flush=True)
    (args.out / f"trace_busy{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
