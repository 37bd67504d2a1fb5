"""Testbed: a tiny Llama backbone, four task adapters, and the tasks with their exact evaluators.

    peft_model, tokenizer, tasks = lorazor.testbed.load()

Tasks and evaluators (`make_tasks`: math, sql, medqa, science) are plain code; the weights come
from `lorazor.testbed.train` and live in `assets/` (backbone, tokenizer, PEFT adapters named after
the tasks). `lorazor.testbed.v1` holds the earlier character-level testbed (its tasks, corpus and
tokenizer), kept to rebuild its results.
"""

from __future__ import annotations

import json
from pathlib import Path

from .corpus import pretraining_documents, pretraining_text
from .task import Task
from .tasks import make_tasks
from .tokenizer import train_tokenizer

ASSETS = Path(__file__).parent / "assets"


def tasks_of_version(version) -> dict[str, Task]:
    """The tasks of testbed `version` (2: shipped; 1: the earlier character-level testbed)."""
    if str(version) == "2":
        return make_tasks()
    from .v1.tasks import make_tasks as make_v1_tasks

    return make_v1_tasks()


def version_of(root: Path) -> str:
    """The testbed version whose weights are in `root` (its `train_log.json` says; "1" without one)."""
    log = Path(root) / "train_log.json"
    return str(json.loads(log.read_text()).get("args", {}).get("version", "1") if log.exists() else "1")


def tasks_for(root: Path) -> dict[str, Task]:
    """The tasks of the testbed version whose weights are in `root` (its `train_log.json` says)."""
    return tasks_of_version(version_of(root))


def load_tokenizer(assets: str | Path | None = None):
    """The testbed's tokenizer alone (left padding, as `load` sets it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained((Path(assets) if assets is not None else ASSETS) / "tokenizer")
    tokenizer.padding_side = "left"
    return tokenizer


def load(assets: str | Path | None = None, with_tools: bool = False):
    """(PeftModel with the four task adapters, tokenizer, {name: Task}), on the CPU in float32.
    The tasks are those of the testbed version that trained the weights (v2 for the shipped ones).
    `with_tools`: the tool-calling adapter "tools" too, with its task (`lorazor.testbed.tool_task`).

    Raises:
        FileNotFoundError: the weights are not in `assets` (train them with
            `python -m lorazor.testbed.train --out <dir>`).
    """
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root = Path(assets) if assets is not None else ASSETS
    if not (root / "backbone" / "model.safetensors").exists():
        raise FileNotFoundError(f"no testbed weights in {root}: run `python -m lorazor.testbed.train --out {root}`")
    tokenizer = load_tokenizer(root)
    base = AutoModelForCausalLM.from_pretrained(root / "backbone", dtype=torch.float32)
    tasks = tasks_for(root)
    if with_tools:
        from .tool_task import tool_task

        tasks = {**tasks, "tools": tool_task()}
    names = [n for n in tasks if (root / "adapters" / n / "adapter_config.json").exists()]
    if not names:
        raise FileNotFoundError(f"no adapters under {root / 'adapters'}")
    from ..model.build import quiet_peft

    with quiet_peft():
        model = PeftModel.from_pretrained(base, root / "adapters" / names[0], adapter_name=names[0])
        for name in names[1:]:
            model.load_adapter(root / "adapters" / name, adapter_name=name)
    return model.eval(), tokenizer, {n: tasks[n] for n in names}


__all__ = ["ASSETS", "Task", "load", "load_tokenizer", "make_tasks", "pretraining_documents", "pretraining_text",
           "train_tokenizer"]
