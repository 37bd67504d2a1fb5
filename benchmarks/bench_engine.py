"""The serving engine on the GPU, measured as the paper does (Figs 4, 5, 6, 8, 10).

    python benchmarks/bench_engine.py --part exact --out benchmarks/results/engine
    python benchmarks/bench_engine.py --part full --out benchmarks/results/engine
    python benchmarks/bench_engine.py --render benchmarks/results/engine      # tables + plots
    python benchmarks/bench_engine.py --tiny --part exact --requests 16 --out /tmp/e   # CPU check of the logic

Llama-3.2-3B shape with random bf16 weights, 128 random rank-8 adapters on all 7 projections, the
workload of `engine_workload.py` (4096 requests in four task-like groups, EOS ignored). Engine:
the engine's default sequences and tokens per step (512 and 4096; `--max-num-seqs`,
`--max-num-batched-tokens`), chunked prefill, 32 GB of KV blocks, graphs captured before timing. Systems:
- lorazor: exact grid + StepTrim (profiled k per group, ~50% decode-LoRA skipping);
- exact: exact grid, no release (GridTrim only); full_release: full grid + release (StepTrim only);
- full: full grid, no release (the vLLM-style kernel grid); backbone: no adapters (the ceiling);
- static: `LoRazorModel.generate` in batches of max_num_seqs over the same requests (exact + release).
Offline throughput at 4..128 adapters (uniform), skewed traffic at 128, Poisson open loop. Part
`exact`: lorazor and exact at 128, backbone, static, the open loop for both, skewed, then lorazor and
exact at fewer adapters. Part `full`: full and full_release at 128, the open loop for full, skewed,
then full at fewer adapters and full_release at the fewest. Stages run in that order (the issue's
targets first) and `--deadline` skips the tail, listing what it skipped. To run only the sweep over
fewer adapters: `--adapters 4,8,16,32,64 --skip backbone,static,open,skewed`.
A part runs in one process (one grid's engine); rows go to `<out>/rows_<part>.jsonl`.

`--workload shared-prefix` measures the prefix cache instead (`engine_workload.build_shared_prefix`:
128 adapters, each with its own ~1,000-token system prompt, Zipf popularity): the same requests
offline with the cache on and off (req/s, TTFT, hit rate), then open loop at one rate (below the
cache-off engine's offline req/s) on and off, on one engine (its pool's cache switched off and
emptied between runs). `--cache-ab` adds LoRazor at the most adapters with the cache off to the
other workloads: what the cache costs on traces that share nothing. The KV pool is the engine's
own default (`gpu_memory_utilization`) unless `--kv-gb` sizes it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import engine_workload as wl  # noqa: E402
from common import environment  # noqa: E402

from lorazor.engine.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS  # noqa: E402

SEQS, TOKENS, BLOCK = DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS, 16  # the engine's defaults
MAX_MODEL_LEN = 1024
SHARED_PREFIX_MAX_LEN = 2048  # system prompt up to 1,200 + user part up to 300 + output up to 256


def setup(args):
    """(model, engine, adapter names, vocab size, engine shape): the Llama-3.2-3B shape with 128
    adapters on the GPU, or with `--tiny` a tiny model with 8 adapters wherever this runs."""
    from bench_e2e import TARGETS, build_base, fill_random_adapters

    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel

    if args.tiny:
        from transformers import AutoModelForCausalLM

        from lorazor.tiny import tiny_config

        base, adapters, seqs, tokens, max_len = AutoModelForCausalLM.from_config(tiny_config()).eval(), 8, 16, 128, 256
    else:
        shared = getattr(args, "workload", "mixed") == "shared-prefix"
        max_len = SHARED_PREFIX_MAX_LEN if shared else MAX_MODEL_LEN
        base, adapters, seqs, tokens = build_base("llama-3.2-3b"), 128, SEQS, TOKENS
    tokens = args.max_num_batched_tokens or tokens
    seqs = args.max_num_seqs or seqs
    base.generation_config.eos_token_id = None  # EOS ignored: each request runs its drawn length
    base.config.eos_token_id = None
    model = LoRazorModel.from_pretrained(base, None, LoRazorConfig(
        grid=args.part, max_loras=adapters, max_lora_rank=8, lora_target_modules=TARGETS, max_batch_size=seqs,
        max_cache_len=max_len, compile=args.compile, quantization=getattr(args, "quantization", None)))
    names = fill_random_adapters(model, 0, adapters)
    cfg = base.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * head_dim * 2
    # The engine's own pool size unless --kv-gb sizes it (the product's default is what users get).
    blocks = 2000 if args.tiny else None if args.kv_gb is None else int(args.kv_gb * 2**30 // per_block)
    engine = LoRazorEngine(model, max_num_seqs=seqs, max_num_batched_tokens=tokens, block_size=BLOCK,
                           num_kv_blocks=blocks, max_model_len=max_len,
                           enable_prefix_caching=getattr(args, "prefix_caching", True))
    return model, engine, names, cfg.vocab_size, dict(max_num_seqs=seqs, max_num_batched_tokens=tokens)


def offline_requests(workload, identities, names, ks, release: bool, backbone: bool = False):
    return [dict(prompt_ids=r.prompt, max_new_tokens=r.max_new_tokens, pad_token_id=0,
                 adapter=None if backbone else names[i], release=(ks[r.group] if release else "never"))
            for r, i in zip(workload, identities)]


def run_offline(engine, requests) -> dict:
    """The requests offline, from a cold prefix cache: the runs of one process replay the same
    prompts, and one run's blocks must not serve the next."""
    engine.pool.reset_cache()
    start = time.perf_counter()
    outs = engine.generate(requests)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    decode = sum(o.decode_steps for o in outs)
    lora = sum(o.lora_decode_steps for o in outs)
    return dict(requests=len(outs), seconds=elapsed, req_s=len(outs) / elapsed, out_tok_s=tokens / elapsed,
                skip=1 - lora / decode if decode else 0.0, preemptions=engine.scheduler.num_preemptions)


