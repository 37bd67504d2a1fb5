"""`lorazor calibrate` / `lorazor eval` on a user's own base model, adapter folders, data and scorer:
from folders to a served policy, and every refusal."""

import json
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("datasets")
from lorazor.calibration.scorers import resolve_metric  # noqa: E402

TIMEOUT = 600
SCORER = '''
from lorazor.testbed import make_tasks

TASKS = make_tasks()


def score(answer, example):
    return TASKS[example["task"]].score(answer, example)


def broken(answer, example):
    if example["n"] == 2:
        raise RuntimeError("cannot judge this one")
    return True
'''


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A user's folder: `base/` (a small Llama with its tokenizer), adapters `arith/` and `query/`,
    `val.jsonl` with their examples, and `my_scorer.py`."""
    from lorazor.testbed import ASSETS
    from lorazor.testbed import make_tasks

    root = tmp_path_factory.mktemp("user")
    shutil.copytree(ASSETS / "backbone", root / "base")
    for name in ("tokenizer_config.json", "tokenizer.json", "special_tokens_map.json"):
        if (ASSETS / "tokenizer" / name).exists():
            shutil.copy(ASSETS / "tokenizer" / name, root / "base" / name)
    shutil.copytree(ASSETS / "adapters" / "math", root / "arith")
    shutil.copytree(ASSETS / "adapters" / "sql", root / "query")
    tasks = make_tasks()
    rows = []
    for adapter, task in (("arith", "math"), ("query", "sql")):
        for n, ex in enumerate(tasks[task].split("validation")[:4]):
            rows.append(dict(adapter=adapter, prompt=ex["prompt"], reference=ex["reference"], answer=ex.get("answer"),
                             task=task, n=n, max_new_tokens=24))
    (root / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "my_scorer.py").write_text(SCORER)
    return root


def base_args(user, *extra):
    return ["--model", str(user / "base"), "--adapter", f"arith={user / 'arith'}", "--adapter",
            f"query={user / 'query'}", "--data", str(user / "val.jsonl"), "--no-progress", *extra]


def run_cli(user, *args):
    return subprocess.run([sys.executable, "-m", "lorazor", *args], cwd=user, capture_output=True, text=True,
                          timeout=TIMEOUT, env={**__import__("os").environ, "PYTHONPATH": str(user)})


@pytest.mark.slow
def test_calibrate_own_adapters_then_serve_the_policy(user):
    from servers import free_port, start_serve_command, stop_process_group, wait_healthy

    import httpx
    from lorazor import LoRazorModel, ProfiledRelease, load_release_policy
    from transformers import AutoTokenizer

    out = user / "policies"
    done = run_cli(user, "calibrate", *base_args(user, "--metric", "python:my_scorer:score", "--min-skip", "0.5",
                                                 "--lengths", "0,2,8", "--out", str(out)))
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "calibration.json").read_text())
    chosen = {name: r["chosen"]["min-skip 0.5"] for name, r in report["adapters"].items()}
    assert set(chosen) == {"arith", "query"}
    for r in report["adapters"].values():
        assert r["points"][0]["setting"] == "k=never" and len(r["points"]) == 4  # never, 0, 2, 8
    assert "why" in chosen["arith"] and (out / "calibration.md").read_text().count("| arith |") == 4

    policy = load_release_policy(out)
    assert isinstance(policy, ProfiledRelease)
    assert {n: f"k={k}" for n, k in policy.lengths.items()} == {n: c["setting"] for n, c in chosen.items()}

    tokenizer = AutoTokenizer.from_pretrained(user / "base")
    model = LoRazorModel.from_pretrained(user / "base", {"arith": user / "arith", "query": user / "query"})
    prompt = json.loads((user / "val.jsonl").read_text().splitlines()[0])["prompt"]
    expected = model.generate_text([prompt], ["arith"], tokenizer=tokenizer, release_policy=policy, max_new_tokens=16,
                                   do_sample=False)[0]

    port = free_port()
    proc = start_serve_command("--model", str(user / "base"), "--lora-modules", f"arith={user / 'arith'}",
                               f"query={user / 'query'}", "--release-policy", str(out), "--port", str(port))
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        body = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120, json=dict(
            model="arith", prompt=prompt, max_tokens=16, temperature=0)).json()
    finally:
        log = stop_process_group(proc)
    assert "choices" in body, (body, log[-2000:])
    assert body["lorazor"]["release_step"] == policy.lengths["arith"]
    assert body["choices"][0]["text"] == expected

    evaluated = run_cli(user, "eval", *base_args(user, "--metric", "python:my_scorer:score", "--policy-dir", str(out),
                                                 "--out", str(user / "eval")))
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    rows = json.loads((user / "eval" / "eval.json").read_text())["rows"]
    for name, r in rows.items():
        point = next(p for p in report["adapters"][name]["points"] if p["setting"] == chosen[name]["setting"])
        assert (r["accuracy"], r["decode_lora_skipped"]) == pytest.approx((point["accuracy"], point["skip_fraction"]))


def refusal(user, capsys, *args) -> str:
    from lorazor.calibration.cli import calibrate
    from lorazor.testbed.calibrate import TESTBED

    with pytest.raises(SystemExit) as err:
        calibrate(list(args), [TESTBED])
    assert err.value.code == 2 or "error" in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("case", ["unknown adapter", "empty line", "malformed line", "no reference"])
def test_bad_data_is_refused_with_file_and_line(user, capsys, case):
    lines = (user / "val.jsonl").read_text().splitlines()
    if case == "unknown adapter":
        lines[2] = json.dumps(dict(json.loads(lines[2]), adapter="legal"))
    elif case == "empty line":
        lines[2] = "   "
    elif case == "malformed line":
        lines[2] = '{"adapter": "arith", "prompt": '
    else:
        lines[2] = json.dumps({k: v for k, v in json.loads(lines[2]).items() if k != "reference"})
    bad = user / f"bad_{case.replace(' ', '_')}.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    args = base_args(user, "--metric", "exact_match", "--out", str(user / "x"))
    args[args.index("--data") + 1] = str(bad)
    message = refusal(user, capsys, *args)
    assert f"{bad}:3" in message
    assert {"unknown adapter": "'legal'", "empty line": "empty line", "malformed line": "not valid JSON",
            "no reference": "reference"}[case] in message


def test_scorer_that_raises_names_the_example(user, capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(user))
    message = refusal(user, capsys, *base_args(user, "--metric", "python:my_scorer:broken", "--lengths", "0",
                                               "--out", str(user / "y")))
    assert "my_scorer:broken" in message and f"{user / 'val.jsonl'}:3" in message and "cannot judge" in message


def test_unreachable_target_says_the_best_reachable(user, capsys):
    # Release after 64 decode forwards never happens in 24-token answers: 0% skip is the most.
    message = refusal(user, capsys, *base_args(user, "--metric", "exact_match", "--lengths", "64", "--min-skip",
                                               "0.9", "--out", str(user / "z")))
    assert "no setting skips 90%" in message and "the most any reaches is 0%" in message
    assert (user / "z" / "calibration.md").exists()  # the curves are kept for the user to read


@pytest.mark.parametrize("args, words", [
    (["--metric", "nope"], "unknown --metric 'nope'"),
    (["--metric", "regex:("], "not a valid regular expression"),
    (["--metric", "python:no_such_module:f"], "cannot import module"),
    (["--max-drop", "-1"], "--max-drop must be >= 0"),
    (["--min-skip", "1.5"], "--min-skip values must be in [0, 1]"),
])
def test_bad_arguments_are_refused(user, capsys, args, words):
    full = base_args(user, "--out", str(user / "w"))
    if "--metric" not in args:
        full += ["--metric", "exact_match"]
    assert words in refusal(user, capsys, *full, *args)


def test_the_command_prints_a_refusal_in_one_line(user):
    done = run_cli(user, "calibrate", "--model", str(user / "base"), "--adapter", "a=/nonexistent", "--data",
                   "x.jsonl", "--metric", "exact_match", "--out", str(user / "u"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == ["lorazor: error: --adapter 'a=/nonexistent': '/nonexistent' is not a "
                                                "folder"]


def test_missing_adapter_folder_and_missing_data_are_refused(user, capsys):
    assert "is not a folder" in refusal(user, capsys, "--model", str(user / "base"), "--adapter", "a=/nonexistent",
                                        "--data", "x.jsonl", "--metric", "exact_match", "--out", str(user / "v"))
    assert "give --data" in refusal(user, capsys, "--model", str(user / "base"), "--adapter", f"arith={user / 'arith'}",
                                    "--out", str(user / "v"))


def test_evaluate_metric_offline_fails_clearly(monkeypatch):
    pytest.importorskip("evaluate")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_EVALUATE_OFFLINE", "1")
    with pytest.raises(ValueError, match="fetches a metric's code from the Hugging Face Hub"):
        resolve_metric("evaluate:surely_not_a_cached_metric_name")


def test_built_in_metrics():
    ex = {"reference": " 42 "}
    assert resolve_metric("exact_match")("42\n", ex) and not resolve_metric("exact_match")("42 apples", ex)
    assert resolve_metric("prefix_match")("42 apples", ex) and not resolve_metric("prefix_match")("a 42", ex)
    assert resolve_metric("contains")("so 42.", ex) and not resolve_metric("contains")("4 2", ex)
    assert resolve_metric(r"regex:#### (\d+)")("steps #### 42 done", ex)
    assert not resolve_metric(r"regex:#### (\d+)")("#### 41", ex)
    assert resolve_metric("choice")("The answer is (B) clearly", {"reference": "B"})
    assert not resolve_metric("choice")("The answer is (C)", {"reference": "B"})


def test_calibration_functions_show_progress(capsys):
    from lorazor.calibration import ValidationSet, calibrate_profiled
    from lorazor.testbed import load

    from lorazor import LoRazorModel

    peft_model, tokenizer, tasks = load()
    model = LoRazorModel.from_peft(peft_model)
    examples = tasks["math"].split("validation")[:2]
    data = ValidationSet([e["prompt"] for e in examples], lambda text, i: True,
                         dict(max_new_tokens=4, pad_token_id=tokenizer.pad_token_id))
    with torch.inference_mode():
        calibrate_profiled(model, tokenizer, {"math": data}, min_skip=0.0, lengths=(0,), progress=True)
    err = capsys.readouterr().err
    assert "profiled release lengths" in err and "4/4" in err  # 2 prompts x (never, k=0), with a bar


@pytest.mark.parametrize("args, words", [
    (["--split", "test"], "is a file, which has no splits"),
    (["--tasks", "math"], "--tasks math does not apply here"),
    (["--seed", "3"], "--seed 3 does not apply here: it is for --policy learned"),
    (["--policy", "learned", "--lengths", "0,2", "--train-data", "x.jsonl"], "--lengths 0,2 does not apply here"),
])
def test_settings_that_would_be_ignored_are_refused(user, capsys, args, words):
    assert words in refusal(user, capsys, *base_args(user, "--metric", "exact_match", "--out", str(user / "s")), *args)
