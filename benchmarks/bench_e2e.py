"""End-to-end static-batch decode on the GPU: backbone, LoRazor per grid mode, PEFT, HF compiled.

    python benchmarks/bench_e2e.py --model llama-3.2-3b --out benchmarks/results [--hf-compile] [--peft 1,8,32]

Random-weight model built from its config (no download), bf16, rank-8 LoRA on all 7 projections,
batch 256, prompt 128, 128 new tokens with EOS ignored, requests spread uniformly over L distinct
adapters. Decode throughput = B * (new - 1) / (time(new) - time(1)): the prefill and first token
are timed separately and taken out. Every number comes from this one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import SHAPES, environment, timed, write_results  # noqa: E402

RANK = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_base(name: str):
    from transformers import LlamaConfig, MistralConfig

    s = SHAPES[name]
    cls = LlamaConfig if name.startswith("llama") else MistralConfig
    extra = dict(rope_scaling=None, tie_word_embeddings=True) if name.startswith("llama") else dict(sliding_window=None)
    cfg = cls(hidden_size=s["hidden"], intermediate_size=s["inter"], num_attention_heads=s["heads"],
              num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], num_hidden_layers=s["layers"],
              vocab_size=s["vocab"], max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, **extra)
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def assign(B: int, L: int, names: list[str]) -> list[str]:
    g = torch.Generator().manual_seed(L)
    order = torch.randperm(B, generator=g).tolist()
    return [names[order[i] % L] for i in range(B)]


def decode_rate(gen, B: int, new: int, warm_new: bool = True) -> dict:
    """Time gen(1) and gen(new) after a warm-up -> decode tok/s, ms/step. With warm_new the warm-up
    also runs one decode step (gen(2)): LoRazor captures (and compiles) its step graph there, and
    with a fixed `max_cache_len` gen(2) and gen(new) share that graph."""
    gen(1)
    t1 = timed(lambda: gen(1))
    if warm_new:
        gen(2)
    tn = timed(lambda: gen(new))
    step = (tn - t1) / (new - 1)
    return dict(decode_tok_s=B / step, step_ms=step * 1e3, total_new_tok_s=B * new / tn, prefill_s=t1)


def parse_patches(text: str) -> dict[str, dict]:
    """--ab-patch: one KernelConfig patch ('{"pdl": true}', named "patched") or several by name
    ('{"pdl_off": {"pdl": false}, "again": {}}'), each applied to the unpatched config."""
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ValueError(f"--ab-patch must be a JSON object, got {text!r}")
    named = bool(spec) and all(isinstance(v, dict) for v in spec.values())
    return spec if named else {"patched": spec}


def apply_kernel_patch(base, patch: dict, out: Path, name: str):
    """Run the rest of this process on kernel config `base` with `patch` applied (through
    LORAZOR_KERNEL_CONFIG, read at each launch)."""
    from lorazor_kernels.kernel_config import CONFIG_ENV

    cfg = dataclasses.replace(base, **patch)
    path = out / f"ab_{name}_kernel_config.json"
    path.write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    os.environ[CONFIG_ENV] = str(path.resolve())
    return cfg


def fill_random_adapters(model, first: int, count: int, seed: int = 0, rank: int = RANK) -> list[str]:
    """Benchmark only: register `count` random adapters of `rank` (`rand<first>`, ...) in free slots."""
    from lorazor.adapters import AdapterWeights

    device = model.device
    g = torch.Generator(device=device).manual_seed(seed)
    names = []
    for i in range(first, first + count):
        weights = AdapterWeights({
            module: (torch.randn(rank, k, generator=g, device=device, dtype=model.bank.dtype) / k**0.5,
                     torch.randn(n, rank, generator=g, device=device, dtype=model.bank.dtype) * 0.01, 2.0)
            for module, (k, n) in model.bank.module_sizes.items()})
        model.registry.add_loaded(f"rand{i}", weights)
        names.append(f"rand{i}")
    return names


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.2-3b", choices=sorted(SHAPES))
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--adapters", default="1,4,8,16,32,64,128")
    ap.add_argument("--grids", default="full,active_rows,two_class,exact")
    ap.add_argument("--peft", default="1,8,32", help="adapter counts for the PEFT baseline ('' to skip)")
    ap.add_argument("--peft-new", type=int, default=16, help="new tokens for PEFT (it is slow)")
    ap.add_argument("--hf-compile", action="store_true", help="also time HF static cache + torch.compile")
    ap.add_argument("--compile", action="store_true", help="also run backbone + exact with a compiled decode step")
    ap.add_argument("--per-projection", action="store_true",
                    help="merge_projections=False: one base GEMM and LoRA per projection (7 and 14 launches per layer)")
    ap.add_argument("--tag", default="", help="suffix of the result files")
    ap.add_argument("--ab-patch", default="",
                    help="JSON KernelConfig changes, one patch or several by name: only compiled `exact`, "
                         "with the GPU's config, then each patch, in one run with one backbone")
    ap.add_argument("--from-log", type=Path, nargs="*", help="render tables/plot from logged JSON rows instead")
    ap.add_argument("--meta", default="{}", help="with --from-log: JSON metadata of the run(s)")
    args = ap.parse_args()
    if args.from_log:
        rows = [json.loads(line) for log in args.from_log for line in log.read_text().splitlines()
                if line.startswith('{"model"')]
        render(rows, json.loads(args.meta), args.out, f"e2e_{rows[0]['model']}{args.tag}")
        return
    from peft import LoraConfig, get_peft_model

    from lorazor import LoRazorConfig, LoRazorModel

    B, T, NEW = args.batch, args.prompt, args.new
    base = build_base(args.model)
    vocab = base.config.vocab_size
    ids = torch.randint(3, vocab, (B, T), device="cuda")
    mask = torch.ones_like(ids)
    rows = []

    def record(system, L, grid, r):
        row = dict(model=args.model, system=system, L=L, grid=grid, **{k: round(v, 4) for k, v in r.items()})
        rows.append(row)
        print(json.dumps(row), flush=True)

    if args.hf_compile:
        gen = lambda n: base.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,  # noqa: E731
                                      cache_implementation="static", pad_token_id=0)
        try:
            t_first = timed(lambda: gen(NEW))
            t = timed(lambda: gen(NEW))
            record("hf_static_compile", 0, "-", dict(total_new_tok_s=B * NEW / t, first_call_s=t_first))
        except Exception as exc:  # a baseline failing must not cost the rest of the run
            print(f"hf_static_compile failed: {exc!r}", flush=True)

    peft_counts = [int(x) for x in args.peft.split(",") if x]
    n_peft = max(peft_counts + [1])
    cfg = LoraConfig(r=RANK, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
    peft_model = get_peft_model(base, cfg, adapter_name="a0")
    for i in range(1, n_peft):
        peft_model.add_adapter(f"a{i}", cfg)
    peft_model.eval()
    for L in peft_counts:
        names = assign(B, L, [f"a{i}" for i in range(L)])
        gen = lambda n: peft_model.generate(input_ids=ids, attention_mask=mask, adapter_names=names,  # noqa: E731
                                            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        record("peft", L, "-", decode_rate(gen, B, args.peft_new, warm_new=False))

    max_l = max(int(x) for x in args.adapters.split(","))
    # One cache length for every call, as a server sets it: gen(1), gen(2) and gen(NEW) share graphs.
    model = LoRazorModel.from_peft(peft_model, LoRazorConfig(max_loras=max(max_l, n_peft), max_batch_size=B,
                                                             max_cache_len=T + NEW,
                                                             merge_projections=not args.per_projection))
    names = model.adapter_names + fill_random_adapters(model, n_peft, max(max_l, n_peft) - n_peft)

    def lorazor(adapter_ids):
        return lambda n: model.generate(ids, attention_mask=mask, adapter_ids=adapter_ids, max_new_tokens=n,
                                        min_new_tokens=n, do_sample=False, pad_token_id=0)

    def sweep(compile_step: bool, grids: list[str], backbone: float | None = None, suffix: str = ""):
        """Backbone (unless given), then each grid at every L; returns the backbone's decode tok/s."""
        model.reconfigure(grid=grids[0], compile=compile_step)
        if backbone is None:
            r = decode_rate(lorazor([None] * B), B, NEW)
            backbone = r["decode_tok_s"]
            record("lorazor_backbone", 0, f"compile={compile_step}", r)
        for grid in grids:
            model.reconfigure(grid=grid, compile=compile_step)
            for L in (int(x) for x in args.adapters.split(",")):
                r = decode_rate(lorazor(assign(B, L, names)), B, NEW)
                r["vs_backbone"] = r["decode_tok_s"] / backbone
                record("lorazor" + ("_compiled" if compile_step else "") + suffix, L, grid, r)
        return backbone

    from lorazor_kernels import get_kernel_config
    from lorazor_kernels.kernel_config import CONFIG_ENV

    # Recorded before any --ab-patch: the config of the backbone and the unpatched rows.
    base_cfg = get_kernel_config(torch.device("cuda"))
    kernel_config = dict(kernel_config=dataclasses.asdict(base_cfg),
                         kernel_config_file=os.environ.get(CONFIG_ENV, "tuned file of the GPU"))
    if args.ab_patch:  # one compiled backbone; exact with the GPU's kernel config, then with each patch
        patches = parse_patches(args.ab_patch)
        kernel_config["ab_patch"] = patches
        backbone = sweep(True, ["exact"])
        for name, patch in patches.items():
            patched = apply_kernel_patch(base_cfg, patch, args.out, name)
            sweep(True, ["exact"], backbone, f"_{name}")
            print(f"{name} kernel config: {patched}", flush=True)
    else:
        # Every grid mode on the same (uncompiled) backbone, then the best setup: exact + compile.
        sweep(False, args.grids.split(","))
        if args.compile:
            sweep(True, ["exact"])
    graphs = model.graphs
    meta = dict(
        environment(),
        command=" ".join(sys.argv),
        batch=B,
        prompt=T,
        new_tokens=NEW,
        rank=RANK,
        **kernel_config,
        compile=args.compile,
        peft_new_tokens=args.peft_new,
        graphs=graphs.num_graphs(),
        graph_capture_s_all_runs=round(graphs.capture_seconds, 2),
        graph_GB_last_sweep=round(graphs.capture_bytes / 1e9, 3),
        date=time.strftime("%Y-%m-%d"),
    )
    render(rows, meta, args.out, f"e2e_{args.model}{args.tag}")


