"""Probe: the engine's host time over a whole bench_engine trace, with the model's forward stubbed (CPU).

    python benchmarks/probes/host_trace.py --out /tmp/probe [--requests 4096] [--workload mixed] [--profile]
        [--max-num-seqs 256] [--max-num-batched-tokens 2048] [--tag _1024]

`bench_engine.py`'s workload and engine shape (256 sequences, 2048 tokens per step, 16-token blocks,
128 rank-8 adapters, `exact` + StepTrim), on a tiny Llama whose `run_paged_step` returns fixed logits
at once. What is timed is everything the engine does on the host for the trace: `add_request` (HF's
generation config and processors per request), scheduling, block tables, inputs, adapter loads,
the device picks (here on the CPU), the read-back, stop checks and outputs. On a GPU with async
scheduling this work overlaps the steps; a trace whose host time nears its GPU time is host-bound.
Writes `host_trace[_<workload>].json`: total host seconds, split into adding requests and
stepping, steps by kind, and with `--profile` the top functions by cumulative time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
import engine_workload as wl  # noqa: E402
from bench_engine import BLOCK, MAX_MODEL_LEN, SEQS, TOKENS, offline_requests  # noqa: E402
from common import environment  # noqa: E402
from host_step import stub_paged_steps  # noqa: E402


def build_engine(adapters: int, seqs: int = SEQS, tokens: int = TOKENS):
    from bench_e2e import TARGETS, fill_random_adapters
    from transformers import LlamaConfig, LlamaForCausalLM

    from lorazor import LoRazorConfig, LoRazorEngine, LoRazorModel

    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_MODEL_LEN)
    base = LlamaForCausalLM(config).eval()
    base.generation_config.eos_token_id = None
    base.config.eos_token_id = None
    model = LoRazorModel.from_pretrained(base, None, LoRazorConfig(
        grid="exact", max_loras=adapters, max_lora_rank=8, lora_target_modules=TARGETS, max_batch_size=seqs,
        max_cache_len=MAX_MODEL_LEN))
    names = fill_random_adapters(model, 0, adapters)

    stub_paged_steps(config)
    engine = LoRazorEngine(model, max_num_seqs=seqs, max_num_batched_tokens=tokens, block_size=BLOCK,
                           num_kv_blocks=seqs * MAX_MODEL_LEN // BLOCK + 64, max_model_len=MAX_MODEL_LEN,
                           async_scheduling=False)
    return engine, names, config.vocab_size


def record_steps(engine) -> list[tuple[int, int, int]]:
    """Wraps the scheduler: (decode rows, prefill tokens, running requests) of every scheduled step.
    A decode row is a one-token chunk past its prompt; every other token (prompt chunks, and decode
    positions recomputed after a preemption) counts as prefill."""
    steps = []
    schedule = engine.scheduler.schedule

    def recorded(*args, **kwargs):
        chunks = schedule(*args, **kwargs)
        if chunks:
            decode = sum(1 for c in chunks if c.num_tokens == 1 and c.start >= len(c.request.prompt))
            steps.append((decode, sum(c.num_tokens for c in chunks) - decode, len(engine.scheduler.running)))
        return chunks

    engine.scheduler.schedule = recorded
    return steps


def composition(steps: list[tuple[int, int, int]], seats: int) -> dict:
    """What the trace's steps hold: how many are decode-only, their mean decode rows, prefill tokens
    and running requests, the share of steps with every seat taken, and steps per 256-token bucket."""
    with_prefill = [s for s in steps if s[1]]
    buckets: dict[int, int] = {}
    for decode, prefill, _ in steps:
        bucket = -(-(decode + prefill) // 256) * 256
        buckets[bucket] = buckets.get(bucket, 0) + 1
    mean = lambda values: round(statistics.fmean(values), 1) if values else 0.0  # noqa: E731
    return dict(steps=len(steps), decode_only=len(steps) - len(with_prefill), with_prefill=len(with_prefill),
                decode_rows_mean=mean([s[0] for s in steps]), prefill_tokens_mean=mean([s[1] for s in steps]),
                tokens_mean=mean([s[0] + s[1] for s in steps]), running_mean=mean([s[2] for s in steps]),
                full_share=round(sum(s[2] >= seats for s in steps) / len(steps), 3),
                steps_by_token_bucket=dict(sorted(buckets.items())),
                decode_tokens=sum(s[0] for s in steps), prefill_tokens=sum(s[1] for s in steps))


def trace_arguments() -> argparse.ArgumentParser:
    """The arguments of a probe over bench_engine's trace (this one's and `adapter_bytes.py`'s)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/probe"))
    ap.add_argument("--requests", type=int, default=4096)
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--workload", choices=sorted(wl.SHAPES), default="mixed")
    ap.add_argument("--max-num-seqs", type=int, default=SEQS)
    ap.add_argument("--max-num-batched-tokens", type=int, default=TOKENS)
    ap.add_argument("--tag", default="", help="appended to the result's file name")
    return ap


def trace_engine(args):
    """The stubbed engine and bench_engine's requests (StepTrim's release lengths) for `args`."""
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    engine, names, vocab = build_engine(args.adapters, args.max_num_seqs, args.max_num_batched_tokens)
    workload = wl.build(args.requests, vocab, shape=args.workload)
    ks = wl.release_lengths(workload, wl.TARGET_SKIPS[args.workload])
    return engine, offline_requests(workload, wl.assign(workload, len(names)), names, ks, True)


def main() -> None:
    ap = trace_arguments()
    ap.add_argument("--profile", action="store_true", help="cProfile the stepping; top functions in the JSON")
    args = ap.parse_args()
    engine, requests = trace_engine(args)

    start = time.perf_counter()
    for request in requests:
        engine.add_request(**request)
    add_s = time.perf_counter() - start
    steps = record_steps(engine)
    profiler = cProfile.Profile() if args.profile else None
    walls = []
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t)
    step_s = time.perf_counter() - start
    if profiler:
        profiler.disable()
    top = None
    if profiler:
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
        top = text.getvalue().splitlines()
    result = dict(environment=environment(), workload=args.workload, requests=len(requests), adapters=args.adapters,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  add_requests_s=round(add_s, 3), add_request_ms=round(1e3 * add_s / len(requests), 3),
                  steps=len(walls), step_s=round(step_s, 3), step_ms_median=round(1e3 * statistics.median(walls), 3),
                  step_ms_mean=round(1e3 * step_s / len(walls), 3), host_s=round(add_s + step_s, 3),
                  composition=composition(steps, args.max_num_seqs), profiled=args.profile, top=top)
    print(json.dumps({k: v for k, v in result.items() if k != "top"}, indent=1), flush=True)
    if top:
        print("\n".join(top))
    name = "host_trace" + ("" if args.workload == "mixed" else f"_{args.workload}") + f"{args.tag}.json"
    (args.out / name).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
