"""Calibrate StepTrim for the testbed adapters: `lorazor calibrate --testbed`, the path every user's
adapters take (`lorazor.calibration.cli`), with the testbed's tasks exported as data. The testbed
plugs into calibration as a source (`TESTBED`); calibration knows nothing of it.

    python -m lorazor.testbed.calibrate --min-skip 0.5 --out calibrated/                    # the paper's setting
    python -m lorazor.testbed.calibrate --max-drop 0.02 --out calibrated/                   # at most 2 points lost
    python -m lorazor.testbed.calibrate --policy learned --min-skip 0.5 --out calibrated/   # heads from the train split

Writes `<out>/<adapter>/release_policy.json` (+ `release_head.safetensors` for learned heads; load
with `model.load_release_policy(out)`) and `<out>/calibration.md/.json` with every curve and choice.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..calibration.cli import CalibrationError, Source


def task_set(task, split: str, limit: int | None, tokenizer):
    from lorazor.calibration import ValidationSet

    examples = task.split(split)[:limit]
    return ValidationSet(
        [ex["prompt"] for ex in examples],
        lambda text, i: task.score(text, examples[i]),
        dict(
            max_new_tokens=task.max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        ),
    )


def pick_tasks(tasks: dict, spec: str | None) -> dict:
    """The tasks a comma-separated `--tasks` names, in its order (all of them for None)."""
    if not spec:
        return tasks
    unknown = sorted(set(spec.split(",")) - set(tasks))
    if unknown:
        raise SystemExit(f"unknown tasks {unknown}; the testbed has {sorted(tasks)}")
    return {name: tasks[name] for name in spec.split(",")}


class TestbedSource(Source):
    """`--testbed` (also what a run with no `--model`, `--adapter` or `--data` means): the shipped
    backbone, its four adapters, and its tasks exported as data under `<out>/testbed_data`."""

    def add_arguments(self, group) -> None:
        group.add_argument("--testbed", action="store_true",
                           help="the shipped testbed: its backbone, its four adapters and its tasks' data")
        group.add_argument("--tasks", help="with --testbed: comma-separated adapters (default: all four)")
        group.add_argument("--assets", type=Path, help="with --testbed: another copy of its assets")

    def applies(self, args) -> bool:
        return args.testbed or not (args.model or args.adapter or args.data)

    def check(self, args) -> None:
        for flag, value in (("--tasks", args.tasks), ("--assets", args.assets)):
            if value is not None:
                raise CalibrationError(f"{flag} {value} does not apply here: it applies to --testbed")

    def load(self, args, device: str):
        from ..config import LoRazorConfig
        from ..model import LoRazorModel
        from . import ASSETS, load, version_of
        from .export import TESTBED_METRIC, export_tasks

        if args.model or args.adapter:
            raise CalibrationError("--testbed brings its own model and adapters: leave out --model and --adapter")
        peft_model, tokenizer, tasks = load(args.assets)
        names = args.tasks.split(",") if args.tasks else list(tasks)
        unknown = sorted(set(names) - set(tasks))
        if unknown:
            raise CalibrationError(f"unknown tasks {unknown}; the testbed has {sorted(tasks)}")
        out = getattr(args, "out", None) or Path(".")
        folder = export_tasks(out / "testbed_data", {n: tasks[n] for n in names}, version_of(args.assets or ASSETS))
        args.data = args.data or str(folder / ("validation.jsonl" if args.command == "calibrate" else "test.jsonl"))
        if getattr(args, "policy", None) == "learned":
            args.train_data = args.train_data or str(folder / "train.jsonl")
        args.metric = args.metric or TESTBED_METRIC
        model = LoRazorModel.from_peft(peft_model.to(device), LoRazorConfig(dtype=args.dtype))
        return model, tokenizer, names, dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)


TESTBED = TestbedSource()


def main(argv=None) -> None:
    from lorazor.calibration.cli import main as calibration_main

    argv = list(sys.argv[1:] if argv is None else argv)
    sys.exit(calibration_main("calibrate", argv if "--testbed" in argv else ["--testbed", *argv], [TESTBED]))


if __name__ == "__main__":
    main()
