"""A newcomer's first hour, as tests: what tripped a new user of a fresh clone, each held fixed."""

import argparse
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_python_m_lorazor_works_beside_a_folder_named_lorazor(tmp_path):
    """From the folder holding a clone named `lorazor/`, `python -m lorazor` once imported that folder
    as a namespace package (`cannot import name '__version__'`)."""
    (tmp_path / "lorazor" / "src").mkdir(parents=True)
    (tmp_path / "lorazor" / "README.md").write_text("a clone\n")
    done = subprocess.run([sys.executable, "-m", "lorazor", "--version"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("lorazor ")


def test_the_license_file_is_the_one_pyproject_names():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    assert 'license = { text = "Apache-2.0" }' in (ROOT / "pyproject.toml").read_text()


def test_the_testbed_chats_as_it_completes():
    """The testbed's tokenizer has a chat template, and one user message is the completion prompt."""
    from lorazor.testbed import load_tokenizer, make_tasks

    tokenizer = load_tokenizer()
    prompt = make_tasks()["math"].split("test")[0]["prompt"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == prompt


def test_building_the_testbed_warns_nothing():
    """peft under transformers >= 5.24 warns that `is_gradient_checkpointing` is deprecated on every
    PeftModel it builds: silenced where LoRazor builds one (no user can act on it)."""
    from lorazor.testbed import load
    from lorazor.tiny import tiny_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        load()
        tiny_peft_model("llama")


@pytest.mark.slow
def test_serving_a_gemma2_model_is_refused_in_one_line(tmp_path):
    """The engine has no attention-logit softcapping: `lorazor serve` on Gemma 2 says so in one line
    (exit 2), from its config.json, before loading any weight."""
    pytest.importorskip("fastapi")  # `lorazor serve` needs the serve extra first
    pytest.importorskip("uvicorn")
    from lorazor.tiny import tiny_config

    config = tiny_config("gemma2")
    config.save_pretrained(tmp_path)
    done = subprocess.run([sys.executable, "-m", "lorazor", "serve", "--model", str(tmp_path), "--device", "cpu"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and "softcapping" in lines[0], done.stderr[-3000:]
    assert not (tmp_path / "model.safetensors").exists()  # refused from config.json alone


def test_calibration_says_loudly_when_its_choice_breaks_the_adapter(tmp_path, capsys):
    """A --min-skip target met only by a setting that loses most of the adapter's accuracy is warned
    about on stderr and in the report, not chosen silently."""
    from lorazor.calibration.cli import LARGE_DROP, large_drop_warning, write_report
    from lorazor.calibration.lengths import ReleasePoint

    full, broken = ReleasePoint(None, 0.9, 0.0), ReleasePoint(0, 0.1, 0.8)
    assert full.accuracy - broken.accuracy > LARGE_DROP
    warning = large_drop_warning("sql", "min-skip 0.5", broken, full)
    assert "loses 80.0 points" in warning and "--max-drop" in warning
    args = argparse.Namespace(argv=["--min-skip", "0.5"], policy="profiled")
    text = write_report(tmp_path, args, {"sql": [full, broken]}, {"sql": {"min-skip 0.5": (broken, "why")}}, 1.0,
                        argparse.Namespace(type="cpu"))
    assert "**Warning**" in text and "loses 80.0 points" in text
    assert json.loads((tmp_path / "calibration.json").read_text())["adapters"]["sql"]["chosen"]


# What the command line must answer without importing the heavy stack: (arguments, exit code, text).
INSTANT = [
    (["--version"], 0, "lorazor 0.2.0"),
    (["--help"], 0, "usage: lorazor"),
    (["serve", "--modle", "x"], 2, "did you mean --model?"),
    (["serve", "--testbed", "--adapter", "sql=/no/such/folder"], 2, "does not exist (no such local folder)"),
    (["serve", "--testbed", "--adapter", "../up=/tmp"], 2, "invalid adapter name"),
    (["serve", "--testbed", "--tensor-parallel-size", "2"], 2, "one engine per GPU"),
    (["serve"], 2, "needs a model"),
    (["demo", "--grid", "tiles"], 2, "usage: lorazor demo"),
]


@pytest.mark.parametrize("argv,code,text", INSTANT, ids=[" ".join(a) for a, _, _ in INSTANT])
def test_the_command_line_answers_without_importing_torch(argv, code, text):
    """`--version`, `--help` and every argument error answer from argparse alone (measured: ~0.12 s,
    against 15-60 s on a busy machine when the whole stack was imported first). What is asserted is
    that torch was never imported (deterministic); the time bound is loose, for a busy CI machine."""
    probe = ("import sys, time, runpy; start = time.perf_counter()\n"
             f"sys.argv = ['lorazor', *{argv!r}]\n"
             "try:\n    from lorazor.cli import main; code = main()\n"
             "except SystemExit as e:\n    code = e.code\n"
             "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code, f'{time.perf_counter() - start:.2f}',"
             " file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    verdict = done.stderr.strip().splitlines()[-1].split()
    assert verdict[0] == "NO-TORCH", done.stderr[-2000:]
    assert int(verdict[1] or 0) == code and text in done.stdout + done.stderr, done.stdout + done.stderr
    assert float(verdict[2]) < 5.0


def test_vllm_serve_habits_are_understood():
    from lorazor.cli import build_parser
    from lorazor.serve.cli import vllm_compatible

    parser = build_parser()
    sub = parser.subcommands.choices["serve"]
    args = parser.parse_args(["serve", "meta-llama/Llama-3.2-3B", "--enable-lora", "--dtype", "auto",
                              "--tensor-parallel-size", "1"])
    vllm_compatible(args, sub)
    assert args.model == "meta-llama/Llama-3.2-3B" and args.dtype is None


def test_a_small_model_computes_on_one_cpu_thread_and_gives_the_threads_back():
    """With a second core busy, two threads made the testbed demo 4x slower than one (OpenMP barriers
    in many tiny matmuls): a small model's operations run on one thread, and the caller's setting is
    restored after each."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    from lorazor import LoRazorModel
    from lorazor.tiny import tiny_peft_model

    seen = []

    class Threads(LogitsProcessor):
        def __call__(self, input_ids, scores):
            seen.append(torch.get_num_threads())
            return scores

    model = LoRazorModel.from_peft(tiny_peft_model())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model.generate(torch.randint(3, 90, (2, 4)), adapter_ids=["math", None], max_new_tokens=2, pad_token_id=0,
                       logits_processor=LogitsProcessorList([Threads()]))
        assert seen and set(seen) == {1}
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
