"""Calibration on the GPU, the way `lorazor calibrate --testbed` runs it (the same calibration
functions on the engine; the tasks' examples are taken directly instead of through the exported
jsonl, as the GPU image has no `datasets`):

1. wall time of the profiled calibration of the testbed's four adapters on their full validation
   splits (every k of the default grid, one engine run);
2. the learned science head trained on `--train-limit` shuffled train prompts per seed, its
   threshold chosen at >= 50% validation skip, then measured on the test split against full LoRA
   (the target: within 3 points at >= 50% realized skip).

    python benchmarks/probes/calibration_h200.py --out /tmp/cal --seeds 0,1,2 --train-limit 800
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).parent.parent)]  # benchmarks/
from common import environment  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("/tmp/cal"))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--train-limit", type=int, default=800)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--skip-profiled", action="store_true")
    ap.add_argument("--limit", type=int, help="validation and test examples (a smoke run; default: all)")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from lorazor import LoRazorModel, ProfiledRelease
    from lorazor.calibration import ValidationSet, calibrate_learned, calibrate_profiled, policy_outcomes
    from lorazor.testbed import load
    from lorazor.testbed.calibrate import _task_set

    peft_model, tokenizer, tasks = load()
    model = LoRazorModel.from_peft(peft_model.to(args.device))
    result = dict(environment(), train_limit=args.train_limit, batch_size=args.batch_size)
    validation = {name: _task_set(task, "validation", args.limit, tokenizer) for name, task in tasks.items()}
    if not args.skip_profiled:
        start = time.perf_counter()
        policy, curves = calibrate_profiled(model, tokenizer, validation, min_skip=0.5, batch_size=args.batch_size)
        result["profiled"] = dict(seconds=round(time.perf_counter() - start, 1), lengths=policy.lengths,
                                  examples={n: len(v.prompts) for n, v in validation.items()},
                                  settings_per_adapter=len(next(iter(curves.values()))))
        print(json.dumps(result["profiled"]), flush=True)
    science = tasks["science"]
    test = _task_set(science, "test", args.limit, tokenizer)
    correct, _ = policy_outcomes(model, tokenizer, "science", test, ProfiledRelease({"science": None}), args.batch_size)
    full = sum(correct) / len(correct)
    result["science_full_test_accuracy"] = full
    rows = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        start = time.perf_counter()
        examples = list(science.split("train"))
        random.Random(seed).shuffle(examples)
        examples = examples[:args.train_limit]
        train = ValidationSet([e["prompt"] for e in examples], lambda text, i, ex=examples: science.score(text, ex[i]),
                              validation["science"].generate_kwargs)
        learned, curves = calibrate_learned(model, tokenizer, {"science": train}, {"science": validation["science"]},
                                            min_skip=0.5, batch_size=args.batch_size)
        tau = learned.heads["science"][2]
        chosen = next(p for p in curves["science"] if p.tau == tau)
        correct, skip = policy_outcomes(model, tokenizer, "science", test, learned, args.batch_size)
        accuracy = sum(correct) / len(correct)
        rows.append(dict(seed=seed, tau=tau, validation_accuracy=chosen.accuracy, validation_skip=chosen.skip_fraction,
                         test_accuracy=accuracy, test_skip=skip, drop_points=round(100 * (full - accuracy), 2),
                         meets_target=100 * (full - accuracy) <= 3 and skip >= 0.5,
                         seconds=round(time.perf_counter() - start, 1)))
        print(json.dumps(rows[-1]), flush=True)
        result["science_learned"] = rows
        (args.out / "calibration_h200.json").write_text(json.dumps(result, indent=2))
    drops = [r["drop_points"] for r in rows]
    result["science_drop_points"] = dict(min=min(drops), max=max(drops), mean=round(sum(drops) / len(drops), 2))
    (args.out / "calibration_h200.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result["science_drop_points"]))


if __name__ == "__main__":
    main()
