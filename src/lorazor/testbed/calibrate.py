"""Calibrate StepTrim for the testbed adapters: `lorazor calibrate --testbed`, the path every user's
adapters take (`lorazor.calibration.cli`), with the testbed's tasks exported as data.

    python -m lorazor.testbed.calibrate --min-skip 0.5 --out calibrated/                    # the paper's setting
    python -m lorazor.testbed.calibrate --max-drop 0.02 --out calibrated/                   # at most 2 points lost
    python -m lorazor.testbed.calibrate --policy learned --min-skip 0.5 --out calibrated/   # heads from the train split

Writes `<out>/<adapter>/release_policy.json` (+ `release_head.safetensors` for learned heads; load
with `model.load_release_policy(out)`) and `<out>/calibration.md/.json` with every curve and choice.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def _task_set(task, split: str, limit: int | None, tokenizer):
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


def environment_line(device) -> str:
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
    from lorazor.calibration.cli import calibrate

    argv = list(sys.argv[1:] if argv is None else argv)
    calibrate(argv if "--testbed" in argv else ["--testbed", *argv])


if __name__ == "__main__":
    main()