def run_static(model, workload, identities, names, ks, batch: int) -> dict:
    """`generate()` batches of `batch` in workload order: each batch runs to its longest request."""
    start = time.perf_counter()
    useful = 0
    for b in range(0, len(workload), batch):
        part = workload[b:b + batch]
        T = max(len(r.prompt) for r in part)
        ids = torch.zeros(len(part), T, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, r in enumerate(part):
            ids[i, T - len(r.prompt):] = torch.tensor(r.prompt)
            mask[i, T - len(r.prompt):] = 1
        model.generate(
            ids.to(model.device),
            attention_mask=mask.to(model.device),
            adapter_ids=[names[i] for i in identities[b : b + batch]],
            release=[ks[r.group] for r in part],
            max_new_tokens=max(r.max_new_tokens for r in part),
            do_sample=False,
            pad_token_id=0,
        )
        useful += sum(r.max_new_tokens for r in part)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return dict(requests=len(workload), seconds=elapsed, req_s=len(workload) / elapsed, out_tok_s=useful / elapsed)


def gap_summary(record, rows_path: Path) -> None:
    """Once lorazor, exact and the backbone have run at the most adapters: LoRazor against the
    backbone, and the share of the `exact` -> backbone gap that StepTrim's release closes."""
    rows = [json.loads(line) for line in rows_path.read_text().splitlines()]
    by = {r["system"]: r["req_s"] for r in rows if r["stage"] in ("offline", "backbone")}  # all at the most
    if {"lorazor", "exact", "backbone"} <= set(by):
        lorazor, exact, backbone = by["lorazor"], by["exact"], by["backbone"]
        record(stage="summary", system="lorazor", L=0, vs_backbone=lorazor / backbone,
               exact_vs_backbone=exact / backbone,
               gap_closed=(lorazor - exact) / (backbone - exact) if backbone != exact else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["exact", "full"], help="which grid's engine this process measures")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/engine"))
    ap.add_argument("--render", type=Path, help="write tables and plots from the rows in this folder")
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--adapters", default="4,8,16,32,64,128")
    ap.add_argument("--rates", default="25,50,75,100,125,150,200")
    ap.add_argument("--open-seconds", type=float, default=8.0, help="arrival window per open-loop rate")
    ap.add_argument("--ttft-slo", type=float, default=1.0, help="P90 TTFT (s) that defines the open-loop knee")
    ap.add_argument("--kv-gb", type=float, help="KV pool size (default: the engine's, from free GPU memory)")
    ap.add_argument("--cache-ab", action="store_true",
                    help="also run LoRazor at the most adapters with the prefix cache off (its cost on this trace; "
                         "with --workload shared-prefix: on the mixed trace, after the shared-prefix stages)")
    ap.add_argument("--cache-ab-requests", type=int, default=2048, help="the mixed trace's size for --cache-ab "
                                                                         "with --workload shared-prefix")
    ap.add_argument("--rate", type=float,
                    help="shared-prefix: the open-loop rate (default: 0.6 x the cache-off engine's offline req/s)")
    ap.add_argument("--skip", default="", help="comma-separated stages or systems to skip: "
                                                   "offline,skewed,open,static,backbone,lorazor,exact")
    ap.add_argument("--deadline", type=float, default=1e9, help="skip stages that would end later (s from start)")
    ap.add_argument(
        "--tag", default="", help="suffix of this run's rows and meta files (runs of one part side by side)"
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny random model on this machine (checks the logic)")
    ap.add_argument("--quantization", choices=("fp8",), help="fp8 base weights (LoRazorConfig(quantization=...))")
    ap.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                    help="LoRazorConfig.compile (default auto, the product's: compiled on a GPU, eager on the CPU)")
    ap.add_argument("--workload", choices=sorted(wl.SHAPES) + ["shared-prefix"], default="mixed",
                    help="request shape: the paper's mixed workload, decode-heavy (outputs ~3x longer, "
                         "release for >= 73%% of decode LoRA skipped), or shared-prefix (the prefix cache)")
    ap.add_argument("--max-num-batched-tokens", type=int,
                    help=f"the engine's tokens per step (default {TOKENS}; --tiny: 128); the sweep behind the default")
    ap.add_argument("--max-num-seqs", type=int,
                    help=f"the engine's running requests at most (default {SEQS}; --tiny: 16); the sweep behind it")
    args = ap.parse_args()
    if args.render:
        return render(args.render)
    skip = set(args.skip.split(","))
    args.out.mkdir(parents=True, exist_ok=True)
    rows_path = args.out / f"rows_{args.part}{args.tag}.jsonl"
    rows_path.write_text("")
    t0 = time.perf_counter()
    model, engine, names, vocab, shape = setup(args)
    captured = engine.warm_up()
    if args.workload == "shared-prefix":
        return shared_prefix(args, engine, names, vocab, rows_path, dict(
            environment(), part=args.part, workload=args.workload, graphs_captured=captured,
            kv_blocks=engine.pool.num_blocks, setup_s=time.perf_counter() - t0, compile=model.config.compile, **shape))
    workload = wl.build(args.requests, vocab, shape=args.workload)
    if args.tiny:  # a tiny model on the CPU: short prompts and outputs, same logic
        for r in workload:
            r.prompt, r.max_new_tokens = r.prompt[:16], min(r.max_new_tokens, 8)
    ks = wl.release_lengths(workload, wl.TARGET_SKIPS[args.workload])
    meta = dict(
        environment(),
        part=args.part,
        requests=len(workload),
        workload=args.workload,
        release_k=ks,
        planned_skip=wl.skip_fraction(workload, ks),
        graphs_captured=captured,
        capture_s=engine.graphs.total_capture_seconds if engine.graphs else 0.0,
        setup_s=time.perf_counter() - t0,
        kv_blocks=engine.pool.num_blocks,
        ttft_slo=args.ttft_slo,
        compile=model.config.compile,
        quantization=model.config.quantization,
        # dynamo's compiled entries per region: more than a handful means recompiles (warm-up time)
        compiles=model.runner.compiled_layers.compiles() if model.config.compile else None,
        **shape,
    )
    print(json.dumps(meta), flush=True)
    (args.out / f"meta_{args.part}{args.tag}.json").write_text(json.dumps(meta, indent=2))
    # Warm the eager prefill path (Triton compiles for the prefill tiles) outside the timings.
    engine.generate(offline_requests(workload[:64], wl.assign(workload[:64], 4), names, ks, True))

    def record(**row):
        row = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(row), flush=True)
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    # Stages in order of importance; one that would end past --deadline is skipped and says so.
    last = [60.0]  # seconds of the latest offline run: the estimate of the next

    def fits(stage: str, cost: float, what: str) -> bool:
        if stage in skip:
            return False
        if time.perf_counter() - t0 + cost > args.deadline:
            record(stage="skipped", system=what, L=0, reason=f"past the {args.deadline:.0f} s deadline")
            return False
        return True

    def offline(stage, system, L, identities, release=None, backbone=False):
        if system not in skip and fits(stage, last[0], f"{stage} {system} L={L}"):
            row = run_offline(engine, offline_requests(workload, identities, names, ks, release, backbone))
            last[0] = row["seconds"]
            record(stage=stage, system=system, L=L, **row)

    counts = [int(x) for x in args.adapters.split(",") if x]
    most = len(names)  # skewed traffic and the open loop use every adapter identity
    rates = [float(x) for x in args.rates.split(",")]

    def open_loop(system, release):
        """Rates in increasing order until P90 TTFT is far past the SLO (the knee is behind us)."""
        requests = offline_requests(workload, wl.assign(workload, most), names, ks, release)
        for rate in rates:
            if fits("open", args.open_seconds + 5, f"open {system} {rate:.0f} req/s"):
                offsets = wl.poisson_arrivals(rate, args.open_seconds, seed=int(rate))
                row = wl.run_open_loop(engine, requests[:len(offsets)], offsets)
                record(stage="open", system=system, L=most, rate=rate, **row)
                if row["ttft_p90"] > 3 * args.ttft_slo:
                    break

    # Stages in order of the targets: everything at the most adapters first, then the open
    # loop, skewed traffic, and the sweep over fewer adapters; --deadline cuts the tail.
    uniform = wl.assign(workload, most)
    skewed = wl.assign(workload, most, skewed=True)
    fewer = [L for L in counts if L != most]
    at_most = most in counts  # without it in --adapters: only the sweep over fewer adapters
    if args.part == "exact":
        if at_most:
            offline("offline", "lorazor", most, uniform, release=True)
            offline("offline", "exact", most, uniform, release=False)
            if args.cache_ab:
                with cache_off(engine):
                    offline("offline", "lorazor_nocache", most, uniform, release=True)
        offline("backbone", "backbone", 0, [0] * len(workload), backbone=True)
        gap_summary(record, rows_path)
        if fits("static", 1.5 * last[0], "static generate"):  # the model is on the exact grid already
            run_static(model, workload[:shape["max_num_seqs"]], uniform, names, ks, shape["max_num_seqs"])  # warm-up
            record(stage="offline", system="static", L=most,
                   **run_static(model, workload, uniform, names, ks, shape["max_num_seqs"]))
        open_loop("lorazor", True)
        open_loop("exact", False)
        offline("skewed", "lorazor", most, skewed, release=True)
        offline("skewed", "exact", most, skewed, release=False)
        for L in fewer:
            identities = wl.assign(workload, L)
            offline("offline", "lorazor", L, identities, release=True)
            offline("offline", "exact", L, identities, release=False)
    else:
        if at_most:
            offline("offline", "full", most, uniform, release=False)
            offline("offline", "full_release", most, uniform, release=True)
        open_loop("full", False)
        offline("skewed", "full", most, skewed, release=False)
        offline("skewed", "full_release", most, skewed, release=True)
        for L in fewer:
            offline("offline", "full", L, wl.assign(workload, L), release=False)
        if fewer:
            offline("offline", "full_release", fewer[0], wl.assign(workload, fewer[0]), release=True)
    print(f"part {args.part} done in {time.perf_counter() - t0:.0f} s", flush=True)


