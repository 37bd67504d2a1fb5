"""StepTrim on the GPU (paper Fig. 7 analogue): release-decision latency and decode throughput.

    python benchmarks/bench_release.py --out benchmarks/results            # H200, Llama-3.2-3B shape
    python benchmarks/bench_release.py --tiny --out /tmp/r                  # CPU smoke run of the logic

1. Decision latency: `LearnedRelease` with one head per resident adapter (128) deciding for B rows
   (1..256): the batched gather + dot + threshold + one-way state update, as a fraction of the
   decode step of the same batch size. Timed two ways: replayed from a CUDA graph (its GPU time, as
   it runs inside the captured decode step) and launched eagerly (wall clock, host launches included).
2. Throughput at 128 adapters, batch 256, 128 new tokens: the backbone alone, no release, and
   `ProfiledRelease` with k = 63 for every adapter (about 50% of decode LoRA calls skipped) and
   k = 0 (prefill only), in the same run, decisions inside the captured step (`--compile`: the
   compiled step; `--throughput-only` skips part 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, time_graph, timed, write_results  # noqa: E402


def build(args):
    from peft import LoraConfig, get_peft_model

    from lorazor import LoRazorConfig, LoRazorModel

    if args.tiny:
        from lorazor.tiny import tiny_peft_model

        pm = tiny_peft_model("llama")
        model = LoRazorModel.from_peft(pm, LoRazorConfig(max_loras=args.adapters, cuda_graphs=False))
        names = model.adapter_names
        return model, names + [names[i % len(names)] for i in range(args.adapters - len(names))]
    from bench_e2e import RANK, TARGETS, build_base, fill_random_adapters

    base = build_base("llama-3.2-3b")
    pm = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False),
                        adapter_name="a0").eval()
    model = LoRazorModel.from_peft(pm, LoRazorConfig(max_loras=args.adapters, compile=args.compile))
    return model, ["a0"] + fill_random_adapters(model, 1, args.adapters - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--tiny", action="store_true", help="tiny model on this machine (checks the logic)")
    ap.add_argument("--adapters", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--throughput-only", action="store_true", help="skip the decision-latency part")
    args = ap.parse_args()
    from lorazor import LearnedRelease, ProfiledRelease
    from lorazor.policies import ReleaseState

    model, names = build(args)
    device = model.device
    hidden = model.model.config.hidden_size
    vocab = model.model.config.vocab_size
    unique = list(dict.fromkeys(names))
    g = torch.Generator().manual_seed(0)
    heads = {n: (torch.randn(hidden, generator=g), 0.0, 0.0) for n in unique}
    learned = LearnedRelease(heads)
    learned.bind(model.bank.names, model.bank.num_slots, device)
    batches = [] if args.throughput_only else [1, 4, 16, 64, 256] if not args.tiny else [1, 4, 16]
    new_short = 16 if not args.tiny else 4
    rows = []
    for B in batches:
        slot = model.bank.slots_for([names[i % len(names)] for i in range(B)], device=device)
        h = torch.randn(B, hidden, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
        state = ReleaseState.create(slot)
        decide = lambda: state.advance(3, learned.keep(3, h, state))  # noqa: E731
        decide()
        decision_ms = timed(decide, reps=200) * 1e3
        graph_ms = time_graph(decide) if device.type == "cuda" else float("nan")
        ids = torch.randint(3, vocab, (B, 128 if not args.tiny else 8), device=device)
        gen = lambda n: model.generate(ids, adapter_ids=[names[i % len(names)] for i in range(B)],  # noqa: E731
                                       max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        gen(1), gen(new_short)
        step_ms = (timed(lambda: gen(new_short)) - timed(lambda: gen(1))) / (new_short - 1) * 1e3
        row = dict(kind="decision", batch=B, heads=len(unique), decision_ms=decision_ms, decision_graph_ms=graph_ms,
                   step_ms=step_ms, fraction_of_step=graph_ms / step_ms, eager_fraction_of_step=decision_ms / step_ms)
        rows.append(row)
        print(json.dumps(row), flush=True)

    B, NEW = (256, args.new) if not args.tiny else (8, 8)
    adapter_ids = [names[i % len(names)] for i in range(B)]
    ids = torch.randint(3, vocab, (B, 128 if not args.tiny else 8), device=device)
    k = (NEW - 1) // 2
    policies = (
        ("backbone only", None),
        ("no release", None),
        (f"profiled k={k}", ProfiledRelease({n: k for n in unique})),
        ("profiled k=0", ProfiledRelease({n: 0 for n in unique})),
    )
    backbone_tok_s = None
    for label, policy in policies:
        row_ids = [None] * B if label == "backbone only" else adapter_ids
        gen = lambda n: model.generate(ids, adapter_ids=row_ids, max_new_tokens=n, min_new_tokens=n,  # noqa: E731
                                       pad_token_id=0, release_policy=policy)
        gen(1), gen(NEW)
        t1, tn = timed(lambda: gen(1)), timed(lambda: gen(NEW))
        out = gen(NEW)
        tok_s = B * (NEW - 1) / (tn - t1)
        backbone_tok_s = backbone_tok_s or tok_s
        row = dict(kind="throughput", policy=label, batch=B, adapters=0 if label == "backbone only" else len(unique),
                   decode_tok_s=tok_s, vs_backbone=tok_s / backbone_tok_s, skip_fraction=out.skip_fraction)
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = dict(environment(), command=" ".join(sys.argv), date=time.strftime("%Y-%m-%d"), tiny=args.tiny,
                compile=args.compile)
    table = "# StepTrim on the GPU\n\n```\n" + json.dumps(meta, indent=2) + "\n```\n\n"
    table += ("| batch | heads | decision in graph ms | fraction of step | decision eager ms | eager fraction | "
              "decode step ms |\n|---|---|---|---|---|---|---|\n")
    table += "".join(f"| {r['batch']} | {r['heads']} | {r['decision_graph_ms']:.4f} | {r['fraction_of_step']:.4f} | "
                     f"{r['decision_ms']:.4f} | {r['eager_fraction_of_step']:.4f} | {r['step_ms']:.2f} |\n"
                     for r in rows if r["kind"] == "decision")
    table += ("\n| policy | batch | adapters | decode tok/s | vs backbone | decode LoRA skipped |\n"
              "|---|---|---|---|---|---|\n")
    table += "".join(
        f"| {r['policy']} | {r['batch']} | {r['adapters']} | {r['decode_tok_s']:.0f} | "
        f"{r['vs_backbone']:.2f} | {r['skip_fraction']:.0%} |\n"
        for r in rows
        if r["kind"] == "throughput"
    )
    name = ("release" + ("_tiny" if args.tiny else "") + ("_throughput" if args.throughput_only else "")
            + ("_compiled" if args.compile else ""))
    write_results(args.out, name, rows, meta, table)
    print(table)


if __name__ == "__main__":
    main()
