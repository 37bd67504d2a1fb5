"""Profiled-release calibration: the selection rules on hand-built curves, and a real curve on the testbed."""

import pytest
import torch
from lorazor import LoRazorConfig, LoRazorModel, load_release_policy
from lorazor.calibration import (
    ReleasePoint,
    ValidationSet,
    calibrate_profiled,
    evaluate_release,
    pareto_front,
    select_release_length,
)
from lorazor.testbed import ASSETS

CURVE = [
    ReleasePoint(None, 0.80, 0.0),
    ReleasePoint(0, 0.10, 1.0),
    ReleasePoint(2, 0.70, 0.9),
    ReleasePoint(4, 0.79, 0.6),
    ReleasePoint(8, 0.79, 0.4),  # dominated by k=4: same accuracy, less skipping
    ReleasePoint(16, 0.80, 0.2),
]


def test_pareto_front_drops_dominated_points():
    # k=8 loses to k=4 (same accuracy, less skipping); full LoRA loses to k=16 (same accuracy, 20% skip).
    assert [p.k for p in pareto_front(CURVE)] == [16, 4, 2, 0]


@pytest.mark.parametrize("drop, k", [(0.0, 16), (0.01, 4), (0.05, 4), (0.1, 2), (1.0, 0)])
def test_max_accuracy_drop_takes_the_most_skipping_within_the_drop(drop, k):
    assert select_release_length(CURVE, max_accuracy_drop=drop) == k


@pytest.mark.parametrize("skip, k", [(0.0, 16), (0.5, 4), (0.7, 2), (0.95, 0)])
def test_min_skip_takes_the_best_accuracy_that_skips_enough(skip, k):
    assert select_release_length(CURVE, min_skip=skip) == k


def test_full_lora_when_nothing_else_holds_accuracy():
    curve = [ReleasePoint(None, 0.9, 0.0), ReleasePoint(0, 0.2, 1.0), ReleasePoint(8, 0.5, 0.5)]
    assert select_release_length(curve, max_accuracy_drop=0.01) is None


def test_ties_keep_the_adapter_longer():
    # Answers too short for k >= 2 to skip anything: k=2, 8 and full LoRA measure the same.
    curve = [ReleasePoint(None, 0.9, 0.0), ReleasePoint(2, 0.9, 0.0), ReleasePoint(8, 0.9, 0.0),
             ReleasePoint(1, 0.7, 0.6), ReleasePoint(0, 0.0, 1.0)]
    assert select_release_length(curve, max_accuracy_drop=0.05) is None
    assert select_release_length(curve, min_skip=0.0) is None
    assert select_release_length(curve[1:] + curve[:1], min_skip=0.0) is None  # order does not matter
    assert select_release_length(curve, min_skip=0.5) == 1


def test_bad_criteria_are_named():
    with pytest.raises(ValueError, match="exactly one"):
        select_release_length(CURVE)
    with pytest.raises(ValueError, match="exactly one"):
        select_release_length(CURVE, max_accuracy_drop=0.1, min_skip=0.5)
    with pytest.raises(ValueError, match="no release length skips 95%"):
        select_release_length([CURVE[0], CURVE[2], CURVE[3]], min_skip=0.95)
    with pytest.raises(ValueError, match="full-LoRA point"):
        select_release_length(CURVE[1:], min_skip=0.5)
    with pytest.raises(ValueError, match="min_skip must be in"):
        select_release_length(CURVE, min_skip=1.5)


@pytest.fixture(scope="module")
def testbed():
    if not (ASSETS / "backbone" / "model.safetensors").exists():
        pytest.skip("testbed weights not installed")
    from lorazor.testbed import load

    peft_model, tokenizer, tasks = load()
    return LoRazorModel.from_peft(peft_model, LoRazorConfig()), tokenizer, tasks


def _validation(task, n=12):
    examples = task.split("validation")[:n]
    return [ex["prompt"] for ex in examples], (lambda text, i: task.score(text, examples[i]))


