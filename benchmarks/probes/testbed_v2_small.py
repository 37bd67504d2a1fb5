"""Testbed v2 at a small scale on the CPU: does its design show StepTrim's phenomenon at all?

    OMP_NUM_THREADS=1 python benchmarks/probes/testbed_v2_small.py --out /tmp/v2small

Trains a ~2M-parameter backbone (v1's shape) on the v2 corpus with the v2 tokenizer, one rank-8
adapter per v2 task, then measures validation accuracy for the backbone alone, full LoRA and
release at k. The real v2 run is `python -m lorazor.testbed.train --version 2 --device cuda`
(an 8M backbone, many more steps); this probe only checks the direction: is the backbone far
below full LoRA, does some task keep its accuracy at small k, and does sql need a large k?
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--pretrain-steps", type=int, default=500)
    ap.add_argument("--adapter-steps", type=int, default=250)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--limit", type=int, default=60, help="validation examples per task")
    ap.add_argument("--eval-only", action="store_true", help="evaluate the weights already in --out")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    from lorazor import LoRazorConfig, LoRazorModel
    from lorazor.testbed import train as tr
    from lorazor.testbed.evaluate import run_task

    start = time.time()
    parts = tr.recipe(2, 0)
    tasks, tokenizer = parts.tasks, parts.tokenizer
    log = {}
    if not args.eval_only:
        base = AutoModelForCausalLM.from_config(tr.backbone_config(tokenizer, tr.BACKBONE))
        log["parameters"] = sum(p.numel() for p in base.parameters())
        tr.pretrain(base, tokenizer, args.pretrain_steps, args.batch, args.seq, torch.device("cpu"), 0, log, parts)
        args.out.mkdir(parents=True, exist_ok=True)
        base.save_pretrained(args.out / "backbone")
        for i, (name, task) in enumerate(tasks.items()):
            fresh = AutoModelForCausalLM.from_pretrained(args.out / "backbone")
            trained = tr.train_adapter(fresh, name, task, tokenizer, args.adapter_steps, args.batch,
                                       torch.device("cpu"), i, log)
            trained.save_pretrained(args.out / "adapters")
    from peft import PeftModel

    names = list(tasks)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(args.out / "backbone"),
                                           args.out / "adapters" / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(args.out / "adapters" / name, adapter_name=name)
    model = LoRazorModel.from_peft(peft_model.eval(), LoRazorConfig(cuda_graphs=False))
    rows = {}
    for name, task in tasks.items():
        for mode in ("backbone", "full", 0, 2, 4, 8, 16, 32):
            acc, skip = run_task(model, tokenizer, task, name, mode, split="validation", limit=args.limit, batch=30)
            rows[f"{name} {mode}"] = (round(acc, 3), round(skip, 3))
            print(name, mode, f"accuracy {acc:.3f} skip {skip:.3f}", flush=True)
    log["rows"] = rows
    log["seconds"] = round(time.time() - start, 1)
    (args.out / ("probe_eval.json" if args.eval_only else "probe.json")).write_text(json.dumps(log, indent=2))


if __name__ == "__main__":
    main()