def render(rows: list[dict], meta: dict, out: Path, name: str) -> None:
    """Results table (markdown + JSON) and the latency/throughput plot."""
    head = ("| system | grid | L | decode tok/s | step ms | vs backbone | total new tok/s |\n"
            "|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['system']} | {r['grid']} | {r['L']} | {r.get('decode_tok_s', float('nan')):.0f} | "
                   f"{r.get('step_ms', float('nan')):.2f} | {r.get('vs_backbone', float('nan')):.2f} | "
                   f"{r.get('total_new_tok_s', float('nan')):.0f} |\n" for r in rows)
    table = f"# End-to-end decode, {rows[0]['model']}\n\n```\n{json.dumps(meta, indent=2)}\n```\n\n{head}{body}"
    write_results(out, name, rows, meta, table)
    plot(rows, out / f"{name}.png", rows[0]["model"])
    print(table)


def plot(rows, path: Path, model: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    series = sorted({(r["system"], r["grid"]) for r in rows if r["system"].startswith("lorazor") and r["L"] > 0})
    for system, grid in series:
        rs = [r for r in rows if r["system"] == system and r["grid"] == grid]
        label = (f"LoRazor {grid}" + (" +compile" if "compiled" in system else "")
                 + (f", {system.split('_compiled_', 1)[1]}" if "_compiled_" in system else ""))
        ax1.plot([r["L"] for r in rs], [r["step_ms"] for r in rs], marker="o", label=label)
        ax2.plot([r["L"] for r in rs], [r["decode_tok_s"] for r in rs], marker="o", label=label)
    pe = [r for r in rows if r["system"] == "peft"]
    if pe:
        ax1.plot([r["L"] for r in pe], [r["step_ms"] for r in pe], marker="x", label="PEFT adapter_names")
        ax2.plot([r["L"] for r in pe], [r["decode_tok_s"] for r in pe], marker="x", label="PEFT adapter_names")
    for r, style in zip([r for r in rows if r["system"] == "lorazor_backbone"], ("--", ":")):
        for ax, key in ((ax1, "step_ms"), (ax2, "decode_tok_s")):
            ax.axhline(r[key], color="k", ls=style, label=f"LoRazor backbone only ({r['grid']})")
    for ax, label in ((ax1, "per-step latency (ms)"), (ax2, "decode tokens/s")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distinct adapters in the batch")
        ax.set_ylabel(label)
    ax1.set_yscale("log")
    ax2.set_yscale("log")
    ax2.legend(fontsize=7)
    fig.suptitle(f"{model}: batch 256, rank 8 on 7 projections (H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