def test_testbed_curve_and_saved_policy(testbed, tmp_path):
    model, tokenizer, tasks = testbed
    gen = dict(max_new_tokens=tasks["sql"].max_new_tokens, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    data = ValidationSet(*_validation(tasks["sql"]), gen)
    policy, curves = calibrate_profiled(model, tokenizer, {"sql": data}, min_skip=0.5, lengths=(0, 1, 2), batch_size=5)
    curve = curves["sql"]
    assert [p.k for p in curve] == [None, 0, 1, 2]
    full, prefill_only = curve[0], curve[1]
    assert full.skip_fraction == 0.0 and prefill_only.skip_fraction == 1.0
    # The sql adapter matters (the backbone alone scores far lower) and the chosen k honours the rule.
    backbone = evaluate_release(model, tokenizer, None, *_validation(tasks["sql"]), **gen)
    assert full.accuracy >= backbone.accuracy + 0.3
    chosen = next(p for p in curve if p.k == policy.lengths["sql"])
    assert chosen.skip_fraction >= 0.5
    assert chosen.accuracy == max(p.accuracy for p in curve if p.skip_fraction >= 0.5)
    # A release length the curve measured reproduces through the saved, reloaded policy.
    from lorazor import save_release_policy

    save_release_policy(policy, tmp_path)
    loaded = load_release_policy(tmp_path)
    assert loaded.lengths == policy.lengths
    again = evaluate_release(model, tokenizer, "sql", *_validation(tasks["sql"]), k=loaded.lengths["sql"], **gen)
    assert again == chosen
    assert tokenizer.padding_side == "left"


def test_unknown_adapter_and_empty_prompts(testbed):
    model, tokenizer, _ = testbed
    from lorazor.calibration import profile_release_lengths

    with pytest.raises(KeyError, match="unknown adapter 'law'"):
        profile_release_lengths(model, tokenizer, "law", ["x"], lambda t, i: True)
    with pytest.raises(ValueError, match="prompts is empty"):
        evaluate_release(model, tokenizer, "sql", [], lambda t, i: True)
    with pytest.raises(ValueError, match="release lengths must be ints"):
        profile_release_lengths(model, tokenizer, "sql", ["x"], lambda t, i: True, lengths=(1, -2))
    torch.manual_seed(0)


# ---- learned heads ------------------------------------------------------------------------------

from lorazor.calibration import (  # noqa: E402
    ReleaseExamples,
    calibrate_learned,
    collect_release_examples,
    train_risk_head,
)


def test_risk_head_separates_risky_examples_and_folds_standardization_back():
    g = torch.Generator().manual_seed(0)
    n, hidden = 400, 16
    risky = torch.rand(n, generator=g) < 0.3
    # Features on a large offset and scale: the head must still score raw hidden states correctly.
    x = torch.randn(n, hidden, generator=g) * 5 + 100
    x[:, 3] += risky.float() * 25  # 5 standard deviations apart
    w, b = train_risk_head(ReleaseExamples(x, risky, torch.arange(n), torch.zeros(n, dtype=torch.long)))
    scores = x @ w + b
    # Ranking (what thresholds use): nearly every risky example scores above every safe one.
    auc = (scores[risky][:, None] > scores[~risky][None, :]).float().mean()
    assert auc > 0.97
    contribution = (w * x.std(0)).abs()  # per-feature weight on the standardized scale
    assert contribution[3] > 5 * contribution[torch.arange(hidden) != 3].max()


def test_risk_head_gives_each_request_equal_weight():
    # Request 0 contributes 50 copies of one non-risky example; the 10 other requests are risky at the
    # same point. Per request that is 10 risky votes to 1, so the head must call the point risky.
    h = torch.zeros(60, 4)
    risky = torch.tensor([False] * 50 + [True] * 10)
    request = torch.tensor([0] * 50 + list(range(1, 11)))
    w, b = train_risk_head(ReleaseExamples(h, risky, request, torch.zeros(60, dtype=torch.long)))
    assert b > 0


def test_risk_head_with_one_label_only():
    h = torch.randn(5, 3)
    w, b = train_risk_head(ReleaseExamples(h, torch.zeros(5, dtype=torch.bool), torch.arange(5), torch.zeros(5)))
    assert torch.all(w == 0) and b < 0


def test_paired_continuations_label_what_release_breaks(testbed):
    model, tokenizer, tasks = testbed
    prompts, score = _validation(tasks["sql"], n=10)
    gen = dict(max_new_tokens=tasks["sql"].max_new_tokens, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    ex = collect_release_examples(model, tokenizer, "sql", ValidationSet(prompts, score, gen), positions=(0, 1, 5))
    assert ex.hidden.shape == (len(ex.risky), model.model.config.hidden_size)
    assert set(ex.position.tolist()) == {0, 1, 5}  # sql answers run for tens of tokens
    # Re-derive the labels from two independent generations.
    for t in (0, 5):
        rows = ex.position == t
        on = [
            evaluate_release(model, tokenizer, "sql", [prompts[i]], lambda a, _, i=i: score(a, i), None, **gen).accuracy
            for i in ex.request[rows].tolist()
        ]
        off = [evaluate_release(model, tokenizer, "sql", [prompts[i]], lambda a, _, i=i: score(a, i), t, **gen).accuracy
               for i in ex.request[rows].tolist()]
        expected = [a == 1.0 and b == 0.0 for a, b in zip(on, off)]
        assert ex.risky[rows].tolist() == expected
    assert bool(ex.risky.any()), "sql released at step 0 must break some answers"


def test_calibrate_learned_end_to_end(testbed, tmp_path):
    model, tokenizer, tasks = testbed
    gen = dict(max_new_tokens=tasks["sql"].max_new_tokens, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    train_examples = tasks["sql"].split("train")[:16]
    train = ValidationSet([ex["prompt"] for ex in train_examples],
                          lambda a, i: tasks["sql"].score(a, train_examples[i]), gen)
    val = ValidationSet(*_validation(tasks["sql"], n=10), gen)
    policy, curves = calibrate_learned(model, tokenizer, {"sql": train}, {"sql": val}, min_skip=0.5,
                                       positions=(0, 1), quantiles=(0.25, 0.5, 0.75))
    curve = curves["sql"]
    taus = [p.tau for p in curve]
    assert taus[0] == float("-inf") and taus[-1] == float("inf") and taus == sorted(taus)
    assert curve[0].skip_fraction == 0.0 and curve[-1].skip_fraction == 1.0
    w, b, tau = policy.heads["sql"]
    chosen = next(p for p in curve if p.tau == tau)
    assert chosen.skip_fraction >= 0.5
    assert chosen.accuracy == max(p.accuracy for p in curve if p.skip_fraction >= 0.5)
    from lorazor import save_release_policy

    save_release_policy(policy, tmp_path)
    loaded = load_release_policy(tmp_path)
    lw, lb, ltau = loaded.heads["sql"]
    torch.testing.assert_close(lw, w.float()) and None
    assert abs(lb - b) < 1e-6 and ltau == tau
    with pytest.raises(ValueError, match="same adapters"):
        calibrate_learned(model, tokenizer, {"sql": train}, {"math": val}, min_skip=0.5)


def test_cli_forwards_to_the_testbed_tools(capsys):
    from lorazor.cli import main

    for command, flag in (("calibrate", "--min-skip"), ("eval", "--limit")):
        with pytest.raises(SystemExit) as exc:
            main([command, "--help"])
        assert exc.value.code == 0 and flag in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["calibrate", "--policy", "oracle", "--min-skip", "0.5", "--out", "x"])
    assert exc.value.code == 2 and "invalid choice: 'oracle'" in capsys.readouterr().err
