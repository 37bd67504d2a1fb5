"""Probe: how many adapters each step of a bench_engine trace must read, and the trace's floor against
its backbone's (CPU; the real scheduler, the model's forward stubbed).

    python benchmarks/probes/adapter_bytes.py --out /tmp/probe [--workload mixed|decode-heavy]
        [--requests 4096] [--max-num-seqs 512] [--max-num-batched-tokens 4096]
        [--read-tb-s 4.235 --matmul-tflops 778.5] [--tag _h100_assumed]

A LoRA step reads every adapter that at least one of its rows applies, whole: rank-8 A and B of 7
projections in 28 layers, 24.3 MB for the Llama-3.2-3B shape. StepTrim takes a released row out of
the LoRA kernels, but an adapter's bytes leave the step only when all of its rows in that step have
released. This probe schedules `bench_engine.py`'s trace (`host_trace.py`'s engine: the engine's
default shape, 128 adapters, its release lengths) and records, per step, the adapters with a LoRA
row for LoRazor (StepTrim: prefill always, decode forward d while d < the request's release length)
and for `exact` without release (every adapter row). Each step's floor is the roofline of
`step_roofline.py`: its GEMMs at the larger of the weights' read time and their FLOPs, plus its KV
and adapter bytes at the read bandwidth (by default the H200's measured 4.235 TB/s and 778.5 TFLOPS,
`../results/step_roofline_h200/`; other rates move where the GEMMs turn compute-bound). The sums
over the trace bound what LoRazor can reach against its backbone if every step ran at its floor.

A second floor adds the activations a LoRA token moves when LoRA runs beside the base GEMMs rather
than inside them: each merged projection group's shrink reads its input row and its expand reads
and writes its output row (q/k/v and gate/up merged, as LoRazor's kernels run them), 4.07 MB per
token for this shape. Writes `adapter_bytes_<workload><tag>.json`.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


sys.path[:0] = [str(Path(__file__).parent.parent), str(Path(__file__).parent)]  # benchmarks/, probes/
from common import SHAPES, environment, projections  # noqa: E402
from host_trace import trace_arguments, trace_engine  # noqa: E402

RANK = 8
BYTES = 2  # bf16


def model_sizes(shape: dict) -> dict:
    """Bytes the Llama-3.2-3B shape reads per step: weights (the tied embedding once, as the LM
    head), one adapter, KV per token; GEMM FLOPs per token (layers) and per logits row (LM head)."""
    layer = sum(k * n for k, n in projections(shape).values())
    head = shape["hidden"] * shape["vocab"]
    return dict(weight_bytes=(shape["layers"] * layer + head) * BYTES,
                adapter_bytes=shape["layers"] * sum(RANK * (k + n) for k, n in projections(shape).values()) * BYTES,
                kv_bytes_per_token=shape["layers"] * 2 * shape["kv_heads"] * shape["head_dim"] * BYTES,
                lora_activation_bytes_per_token=shape["layers"] * BYTES * lora_activations(shape),
                flops_per_token=2 * shape["layers"] * layer, flops_per_logits_row=2 * head)


def lora_activations(shape: dict) -> int:
    """Elements one LoRA token reads and writes per layer beside the base GEMMs: the input of each
    merged group's shrink (q/k/v, o, gate/up, down) and its expand's output, read and written."""
    p = projections(shape)
    groups = [("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",)]
    return sum(p[g[0]][0] + 2 * sum(p[name][1] for name in g) for g in groups)


def record_steps(engine, release_of) -> list[dict]:
    """Wraps the scheduler: per scheduled step, its tokens, logits rows, KV tokens read, and the
    adapters with a LoRA row with StepTrim (`release_of(request)`: its release length) and without."""
    steps = []
    schedule = engine.scheduler.schedule

    def recorded(*args, **kwargs):
        chunks = schedule(*args, **kwargs)
        if chunks:
            lorazor, exact = set(), set()
            tokens = dict(lorazor=0, exact=0)
            for c in chunks:
                request = c.request
                if request.adapter is None:
                    continue
                exact.add(request.adapter)
                tokens["exact"] += c.num_tokens
                decode = c.start - len(request.prompt)  # < 0: a prompt chunk, which always applies LoRA
                k = release_of(request)
                if decode < 0 or not isinstance(k, int) or decode < k:
                    lorazor.add(request.adapter)
                    tokens["lorazor"] += c.num_tokens
            steps.append(dict(tokens=sum(c.num_tokens for c in chunks), rows=len(chunks),
                              kv_tokens=sum(c.start + c.num_tokens for c in chunks),
                              lorazor=len(lorazor), exact=len(exact), lora_tokens=tokens))
        return chunks

    engine.scheduler.schedule = recorded
    return steps


def floor_seconds(step: dict, sizes: dict, system: str, bandwidth: float, flops: float, activations: bool) -> float:
    """The step's roofline for `system` (backbone, exact or lorazor); `activations`: with the LoRA
    tokens' activation traffic beside the base GEMMs."""
    gemm = max(sizes["weight_bytes"] / bandwidth,
               (step["tokens"] * sizes["flops_per_token"] + step["rows"] * sizes["flops_per_logits_row"]) / flops)
    lora = 0 if system == "backbone" else step[system] * sizes["adapter_bytes"]
    if activations and system != "backbone":
        lora += step["lora_tokens"][system] * sizes["lora_activation_bytes_per_token"]
    return gemm + (step["kv_tokens"] * sizes["kv_bytes_per_token"] + lora) / bandwidth