class cache_off:
    """`with cache_off(engine):` its prefix cache switched off and emptied; on again afterwards."""

    def __init__(self, engine):
        self.pool = engine.pool

    def __enter__(self):
        self.pool.reset_cache()
        self.pool.enable_caching = False

    def __exit__(self, *exc):
        self.pool.enable_caching = True


def shared_prefix(args, engine, names, vocab, rows_path: Path, meta: dict) -> None:
    """The prefix cache's trace: offline with the cache on and off, then open loop at one rate."""
    count = min(len(names), 128)
    workload, identities = wl.build_shared_prefix(args.requests, vocab, count)
    if args.tiny:  # a tiny model on the CPU: short prompts and outputs, the same sharing
        for r in workload:
            r.prompt, r.max_new_tokens = r.prompt[:24] + r.prompt[-8:], min(r.max_new_tokens, 8)
    requests = [dict(prompt_ids=r.prompt, max_new_tokens=r.max_new_tokens, pad_token_id=0, adapter=names[i])
                for r, i in zip(workload, identities)]
    meta.update(requests=len(requests), adapters=count,
                prompt_mean=sum(len(r.prompt) for r in workload) / len(workload),
                output_mean=sum(r.max_new_tokens for r in workload) / len(workload))
    print(json.dumps(meta), flush=True)
    (args.out / f"meta_{args.part}{args.tag}.json").write_text(json.dumps(meta, indent=2))
    with cache_off(engine):  # warm the prefill path's kernels outside the timings
        engine.generate(requests[:32])

    def record(**row):
        row = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in row.items()}
        print(json.dumps(row), flush=True)
        with rows_path.open("a") as f:
            f.write(json.dumps(row) + "\n")

    def offline(system):
        pool = engine.pool
        queries, hits = pool.queries, pool.hits
        start = time.perf_counter()
        outs = engine.generate(requests)
        row = dict(requests=len(outs), seconds=time.perf_counter() - start,
                   **wl.percentiles([o.ttft for o in outs], (50, 90)))
        row.update(req_s=len(outs) / row["seconds"], out_tok_s=sum(o.num_tokens for o in outs) / row["seconds"],
                   hit_rate=(pool.hits - hits) / max(pool.queries - queries, 1),
                   cached_tokens_mean=sum(o.num_cached_tokens for o in outs) / len(outs))
        record(stage="shared_prefix", system=system, L=count, **{("ttft_" + k if k.startswith("p") else k): v
                                                                  for k, v in row.items()})
        return row

    on = offline("cache_on")
    with cache_off(engine):
        off = offline("cache_off")
    rate = args.rate or 0.6 * off["req_s"]
    offsets = wl.poisson_arrivals(rate, args.open_seconds, seed=1)
    loops = {}
    for system in ("cache_on", "cache_off"):
        engine.pool.reset_cache()  # each open loop starts from an empty cache
        if system == "cache_off":
            with cache_off(engine):
                loops[system] = wl.run_open_loop(engine, requests[:len(offsets)], offsets)
        else:
            loops[system] = wl.run_open_loop(engine, requests[:len(offsets)], offsets)
        record(stage="shared_prefix_open", system=system, L=count, rate=rate, **loops[system])
    record(stage="summary", system="prefix_cache", L=count, req_s_ratio=on["req_s"] / off["req_s"],
           offline_ttft_p50_ratio=off["p50"] / on["p50"], hit_rate=on["hit_rate"], open_rate=rate,
           open_ttft_p50_ratio=loops["cache_off"]["ttft_p50"] / loops["cache_on"]["ttft_p50"],
           open_ttft_p90_ratio=loops["cache_off"]["ttft_p90"] / loops["cache_on"]["ttft_p90"])
    if args.cache_ab:  # the mixed trace (no sharing) on the same engine: what the cache costs there
        mixed = wl.build(args.cache_ab_requests, vocab)
        ks = wl.release_lengths(mixed)
        plain = offline_requests(mixed, wl.assign(mixed, count), names, ks, release=True)
        if args.tiny:
            for r in plain:
                r["prompt_ids"], r["max_new_tokens"] = r["prompt_ids"][:16], min(r["max_new_tokens"], 8)
        runs = {}
        for system in ("lorazor", "lorazor_nocache", "lorazor"):  # on, off, on again (the spread)
            engine.pool.reset_cache()
            if system == "lorazor_nocache":
                with cache_off(engine):
                    row = run_offline(engine, plain)
            else:
                row = run_offline(engine, plain)
            runs.setdefault(system, []).append(row["req_s"])
            record(stage="cache_ab", system=system, L=count, **row)
        record(stage="summary", system="cache_cost", L=count,
               on_vs_off=max(runs["lorazor"]) / runs["lorazor_nocache"][0],
               on_spread=abs(runs["lorazor"][0] - runs["lorazor"][1]) / max(runs["lorazor"]))


