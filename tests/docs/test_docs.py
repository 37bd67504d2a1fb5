"""Every python code block of the docs and the README runs, on the CPU, against the shipped testbed.

Blocks of one page run in order in one namespace (later blocks use what earlier ones made). The
page starts with the names its text assumes a reader has (`READER_HAS`): a PeftModel and its
tokenizer, prompts and a left-padded batch, an `adapters/` folder of PEFT adapter folders and a
saved base model under `models/base`. A block that builds a model from `peft_model` gets a fresh
one (a PeftModel can be patched by one LoRazorModel at a time). docs/serving.md's and
docs/structured-outputs.md's blocks need a server and run in tests/serve
(test_serving_tutorial.py, test_structured_outputs_served.py).
"""

import re
import shlex
import subprocess
import sys
import shutil
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")
                               if p.name not in ("serving.md", "structured-outputs.md"))
READER_HAS = [
    "peft_model",
    "tokenizer",
    "prompts",
    "batch",
    "input_ids",
    "mask",
    "ids",
    "ids_a",
    "ids_b",
    "ids_c",
    "model",
    "x",
    "lora_a",
    "lora_b",
    "scaling",
    "row_slot",
    "run_matches",
    "sql_prompts",
    "sql_refs",
    "medqa_prompts",
    "medqa_refs",
    "tasks",
]


def shell_steps(page: str) -> list[str]:
    """The page's `lorazor calibrate --testbed ...` shell commands (run as CI runs them)."""
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / page).read_text(), flags=re.S)
    return [line.strip() for b in blocks for line in b.splitlines() if line.startswith("lorazor calibrate --testbed")]


def python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / page).read_text(), flags=re.S)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A folder with `adapters/<name>` PEFT folders (the testbed's, plus `legal` and `tax` copies)
    and `models/base` (the testbed backbone)."""
    from lorazor.testbed import ASSETS

    root = tmp_path_factory.mktemp("reader")
    for name in ("math", "sql", "medqa", "science"):
        shutil.copytree(ASSETS / "adapters" / name, root / "adapters" / name)
    shutil.copytree(ASSETS / "adapters" / "sql", root / "adapters" / "legal")
    shutil.copytree(ASSETS / "adapters" / "medqa", root / "adapters" / "tax")
    shutil.copytree(ASSETS / "backbone", root / "models" / "base")
    for name in ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"):
        if (ASSETS / "tokenizer" / name).exists():
            shutil.copy(ASSETS / "tokenizer" / name, root / "models" / "base" / name)
    return root


def reader_namespace() -> dict:
    from lorazor import LoRazorModel, ProfiledRelease, save_release_policy
    from lorazor.testbed import load
    from lorazor.testbed.sql import same_result
    from lorazor.testbed.tasks import task_database

    peft_model, tokenizer, tasks = load()
    prompts = [tasks[n].split("test")[0]["prompt"] for n in ("math", "sql", "medqa", "math")]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    sql = tasks["sql"].split("validation")[:3]
    medqa = tasks["medqa"].split("validation")[:3]
    g = torch.Generator().manual_seed(0)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    save_release_policy(ProfiledRelease({"math": 8, "sql": 2}), "adapters/")
    ns = dict(
        peft_model=peft_model, tokenizer=tokenizer, tasks=tasks, prompts=prompts, batch=batch,
        input_ids=batch["input_ids"], mask=batch["attention_mask"], ids=batch["input_ids"],
        ids_a=tokenizer(prompts[0])["input_ids"], ids_b=tokenizer(prompts[1])["input_ids"],
        ids_c=tokenizer(prompts[2])["input_ids"],
        # The kernel examples' tensors, on the GPU when there is one (as a reader's would be).
        x=torch.randn(6, 32, generator=g).to(dev), lora_a=torch.randn(3, 16, 32, generator=g).to(dev),
        lora_b=torch.randn(3, 16, 48, generator=g).to(dev).transpose(1, 2), scaling=torch.rand(3, generator=g).to(dev),
        row_slot=torch.tensor([0, 2, -1, 1, 0, 2], dtype=torch.int32, device=dev),
        sql_prompts=[ex["prompt"] for ex in sql], sql_refs=[ex["reference"] for ex in sql],
        run_matches=lambda answer, ref: same_result(task_database(), answer.strip().split("\n")[0], ref.strip()),
        medqa_prompts=[ex["prompt"] for ex in medqa], medqa_refs=[ex["answer"] for ex in medqa],
    )
    ns["model"] = LoRazorModel.from_peft(load()[0])
    return ns


@pytest.mark.parametrize("page", PAGES)
def test_page_code_blocks_run(page, workdir, monkeypatch):
    from lorazor.testbed import load

    blocks = python_blocks(page)
    if not blocks:
        pytest.skip(f"{page} has no python blocks")
    for extra in ("ray",):  # an optional extra a page's blocks import: skip where it is missing
        if any(re.search(rf"^\s*(import|from) (lorazor\.)?{extra}\b", b, flags=re.M) for b in blocks):
            pytest.importorskip(extra)
    steps = shell_steps(page)
    if any(shlex.split(c)[1:2] in (["calibrate"], ["eval"]) for c in steps):
        # A core dependency, but images with their own packages (the GPU machine's) may lack it.
        pytest.importorskip("datasets")
    monkeypatch.chdir(workdir)
    for command in steps:  # the page's shell steps its python blocks read the results of
        done = subprocess.run([sys.executable, "-m", *shlex.split(command)], cwd=workdir, capture_output=True,
                              text=True, timeout=900)
        assert done.returncode == 0, f"{page}: `{command}` failed:\n{done.stderr[-3000:]}"
    ns = reader_namespace()
    for i, block in enumerate(blocks):
        if "from_peft(peft_model" in block:
            ns["peft_model"] = load()[0]  # one LoRazorModel per PeftModel
        try:
            exec(compile(block, f"{page}[{i}]", "exec"), ns)
        except Exception as err:
            raise AssertionError(f"{page}, python block {i} failed: {err!r}\n{block}") from err
