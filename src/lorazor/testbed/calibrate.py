"""Calibrate StepTrim for the testbed adapters: profiled k or learned heads, on the validation split.

    python -m lorazor.testbed.calibrate --min-skip 0.5 --out calibrated/                    # the paper's setting
    python -m lorazor.testbed.calibrate --max-drop 0.02 --out calibrated/                   # at most 2 points lost
    python -m lorazor.testbed.calibrate --policy learned --min-skip 0.5 --out calibrated/   # heads from the train split

Writes `<out>/<adapter>/release_policy.json` (+ `release_head.safetensors` for learned heads; load
with `model.load_release_policy(out)`) and `<out>/calibration.md/.json` with every curve and choice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _task_set(task, split: str, limit: int | None, tokenizer):
    from lorazor.calibration import ValidationSet

    examples = task.split(split)[:limit]
    return ValidationSet(
        [ex["prompt"] for ex in examples], lambda text, i: task.score(text, examples[i]),
        dict(max_new_tokens=task.max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id),
    )


def pick_tasks(tasks: dict, spec: str | None) -> dict:
    """The tasks a comma-separated `--tasks` names, in its order (all of them for None)."""
    if not spec:
        return tasks
    unknown = sorted(set(spec.split(",")) - set(tasks))
    if unknown:
        raise SystemExit(f"unknown tasks {unknown}; the testbed has {sorted(tasks)}")
    return {name: tasks[name] for name in spec.split(",")}


def _environment(device) -> str:
    """Commit (when run from a git checkout), package versions and device, for the results file."""
    import subprocess

    import peft
    import torch
    import transformers

    commit = os.environ.get("LORAZOR_COMMIT", "")[:7]  # the GPU machine's copy of the tree has no .git
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                    cwd=Path(__file__).parent).stdout.strip() or "unknown"
        except OSError:
            commit = "unknown"
    return (f"commit {commit}; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"peft {peft.__version__}; {device.type}")


def main(argv=None) -> None:
    from lorazor import LoRazorConfig, LoRazorModel, save_release_policy
    from lorazor.calibration import calibrate_learned, calibrate_profiled
    from lorazor.testbed import load

    ap = argparse.ArgumentParser()
    criterion = ap.add_mutually_exclusive_group(required=True)
    criterion.add_argument("--min-skip", type=float, help="best accuracy among settings skipping at least this fraction")
    criterion.add_argument("--max-drop", type=float, help="most skipping within this accuracy drop of full LoRA")
    ap.add_argument("--policy", choices=("profiled", "learned"), default="profiled")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None, help="validation examples per task (default: all 200)")
    ap.add_argument("--train-limit", type=int, default=200, help="training prompts per task for learned heads")
    ap.add_argument("--tasks", default=None, help="comma-separated adapters to calibrate (default: all four)")
    ap.add_argument("--assets", type=Path, default=None)
    args = ap.parse_args(argv)
    start = time.time()
    peft_model, tokenizer, tasks = load(args.assets)
    model = LoRazorModel.from_peft(peft_model, LoRazorConfig())
    tasks = pick_tasks(tasks, args.tasks)
    validation = {name: _task_set(task, "validation", args.limit, tokenizer) for name, task in tasks.items()}
    rule = dict(max_accuracy_drop=args.max_drop, min_skip=args.min_skip)
    if args.policy == "profiled":
        policy, curves = calibrate_profiled(model, tokenizer, validation, **rule)
        chosen = {name: ("k", k) for name, k in policy.lengths.items()}
    else:
        train = {name: _task_set(task, "train", args.train_limit, tokenizer) for name, task in tasks.items()}
        policy, curves = calibrate_learned(model, tokenizer, train, validation, **rule)
        chosen = {name: ("tau", tau) for name, (_, _, tau) in policy.heads.items()}
    save_release_policy(policy, args.out)

    def setting(p):
        return f"tau={p.tau:.3g}" if p.tau is not None else f"k={p.k}"

    given = " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"# Testbed {args.policy} release calibration ({given})", "",
             "| adapter | setting | validation accuracy | decode LoRA skipped | chosen |", "|---|---|---|---|---|"]
    for name, curve in curves.items():
        kind, value = chosen[name]
        for p in curve:
            mine = getattr(p, kind) == value
            lines.append(f"| {name} | {setting(p)} | {p.accuracy:.1%} | {p.skip_fraction:.0%} | {'<-' if mine else ''} |")
    lines += ["", f"k=None / tau=-inf keep the adapter to the end. Command: `python -m lorazor.testbed.calibrate {given}`; "
              f"{_environment(model.device)}; {time.strftime('%Y-%m-%d')}; took {time.time() - start:.0f} s."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "calibration.md").write_text("\n".join(lines) + "\n")
    (args.out / "calibration.json").write_text(json.dumps(
        {name: [p.__dict__ for p in curve] for name, curve in curves.items()}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
