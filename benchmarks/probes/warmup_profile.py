"""Probe: where `engine.warm_up()` spends its time, and where a 2,048-token packed step spends its GPU time.

    python benchmarks/probes/warmup_profile.py --out /tmp/probe [--compile] [--cprofile] [--tag _restart]

Llama-3.2-3B shape, bf16, 128 random rank-8 adapters, engine defaults (`max_num_seqs=256`,
`max_num_batched_tokens=2048`), the step_roofline probe's engine. Writes `warmup_profile.json`:
- every capture in order (graph family, bucket, graph key, seconds; the seconds of each run of the
  step inside it: two warm-up runs, then the captured run);
- with `--cprofile`, the top functions of a cProfile of the whole `warm_up()` (cumulative and own
  time; the profiler slows Python, so the times are then shares, not the warm-up a user sees);
- the top CUDA kernels of one packed step of 8 prompts x 256 tokens (torch.profiler, graph replay).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
from bench_e2e import TARGETS, build_base, fill_random_adapters  # noqa: E402
from common import environment  # noqa: E402


def top_functions(profiler: cProfile.Profile, key: str, n: int = 30) -> list[str]:
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(n)
    return [line for line in text.getvalue().splitlines() if line.strip()][-n - 1:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--cprofile", action="store_true", help="profile warm_up() with cProfile (slows it)")
    ap.add_argument("--tag", default="", help="appended to the result's file name (e.g. _restart)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel
    from lorazor.runner import graphs as graph_module

    base = build_base("llama-3.2-3b")
    base.generation_config.eos_token_id = None
    base.config.eos_token_id = None
    model = LoRazorModel.from_pretrained(base, None, LoRazorConfig(
        max_loras=128, max_lora_rank=8, lora_target_modules=TARGETS, compile=args.compile))
    names = fill_random_adapters(model, 0, 128)
    engine = LoRazorEngine(model, max_num_seqs=256, max_num_batched_tokens=2048, num_kv_blocks=12000,
                           max_model_len=1024)
    captures = []
    real_capture = graph_module.capture_graph

    def timed_capture(step, pool, measure_memory=True):
        runs = []

        def timed_step():
            capturing = torch.cuda.is_current_stream_capturing()  # no sync inside a capture
            if not capturing:
                torch.cuda.synchronize()
            start = time.perf_counter()
            result = step()
            if not capturing:
                torch.cuda.synchronize()
            runs.append(round(time.perf_counter() - start, 4))
            return result

        start = time.perf_counter()
        out = real_capture(timed_step, pool, measure_memory)
        context = model.runner.context
        captures.append(dict(seconds=round(time.perf_counter() - start, 4), runs=runs,
                             key=[context.enabled, context.slot_bound]))
        return out

    graph_module.capture_graph = timed_capture
    profiler = cProfile.Profile() if args.cprofile else None
    start = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    captured = engine.warm_up()
    if profiler is not None:
        profiler.disable()
    seconds = time.perf_counter() - start
    graph_module.capture_graph = real_capture
    # Which bucket each capture was: the decode buckets first, then the token buckets, each over its keys.
    result = dict(environment=environment(), compile=args.compile, warm_up_s=round(seconds, 2), graphs=captured,
                  capture_s_sum=round(sum(c["seconds"] for c in captures), 2),
                  step_runs_s_sum=round(sum(sum(c["runs"]) for c in captures), 2), captures=captures,
                  cprofile=profiler is not None)
    if profiler is not None:
        result.update(cumulative=top_functions(profiler, "cumulative"), own=top_functions(profiler, "tottime"))
    print(json.dumps({k: v for k, v in result.items() if k not in ("captures", "cumulative", "own")}), flush=True)

    # One packed step of 8 x 256 prompt tokens, profiled by kernel.
    from torch.profiler import ProfilerActivity, profile

    vocab = base.config.vocab_size
    kernels = Counter()
    for rep in range(3):
        g = torch.Generator().manual_seed(rep)
        for i in range(8):
            engine.add_request(torch.randint(3, vocab, (256,), generator=g).tolist(), adapter=names[i * 16],
                               max_new_tokens=2, release="never", pad_token_id=0)
        torch.cuda.synchronize()
        if rep < 2:
            engine.step()
        else:
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.step()
                torch.cuda.synchronize()
            for event in prof.events():
                if event.device_type == torch.autograd.DeviceType.CUDA:
                    kernels[event.name[:90]] += event.device_time
        engine.abort_all()
        engine.step()
    total = sum(kernels.values())
    result["packed_step_gpu_ms"] = round(total / 1e3, 3)
    result["packed_step_kernels"] = [dict(name=n, ms=round(us / 1e3, 3), share=round(us / total, 3))
                                     for n, us in kernels.most_common(25)]
    print(json.dumps(dict(packed_step_gpu_ms=result["packed_step_gpu_ms"])), flush=True)
    name = f"warmup_profile{'_compiled' if args.compile else ''}{'_cprofile' if args.cprofile else ''}{args.tag}.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
