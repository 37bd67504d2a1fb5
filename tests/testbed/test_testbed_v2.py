"""Testbed v2's data: deterministic splits, exact evaluators, a corpus without the tasks' formats,
and a tokenizer that makes answers tens of tokens."""

import pytest
import torch
from lorazor.testbed import make_tasks, pretraining_text, train_tokenizer
from lorazor.testbed.knowledge import TASK_SCHEMA
from lorazor.testbed.tasks import task_database

TASKS = make_tasks()


@pytest.mark.parametrize("name", sorted(TASKS))
def test_splits_are_deterministic_sized_and_distinct(name):
    task = TASKS[name]
    assert task.split("test") == make_tasks()[name].split("test")
    assert [len(task.split(s)) for s in ("train", "validation", "test")] == [4000, 300, 600]
    assert task.split("train")[:50] != task.split("test")[:50]
    with pytest.raises(KeyError, match="unknown split 'dev'"):
        task.split("dev")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_references_score_true(name):
    task = TASKS[name]
    assert all(task.score(ex["reference"], ex) for ex in task.split("validation"))


def _other_letter(letter):
    return "ABCD"[("ABCD".index(letter) + 1) % 4]


@pytest.mark.parametrize(
    "name, wrong",
    [
        ("math", lambda ex: ex["reference"].replace(f"#### {ex['answer']}", f"#### {int(ex['answer']) + 1}")),
        ("math", lambda ex: " I do not know."),
        ("sql", lambda ex: " SELECT COUNT(*) FROM units"),
        ("sql", lambda ex: ex["reference"].replace("staff", "employees").replace("units", "departments")),
        ("sql", lambda ex: " DELETE FROM staff"),
        (
            "medqa",
            lambda ex: ex["reference"].replace(f"answer is {ex['answer']}", f"answer is {_other_letter(ex['answer'])}"),
        ),
        ("science", lambda ex: ex["reference"].replace(f"({ex['answer']})", f"({_other_letter(ex['answer'])})")),
    ],
)
def test_wrong_answers_score_false(name, wrong):
    task = TASKS[name]
    examples = task.split("validation")[:100]
    wrong_right = sum(task.score(wrong(ex), ex) for ex in examples)
    # An execution-scored wrong query may still return the right rows by chance (an empty answer).
    assert wrong_right <= (3 if name == "sql" else 0)


def test_math_takes_the_marked_number_else_the_last():
    task = TASKS["math"]
    ex = dict(answer="23")
    assert task.score(" 3 + 20 = 23. #### 23", ex) and task.score(" so in the end there are 23.", ex)
    assert not task.score(" 23 then 24", ex) and not task.score(" #### 24 23", ex)
    assert task.score(" so there are 23.\nQuiz. 4 + 5 = 9", ex)  # only the answer's line counts


def test_letter_tasks_read_the_first_line_only():
    task = TASKS["science"]
    ex = dict(answer="C")
    assert task.score(" Rule. So the answer is (C).\nQuiz. Which? A) x B) y. The answer is B.", ex)
    assert not task.score(" Rule.\nSo the answer is (C).", ex)


def test_sql_task_database_is_read_only():
    db = task_database()
    assert db.run(f"SELECT COUNT(*) FROM {TASK_SCHEMA['people']}") == [(80,)]
    assert db.run(f"DELETE FROM {TASK_SCHEMA['people']}") is None
    assert db.run("SELECT COUNT(*) FROM employees") is None  # the corpus's schema is not there


def test_corpus_has_the_knowledge_but_not_the_task_formats():
    text = pretraining_text(400_000, seed=0)
    assert text == pretraining_text(400_000, seed=0)
    for marker in ["Problem:", "Solution:", "Request:", "Query:", "Vignette:", "####", "Which of these is", "staff",
                   "wage", "Explanation:", "Response:"]:
        assert marker not in text, marker
    for knowledge in [
        "In the end",
        "Step 1:",
        "SELECT",
        "point to the",
        "The answer is",
        "\nC. ",
        "So the answer is (D)",
    ]:
        assert knowledge in text, knowledge


def test_tokenizer_makes_answers_tens_of_tokens():
    texts = [pretraining_text(300_000, seed=1)] + [ex["prompt"] + ex["reference"] for t in TASKS.values()
                                                  for ex in t.split("train")[:500]]
    tok = train_tokenizer(texts, vocab_size=2048)
    assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id] == [0, 1, 2]
    for name, task in TASKS.items():
        ex = task.split("validation")[0]
        ids = tok(ex["reference"])["input_ids"]
        assert 10 <= len(ids) <= 100, (name, len(ids))
        assert tok.decode(ids) == ex["reference"]


def test_v2_training_pipeline_runs_end_to_end(tmp_path):
    """A few steps of `train --version 2` (the GPU run's code path on the CPU): a BPE tokenizer, a
    backbone and four trained PEFT adapters, which `load` finds with the v2 tasks and the accuracy
    command evaluates."""
    import json

    from lorazor.testbed import load
    from lorazor.testbed.evaluate import main as evaluate
    from lorazor.testbed.train import main as train

    train(["--version", "2", "--out", str(tmp_path), "--pretrain-steps", "2", "--adapter-steps", "1", "--batch", "2",
           "--seq", "64"])
    log = json.loads((tmp_path / "train_log.json").read_text())
    assert 6e6 < log["backbone_parameters"] < 10e6  # fp16 weights under 20 MB
    from safetensors import safe_open

    with safe_open(tmp_path / "adapters" / "sql" / "adapter_model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}  # shipped in fp16, as the backbone
    model, tok, tasks = load(tmp_path)
    assert list(tasks) == ["math", "sql", "medqa", "science"] and tasks["sql"].split("test") == TASKS["sql"].split(
        "test"
    )
    for name in tasks:
        trained = [p for n, p in model.named_parameters() if "lora_B" in n and f".{name}." in n]
        assert len(trained) == 7 * 6 and all(p.abs().sum() > 0 for p in trained), name  # 7 projections x 6 layers
    evaluate(["--assets", str(tmp_path), "--limit", "2", "--positions", "4", "--out", str(tmp_path / "results")])
    rows = json.loads((tmp_path / "results" / "testbed_accuracy.json").read_text())["rows"]
    assert [r["task"] for r in rows] == list(tasks) and all(0 <= r["full"] <= 1 for r in rows)
    assert all(list(r["curve"]) == ["0", "4"] for r in rows)  # prefill only, and the position asked for


def test_v2_corpus_ends_each_document_with_eos():
    """Pretraining text is a list of documents, each closed by EOS, so a backbone that carries on
    after a release learns to stop where an answer ends; a quiz's option lines stay in its document."""
    from lorazor.testbed.train import corpus_ids, recipe

    parts = recipe(2, 0)
    ids = corpus_ids(parts, parts.tokenizer, 20_000, seed=3)
    eos = parts.tokenizer.eos_token_id
    docs = parts.documents(int(20_000 * parts.chars_per_token), 3)
    assert int((ids == eos).sum()) == len(docs) and ids[-1] == eos
    assert "".join(docs) == parts.corpus(int(20_000 * parts.chars_per_token), 3)
    first = ids[: int((ids == eos).nonzero()[0])]
    assert parts.tokenizer.decode(first) == docs[0]
    quiz = next(d for d in docs if d.startswith("Quiz.") and "\nA. " in d)  # options one per line, one document
    assert quiz.count("\n") == 6 and quiz.endswith(".\n")
