"""Probe: where an engine step's time goes (Llama-3.2-3B shape, 128 adapters, the bench workload).

    python benchmarks/probes/engine_step_profile.py --requests 1024 --out /tmp/probe

Times every step by kind (decode-only graph replay or eager with prefill chunks) with its token
count, splits a step into host preparation, forward and read-back, and profiles a few mixed steps
with torch.profiler (top CUDA kernels, CPU total).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
import engine_workload as wl  # noqa: E402
from bench_e2e import TARGETS, build_base, fill_random_adapters  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--no-warm-up", action="store_true", help="capture graphs lazily (read the medians)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel

    base = build_base("llama-3.2-3b")
    base.generation_config.eos_token_id = None
    base.config.eos_token_id = None
    model = LoRazorModel.from_pretrained(base, None, LoRazorConfig(max_loras=128, max_lora_rank=8,
                                                                   lora_target_modules=TARGETS))
    names = fill_random_adapters(model, 0, 128)
    engine = LoRazorEngine(model, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=12000,
                           max_model_len=1024)
    if not args.no_warm_up:
        engine.warm_up()
    workload = wl.build(args.requests, base.config.vocab_size)
    ids = wl.assign(workload, 128)
    for r, i in zip(workload, ids):
        engine.add_request(r.prompt, adapter=names[i], max_new_tokens=r.max_new_tokens, release="never",
                           pad_token_id=0)
    # Time the phases of a step by wrapping the runner's pieces (the forward with a sync after it).
    from lorazor.engine import engine as engine_module

    phases = defaultdict(float)
    original_prepare, original_run = engine_module.prepare, engine.runner.run_paged_step
    kinds = defaultdict(list)

    def timed_prepare(*a, **k):
        t = time.perf_counter()
        out = original_prepare(*a, **k)
        phases["prepare"] += time.perf_counter() - t
        return out

    def timed_run(cache, inputs, block_tables, graphs):
        t = time.perf_counter()
        out = original_run(cache, inputs, block_tables, graphs)
        torch.cuda.synchronize()
        tokens = len(inputs.ids)
        kinds["decode" if inputs.decode_only else "mixed"].append((time.perf_counter() - t, tokens))
        return out

    engine_module.prepare = timed_prepare
    engine.runner.run_paged_step = timed_run
    profiled = 0
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
        if len(kinds["mixed"]) in (20, 40, 60) and profiled < len(kinds["mixed"]) // 20:
            profiled += 1
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
            (args.out / f"step_{profiled}.txt").write_text(table)
            print(table[:7000], flush=True)
    total = time.perf_counter() - start
    summary = dict(total_s=total, requests=len(workload), prepare_s=phases["prepare"], step_s=sum(steps),
                   **{f"{k}_steps": len(v) for k, v in kinds.items()},
                   **{f"{k}_ms_mean": 1e3 * sum(d for d, _ in v) / len(v) for k, v in kinds.items() if v},
                   **{f"{k}_ms_median": 1e3 * sorted(d for d, _ in v)[len(v) // 2] for k, v in kinds.items() if v},
                   **{f"{k}_tokens_mean": sum(n for _, n in v) / len(v) for k, v in kinds.items() if v},
                   **{f"{k}_s": sum(d for d, _ in v) for k, v in kinds.items()})
    print(json.dumps(summary, indent=1), flush=True)
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
