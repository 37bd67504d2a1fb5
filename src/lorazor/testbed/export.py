"""The testbed's tasks as calibration data: one jsonl file per split, scored by `score`.

    folder = export_tasks(Path("testbed_data"), tasks)      # train.jsonl, validation.jsonl, test.jsonl
    lorazor calibrate --testbed ...                          # does this, then runs the user's path

Each row holds the task's example (`prompt`, `reference`, `answer` where the task has one), the
adapter it belongs to and the task's answer length; `score` judges an answer with the task's own
evaluator, so `--metric python:lorazor.testbed.export:score` is the testbed's metric.
"""

from __future__ import annotations

import json
from pathlib import Path

TESTBED_METRIC = "python:lorazor.testbed.export:score"
SPLITS = ("train", "validation", "test")
_tasks: dict = {}  # version -> tasks, built on first use


def export_tasks(folder: Path, tasks: dict, version: str = "2") -> Path:
    """Write `<split>.jsonl` for every split into `folder` (rows of testbed `version`); returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        with (folder / f"{split}.jsonl").open("w", encoding="utf-8") as f:
            for name, task in tasks.items():
                for example in task.split(split):
                    f.write(
                        json.dumps(
                            dict(example, adapter=name, max_new_tokens=task.max_new_tokens, testbed_version=version)
                        )
                        + "\n"
                    )
    return folder


def score(answer: str, example: dict) -> bool:
    """The testbed task's own evaluator for an exported row."""
    version = str(example.get("testbed_version", "2"))
    if version not in _tasks:
        from . import tasks_of_version

        _tasks[version] = tasks_of_version(version)
    return bool(_tasks[version][example["adapter"]].score(answer, example))
