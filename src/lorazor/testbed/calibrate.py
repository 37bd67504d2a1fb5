"""Calibrate StepTrim release lengths for the testbed adapters on their validation splits.

    python -m lorazor.testbed.calibrate --min-skip 0.5 --out calibrated/        # the paper's setting
    python -m lorazor.testbed.calibrate --max-drop 0.02 --out calibrated/       # at most 2 points lost

Writes `<out>/<adapter>/release_policy.json` (load with `model.load_release_policy(out)`) and
`<out>/calibration.md` with each adapter's curve and choice.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> None:
    from lorazor import LoRazorConfig, LoRazorModel, save_release_policy
    from lorazor.calibrate import DEFAULT_RELEASE_LENGTHS, ValidationSet, calibrate_profiled
    from lorazor.testbed import load

    ap = argparse.ArgumentParser()
    criterion = ap.add_mutually_exclusive_group(required=True)
    criterion.add_argument("--min-skip", type=float, help="best accuracy among k skipping at least this fraction")
    criterion.add_argument("--max-drop", type=float, help="most skipping within this accuracy drop of full LoRA")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=None, help="validation examples per task (default: all 200)")
    ap.add_argument("--assets", type=Path, default=None)
    args = ap.parse_args(argv)
    start = time.time()
    peft_model, tokenizer, tasks = load(args.assets)
    model = LoRazorModel.from_peft(peft_model, LoRazorConfig())
    validation = {}
    for name, task in tasks.items():
        examples = task.split("validation")[: args.limit]
        validation[name] = ValidationSet(
            [ex["prompt"] for ex in examples], lambda text, i, task=task, examples=examples: task.score(text, examples[i]),
            dict(max_new_tokens=task.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id),
        )
    policy, curves = calibrate_profiled(model, tokenizer, validation, max_accuracy_drop=args.max_drop,
                                        min_skip=args.min_skip)
    save_release_policy(policy, args.out)
    rule = f"min_skip={args.min_skip}" if args.min_skip is not None else f"max_accuracy_drop={args.max_drop}"
    lines = [f"# Testbed release calibration ({rule}, validation split, limit={args.limit})", "",
             "| adapter | chosen k | " + " | ".join(f"k={k}" for k in (None, *DEFAULT_RELEASE_LENGTHS)) + " |",
             "|---|---|" + "---|" * (len(DEFAULT_RELEASE_LENGTHS) + 1)]
    for name, curve in curves.items():
        cells = [f"{p.accuracy:.1%} / {p.skip_fraction:.0%}" for p in curve]
        lines.append(f"| {name} | {policy.lengths[name]} | " + " | ".join(cells) + " |")
    import torch

    lines += ["", "Cells: validation accuracy / decode LoRA calls skipped. k=None keeps the adapter to the end.",
              f"Command: `python -m lorazor.testbed.calibrate {' '.join(sys.argv[1:] if argv is None else argv)}`; "
              f"torch {torch.__version__}, CPU, {time.strftime('%Y-%m-%d')}; took {time.time() - start:.0f} s."]
    (args.out / "calibration.md").write_text("\n".join(lines) + "\n")
    (args.out / "calibration.json").write_text(json.dumps(
        {name: [p.__dict__ for p in curve] for name, curve in curves.items()}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
