"""Profiled-release calibration: the selection rules on hand-built curves, and a real curve on the testbed."""

import pytest
import torch
from lorazor import LoRazorConfig, LoRazorModel, load_release_policy
from lorazor.calibrate import (
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
    gen = dict(max_new_tokens=tasks["mcq"].max_new_tokens, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id)
    data = ValidationSet(*_validation(tasks["mcq"]), gen)
    policy, curves = calibrate_profiled(model, tokenizer, {"mcq": data}, min_skip=0.5, lengths=(0, 1, 2), batch_size=5)
    curve = curves["mcq"]
    assert [p.k for p in curve] == [None, 0, 1, 2]
    full, prefill_only = curve[0], curve[1]
    assert full.skip_fraction == 0.0 and prefill_only.skip_fraction == 1.0
    # The mcq adapter matters (the backbone alone scores far lower) and the chosen k honours the rule.
    backbone = evaluate_release(model, tokenizer, None, *_validation(tasks["mcq"]), **gen)
    assert full.accuracy >= backbone.accuracy + 0.3
    chosen = next(p for p in curve if p.k == policy.lengths["mcq"])
    assert chosen.skip_fraction >= 0.5
    assert chosen.accuracy == max(p.accuracy for p in curve if p.skip_fraction >= 0.5)
    # A release length the curve measured reproduces through the saved, reloaded policy.
    from lorazor import save_release_policy

    save_release_policy(policy, tmp_path)
    loaded = load_release_policy(tmp_path)
    assert loaded.lengths == policy.lengths
    again = evaluate_release(model, tokenizer, "mcq", *_validation(tasks["mcq"]), k=loaded.lengths["mcq"], **gen)
    assert again == chosen
    assert tokenizer.padding_side == "left"


def test_unknown_adapter_and_empty_prompts(testbed):
    model, tokenizer, _ = testbed
    from lorazor.calibrate import profile_release_lengths

    with pytest.raises(KeyError, match="unknown adapter 'law'"):
        profile_release_lengths(model, tokenizer, "law", ["x"], lambda t, i: True)
    with pytest.raises(ValueError, match="prompts is empty"):
        evaluate_release(model, tokenizer, "mcq", [], lambda t, i: True)
    with pytest.raises(ValueError, match="release lengths must be ints"):
        profile_release_lengths(model, tokenizer, "mcq", ["x"], lambda t, i: True, lengths=(1, -2))
    torch.manual_seed(0)