SYSTEMS = ["lorazor", "exact", "full_release", "full", "backbone", "static"]


def render(folder: Path) -> None:
    """Tables (markdown) and, with matplotlib installed (the `bench` extra), plots from every
    `rows_*.jsonl` in `folder`."""
    rows = [json.loads(line) for path in sorted(folder.glob("rows_*.jsonl")) for line in path.read_text().splitlines()
            if line.strip()]
    metas = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("meta_*.json"))}
    offline = [r for r in rows if r["stage"] in ("offline", "backbone")]
    counts = sorted({r["L"] for r in offline if r["L"] > 0})
    get = lambda stage, system, L: next((r for r in rows if r["stage"] == stage and r["system"] == system  # noqa: E731
                                         and r["L"] == L), None)
    lines = ["# Engine benchmark", "", "Llama-3.2-3B shape, random weights, 128 rank-8 adapters (tiny model with 8 "
             "adapters for CPU runs); the machine and versions per part:", ""]
    for name, meta in metas.items():
        keep = ("commit", "gpu", "torch", "triton", "transformers", "requests", "release_k", "planned_skip",
                "graphs_captured", "capture_s", "kv_blocks")
        lines.append(f"- {name}: " + ", ".join(f"{k}={meta.get(k)}" for k in keep))
    lines += ["", "## Offline throughput, uniform traffic (requests/s; output tok/s in brackets)", "",
              "| adapters | " + " | ".join(SYSTEMS[:4]) + " | lorazor / full |", "|---" * 6 + "|"]
    for L in counts:
        cells = []
        for system in SYSTEMS[:4]:
            r = get("offline", system, L)
            cells.append("-" if r is None else f"{r['req_s']:.2f} ({r['out_tok_s']:.0f}; skip {r['skip']:.2f})")
        lo, full = get("offline", "lorazor", L), get("offline", "full", L)
        ratio = f"{lo['req_s'] / full['req_s']:.2f}x" if lo and full else "-"
        lines.append(f"| {L} | " + " | ".join(cells) + f" | {ratio} |")
    for system in ("backbone", "static"):
        r = next((r for r in offline if r["system"] == system), None)
        if r:
            lines.append(f"\n{system}: {r['req_s']:.2f} req/s, {r['out_tok_s']:.0f} output tok/s "
                         f"({r['seconds']:.1f} s for {r['requests']} requests)")
    lines += ["", "## Skewed traffic over every adapter (at 128: 24 identities take ~80% of requests)", "",
              "| system | req/s | output tok/s | skip |", "|---|---|---|---|"]
    for system in SYSTEMS[:4]:
        r = next((r for r in rows if r["stage"] == "skewed" and r["system"] == system), None)
        if r:
            lines.append(f"| {system} | {r['req_s']:.2f} | {r['out_tok_s']:.0f} | {r['skip']:.2f} |")
    open_rows = [r for r in rows if r["stage"] == "open"]
    lines += ["", "## Open loop, Poisson arrivals, every adapter (seconds)", "",
              "| system | offered req/s | achieved req/s | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |",
              "|---|---|---|---|---|---|---|"]
    for r in open_rows:
        lines.append(f"| {r['system']} | {r['rate']:.0f} | {r['achieved_req_s']:.1f} | {r['ttft_p50']:.3f} | "
                     f"{r['ttft_p90']:.3f} | {r['tpot_p50']:.4f} | {r['tpot_p90']:.4f} |")
    lines += targets(rows, offline, open_rows, max(counts, default=0),
                     next((m["ttft_slo"] for m in metas.values() if "ttft_slo" in m), 1.0))
    ran = {f"{r['stage']} {r['system']} L={r['L']}" for r in rows if r["stage"] != "skipped"}
    skipped = [r for r in rows if r["stage"] == "skipped" and r["system"] not in ran]  # a later run may have it
    if skipped:
        from collections import Counter

        counts_by = Counter(r["system"] for r in skipped)
        lines += ["", "Not run (past the run's deadline): " + ", ".join(
            f"{name} x{n}" if n > 1 else name for name, n in counts_by.items())]
    (folder / "engine.md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): tables only")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for system in SYSTEMS[:4]:
        pts = [(L, get("offline", system, L)["req_s"]) for L in counts if get("offline", system, L)]
        if pts:
            axes[0].plot(*zip(*pts), marker="o", label=system)
    for system, style in (("backbone", "--"), ("static", ":")):
        r = next((r for r in offline if r["system"] == system), None)
        if r:
            axes[0].axhline(r["req_s"], linestyle=style, color="gray", label=system)
    axes[0].set(xscale="log", xlabel="adapters", ylabel="requests/s", title="offline, uniform")
    axes[0].set_xticks(counts, [str(c) for c in counts])
    axes[0].legend(fontsize=8)
    for system in sorted({r["system"] for r in open_rows}):
        pts = sorted((r["rate"], r["ttft_p90"], r["tpot_p90"]) for r in open_rows if r["system"] == system)
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=system)
        axes[2].plot([p[0] for p in pts], [p[2] * 1e3 for p in pts], marker="o", label=system)
    axes[1].set(xlabel="offered req/s", ylabel="P90 TTFT (s)", yscale="log", title="open loop")
    axes[2].set(xlabel="offered req/s", ylabel="P90 TPOT (ms)", title="open loop")
    for ax in axes[1:]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / "engine.png", dpi=120)
    plot_workload(folder / "workload.png", next(iter(metas.values()))["requests"] if metas else 4096)


