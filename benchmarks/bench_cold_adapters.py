"""A cold adapter's first token: 1,000 adapters on disk, Zipf popularity, open-loop arrivals (issue #56).

    python benchmarks/bench_cold_adapters.py --out benchmarks/results/cold_adapters [--tiny]

Llama-3.2-3B shape with random bf16 weights (as bench_e2e.py), `--adapters` rank-8 PEFT folders on
`--targets` (q_proj, v_proj by default: 3.3 MB each; `bench_adapters.py` writes 8 distinct weight
files and hard-links the rest, so a "disk" read comes from the page cache), all registered. The
engine at its defaults except `--max-loras` 32 GPU slots and `--max-cpu-loras` 128 host copies.
`--requests` requests (prompts of 128 random tokens, 64 new tokens, EOS ignored) name adapters by
Zipf(`--zipf`) popularity and arrive as a Poisson process at `--rate` req/s. Each request is
classed by where its adapter was when it arrived: "gpu" (in a slot), "cpu" (a host copy) or "disk".
Then the same trace on an engine whose slots hold every adapter the trace names, all loaded before
it starts (the resident baseline). Reports TTFT P50/P90/P99 per class and req/s, the copy floor of
one adapter (its bytes over the pinned host-to-GPU bandwidth), and the target: cold P90 TTFT <= 2x
the resident P90 plus the copy floor. `--tiny`: a tiny random model on this machine (checks the
logic, CPU). Writes `cold_adapters.json` and `cold_adapters.md`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_workload as wl  # noqa: E402
from bench_adapters import write_folders  # noqa: E402
from common import environment  # noqa: E402


def base_model(tiny: bool):
    if tiny:
        from transformers import AutoModelForCausalLM

        from lorazor.tiny import tiny_config

        return AutoModelForCausalLM.from_config(tiny_config()).eval()
    from bench_e2e import build_base

    return build_base("llama-3.2-3b")


def trace(args, vocab: int) -> tuple[list[dict], np.ndarray]:
    rng = np.random.default_rng(0)
    popularity = 1.0 / np.arange(1, args.adapters + 1) ** args.zipf
    picks = rng.choice(args.adapters, size=args.requests, p=popularity / popularity.sum())
    prompt, new = (16, 8) if args.tiny else (128, 64)
    requests = [dict(prompt_ids=rng.integers(3, vocab, prompt).tolist(), adapter=f"a{i:04d}", max_new_tokens=new,
                     pad_token_id=0, eos_token_id=None) for i in picks]
    offsets = np.sort(rng.uniform(0, args.requests / args.rate, args.requests))  # Poisson: uniform order stats
    return requests, offsets


def run(engine, requests, offsets) -> tuple[dict, list]:
    """The open loop of `engine_workload.run_open_loop`, each request classed at arrival."""
    registry = engine.model.registry
    start = time.monotonic()
    classes, outs, i = {}, [], 0
    while i < len(requests) or engine.has_unfinished():
        now = time.monotonic()
        while i < len(requests) and start + offsets[i] <= now:
            where = registry.status(requests[i]["adapter"]).location
            rid = engine.add_request(arrival_time=start + offsets[i], **requests[i])
            classes[rid] = {"gpu": "gpu", "host": "cpu", "disk": "disk"}[where]
            i += 1
        if not engine.has_unfinished():
            time.sleep(max(start + offsets[i] - time.monotonic(), 0))
            continue
        outs.extend(o for o in engine.step() if o.finished)
    summary = wl.summarize(outs, start)
    by_class = {}
    for name in ("gpu", "cpu", "disk"):
        ttfts = [o.ttft for o in outs if classes[o.request_id] == name]
        by_class[name] = dict(requests=len(ttfts), **{f"ttft_{k}": v for k, v in wl.percentiles(ttfts).items()})
    return dict(summary, by_class=by_class), outs


def build(args, base, folders, slots: int, cpu: int | None):
    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel

    model = LoRazorModel.from_pretrained(base, None, LoRazorConfig(
        max_loras=slots, max_cpu_loras=cpu, max_lora_rank=8, lora_target_modules=tuple(args.targets.split(","))))
    start = time.perf_counter()
    for folder in folders:
        model.register_adapter(folder.name, folder)
    registration_s = time.perf_counter() - start
    engine = LoRazorEngine(model, **({"max_num_seqs": 16, "max_num_batched_tokens": 128, "num_kv_blocks": 512}
                                     if args.tiny else {}))
    engine.warm_up()
    return engine, registration_s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/cold_adapters"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--adapters", type=int, default=1000)
    ap.add_argument("--targets", default="q_proj,v_proj")
    ap.add_argument("--max-loras", type=int, default=32)
    ap.add_argument("--max-cpu-loras", type=int, default=128)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rate", type=float, default=20.0, help="offered req/s")
    ap.add_argument("--zipf", type=float, default=1.1)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    base = base_model(args.tiny)
    vocab = base.config.vocab_size
    requests, offsets = trace(args, vocab)
    named = sorted({r["adapter"] for r in requests})
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = write_folders(base, Path(tmp), args.adapters, targets=tuple(args.targets.split(",")))
        engine, registration_s = build(args, base, folders, args.max_loras, args.max_cpu_loras)
        image = engine.model.registry.bank.storage[0]
        slot_bytes = image.numel() * image.element_size()
        rows["cold"], _ = run(engine, requests, offsets)
        rows["cold"].update(registration_s=round(registration_s, 2), loads=engine.adapter_loads)
        del engine
        base = base_model(args.tiny)
        engine, _ = build(args, base, [f for f in folders if f.name in named], len(named), None)
        for i in range(0, len(named), engine.model.bank.num_slots):
            engine.model.registry.make_resident(named[i:i + engine.model.bank.num_slots])
        rows["resident"], _ = run(engine, requests, offsets)
    floor_s = 0.0
    if torch.cuda.is_available():
        from bench_adapters import copy_floor_gbs

        floor_s = slot_bytes / (copy_floor_gbs() * 1e9)
    cold_p90 = rows["cold"]["by_class"]["disk"]["ttft_p90"]
    resident_p90 = rows["resident"]["ttft_p90"]
    result = dict(environment(), args=vars(args) | {"out": str(args.out)}, adapters_named=len(named),
                  slot_mb=round(slot_bytes / 1e6, 2), copy_floor_ms=round(floor_s * 1e3, 3), rows=rows,
                  target=dict(cold_p90_s=cold_p90, bound_s=2 * resident_p90 + floor_s,
                              met=bool(cold_p90 <= 2 * resident_p90 + floor_s)))
    print(json.dumps(result, indent=1, default=str), flush=True)
    (args.out / "cold_adapters.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    lines = ["| trace | class | requests | TTFT P50 | P90 | P99 | req/s |", "|---|---|---|---|---|---|---|"]
    for trace_name, row in rows.items():
        for name, c in row["by_class"].items():
            if c["requests"]:
                lines.append(f"| {trace_name} | {name} | {c['requests']} | {c['ttft_p50']:.3f} s | "
                             f"{c['ttft_p90']:.3f} s | {c['ttft_p99']:.3f} s | {row['achieved_req_s']:.1f} |")
    (args.out / "cold_adapters.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
