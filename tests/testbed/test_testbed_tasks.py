"""The earlier character-level testbed's (v1) tasks: deterministic splits, evaluators that accept
right and reject wrong answers, safe SQL; its training pipeline; and the shipped (v2) testbed's
weights: they load in seconds and their adapters beat the backbone."""

import pytest
from lorazor.testbed.v1.tasks import make_tasks
from lorazor.testbed.sql import build_database, run_query

TASKS = make_tasks()


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_deterministic_and_disjoint_in_seed(name):
    task = TASKS[name]
    test = task.split("test")
    again = make_tasks()[name].split("test")
    assert test == again and len(test) == 300
    assert all(set(ex) >= {"prompt", "reference"} for ex in test)
    assert task.split("train")[:20] != test[:20]


@pytest.mark.parametrize("name", sorted(TASKS))
def test_reference_answers_score_true(name):
    task = TASKS[name]
    examples = task.split("validation")
    assert all(task.score(ex["reference"], ex) for ex in examples)


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("math", lambda ex: ex["reference"].replace(f"Answer: {ex['answer']}", f"Answer: {int(ex['answer']) + 1}")),
        ("math", lambda ex: " I do not know."),
        ("sql", lambda ex: " SELECT COUNT(*) FROM departments"),
        ("sql", lambda ex: " DROP TABLE employees"),
        ("mcq", lambda ex: " " + "ABCD"[("ABCD".index(ex["answer"]) + 1) % 4]),
        ("explain", lambda ex: ex["reference"][: ex["reference"].rindex("Answer:")] + "Answer: "
         + "ABCD"[("ABCD".index(ex["answer"]) + 1) % 4]),
    ],
)
def test_wrong_answers_score_false(name, wrong):
    task = TASKS[name]
    examples = task.split("validation")[:50]
    assert not any(task.score(wrong(ex), ex) for ex in examples)


def test_sql_executor_is_read_only_and_time_limited():
    db = build_database()
    assert run_query(db, "SELECT COUNT(*) FROM employees") == [(60,)]
    assert run_query(db, "DELETE FROM employees") is None
    assert run_query(db, "SELECT 1; DROP TABLE employees") is None
    assert run_query(db, "SELECT COUNT(*) FROM employees") == [(60,)]
    slow = "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r) SELECT COUNT(*) FROM r"
    assert run_query(db, slow, time_limit_s=0.05) is None


def test_unknown_split():
    with pytest.raises(KeyError, match="unknown split 'dev'"):
        TASKS["math"].split("dev")


def test_train_load_and_evaluate_pipeline(tmp_path):
    """A few training steps through the real scripts, then load() and one evaluation pass."""
    import torch
    from lorazor import LoRazorModel
    from lorazor.testbed import load
    from lorazor.testbed.evaluate import run_task
    from lorazor.testbed.train import main as train

    train(["--version", "1", "--out", str(tmp_path), "--pretrain-steps", "2", "--adapter-steps", "1", "--batch", "2",
           "--seq", "32"])
    peft_model, tokenizer, tasks = load(tmp_path)
    assert sorted(tasks) == ["explain", "math", "mcq", "sql"]
    assert sorted(peft_model.peft_config) == sorted(tasks)
    assert tokenizer.decode(tokenizer("Answer: 42")["input_ids"]) == "Answer: 42"
    model = LoRazorModel.from_peft(peft_model)
    accuracy, skip = run_task(model, tokenizer, tasks["mcq"], "mcq", 0, limit=3)
    assert 0.0 <= accuracy <= 1.0 and skip == 1.0
    assert all(p.dtype == torch.float32 for p in model.model.parameters())


def test_load_without_weights_names_the_folder(tmp_path):
    from lorazor.testbed import load

    with pytest.raises(FileNotFoundError, match="no testbed weights in"):
        load(tmp_path)


def test_shipped_testbed_loads_and_its_adapters_matter():
    import time

    from lorazor import LoRazorModel
    from lorazor.testbed import ASSETS, load
    from lorazor.testbed.evaluate import run_task

    size = sum(f.stat().st_size for f in ASSETS.rglob("*") if f.is_file())
    assert size < 20e6, f"the shipped testbed is {size / 1e6:.1f} MB"
    start = time.time()
    peft_model, tokenizer, tasks = load()
    assert time.time() - start < 30, "the testbed must load in seconds"
    assert list(tasks) == ["math", "sql", "medqa", "science"] == sorted(peft_model.peft_config, key=list(tasks).index)
    assert tokenizer.padding_side == "left" and tokenizer.eos_token_id == 2
    model = LoRazorModel.from_peft(peft_model)
    for name, task in tasks.items():
        full, _ = run_task(model, tokenizer, task, name, "full", limit=12)
        base, _ = run_task(model, tokenizer, task, name, "backbone", limit=12)
        assert full >= base + 0.2, (name, full, base)