def targets(rows, offline, open_rows, most: int, slo: float) -> list[str]:
    """The issue's targets as ratios within this run, where both sides ran."""
    req_s = {r["system"]: r["req_s"] for r in offline if r["L"] in (most, 0)}
    knees = {system: wl.knee([(r["rate"], r["ttft_p90"]) for r in open_rows if r["system"] == system], slo)
             for system in sorted({r["system"] for r in open_rows})}
    checks = [
        ("lorazor / backbone", "lorazor", "backbone", 0.90),
        ("exact / backbone", "exact", "backbone", 0.75),
        ("lorazor / full", "lorazor", "full", 1.5),
        ("lorazor engine / static generate", "lorazor", "static", 1.5),
    ]
    lines = ["", f"## Targets at {most} adapters (ratios within this run)", "", "| ratio | value | target | met |",
             "|---|---|---|---|"]
    for label, a, b, target in checks:
        if a in req_s and b in req_s:
            value = req_s[a] / req_s[b]
            lines.append(f"| {label} (req/s) | {value:.2f} | >= {target} | {'yes' if value >= target else 'no'} |")
    if "lorazor" in knees and "full" in knees:
        (ka, ca), (kb, cb) = knees["lorazor"], knees["full"]
        value = ka / kb if kb else float("nan")
        bound = "" if ca and cb else " (a knee not crossed: bound only)"
        met = "not determined" if bound else "yes" if value >= 1.5 else "no"
        lines.append(f"| lorazor knee / full knee (P90 TTFT {slo:g} s) | {value:.2f}{bound} | >= 1.5 | {met} |")
    if knees:
        lines += ["", "Knees (offered req/s where P90 TTFT crosses {:g} s; + = not crossed): ".format(slo) + ", ".join(
            f"{system} {k:.1f}{'' if crossed else '+'}" for system, (k, crossed) in knees.items())]
    return lines


def plot_workload(path: Path, num_requests: int) -> None:
    """Prompt and output length histograms per group (the workload is rebuilt from its seed)."""
    import matplotlib.pyplot as plt

    workload = wl.build(num_requests, 128256)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for group in wl.GROUPS:
        axes[0].hist([len(r.prompt) for r in workload if r.group == group], bins=40, histtype="step", label=group)
        axes[1].hist([r.max_new_tokens for r in workload if r.group == group], bins=40, histtype="step", label=group)
    axes[0].set(xlabel="prompt tokens", ylabel="requests")
    axes[1].set(xlabel="output tokens", ylabel="requests")
    axes[1].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