def main() -> None:
    ap = trace_arguments()
    ap.add_argument("--read-tb-s", type=float, default=4.235, help="read bandwidth of the floors (H200, measured)")
    ap.add_argument("--matmul-tflops", type=float, default=778.5, help="bf16 matmul rate of the floors (H200)")
    args = ap.parse_args()
    engine, requests = trace_engine(args)
    release = {}
    for request in requests:
        release[engine.add_request(**request)] = request["release"]
    steps = record_steps(engine, lambda r: release[r.request_id])
    while engine.has_unfinished():
        engine.step()

    sizes = model_sizes(SHAPES["llama-3.2-3b"])
    bw, fl = args.read_tb_s * 1e12, args.matmul_tflops * 1e12
    floors, vs_backbone, gap_closed = {}, {}, {}
    for name, activations in (("adapter_bytes", False), ("with_lora_activations", True)):
        f = {system: sum(floor_seconds(s, sizes, system, bw, fl, activations) for s in steps)
             for system in ("backbone", "exact", "lorazor")}
        floors[name] = {k: round(v, 3) for k, v in f.items()}
        vs_backbone[name] = {k: round(f["backbone"] / f[k], 3) for k in ("exact", "lorazor")}
        gap_closed[name] = round((f["exact"] - f["lorazor"]) / (f["exact"] - f["backbone"]), 3)
    decode_only = [s for s in steps if s["tokens"] == s["rows"]]
    mean = lambda key, among=steps: round(statistics.fmean(s[key] for s in among), 1)  # noqa: E731
    result = dict(
        environment=environment(), workload=args.workload, requests=len(requests), adapters=args.adapters,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        read_tb_s=args.read_tb_s, matmul_tflops=args.matmul_tflops,
        weight_gb=round(sizes["weight_bytes"] / 1e9, 3), adapter_mb=round(sizes["adapter_bytes"] / 1e6, 2),
        steps=len(steps), decode_only_steps=len(decode_only),
        adapters_read_mean=dict(exact=mean("exact"), lorazor=mean("lorazor")),
        adapters_read_mean_decode_only=dict(exact=mean("exact", decode_only), lorazor=mean("lorazor", decode_only)),
        steps_reading_every_adapter={k: round(sum(s[k] == args.adapters for s in steps) / len(steps), 3)
                                     for k in ("exact", "lorazor")},
        lora_activation_mb_per_token=round(sizes["lora_activation_bytes_per_token"] / 1e6, 2),
        lora_token_share={k: round(sum(s["lora_tokens"][k] for s in steps) / sum(s["tokens"] for s in steps), 3)
                          for k in ("exact", "lorazor")},
        floor_s=floors, floor_vs_backbone=vs_backbone, gap_closed_at_floor=gap_closed)
    print(json.dumps({k: v for k, v in result.items() if k != "environment"}, indent=1), flush=True)
    (args.out / f"adapter_bytes_{args.workload}{args.tag}.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
