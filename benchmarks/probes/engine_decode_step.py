"""The engine's decode-only step at batch 256 with 128 adapters, through the public API only (so the
same probe runs against an older tree for an A/B: `ab_decode_step.sh`).

    python benchmarks/probes/engine_decode_step.py --out /tmp/probe [--tag _new]

256 requests (prompts of 64 random tokens, 128 random rank-8 adapters spread evenly, release never,
no EOS) are prefilled; then `--steps` decode-only `engine.step()` calls are timed one by one (wall
time, the step's one host sync included). Graphs are captured lazily (the first steps of each
shape are not timed). Prints and writes one JSON line: median and p90 step in ms.
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
from bench_e2e import TARGETS, build_base, fill_random_adapters  # noqa: E402
from common import environment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--tag", default="")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel

    base = build_base("llama-3.2-3b")
    base.generation_config.eos_token_id = None
    base.config.eos_token_id = None
    model = LoRazorModel.from_pretrained(base, None, LoRazorConfig(max_loras=args.adapters, max_lora_rank=8,
                                                                   lora_target_modules=TARGETS))
    names = fill_random_adapters(model, 0, args.adapters)
    engine = LoRazorEngine(model, max_num_seqs=args.batch, max_num_batched_tokens=2048, num_kv_blocks=8192,
                           max_model_len=1024)
    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(3, base.config.vocab_size, (64,), generator=g).tolist()
        engine.add_request(prompt, adapter=names[i % len(names)], max_new_tokens=args.steps + 40, release="never",
                           pad_token_id=0)
    # Prefill, then a few decode steps that capture the decode graph.
    while any(len(r.output) == 0 for r in engine.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t) * 1e3)
    times.sort()
    row = dict(environment(), probe="engine_decode_step", batch=args.batch, adapters=args.adapters,
               step_ms_median=round(statistics.median(times), 3), step_ms_p90=round(times[int(0.9 * len(times))], 3))
    print(json.dumps(row))
    (args.out / f"engine_decode_step{args.tag}.json").write_text(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
