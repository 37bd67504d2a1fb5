"""Calibrate StepTrim's profiled release lengths on validation data (paper 3.2.1), and the
evaluation and selection pieces the learned calibration shares.

For each adapter, generate its validation prompts once per candidate release length k (and once
with the adapter kept to the end), score the answers, and keep (k, accuracy, decode LoRA calls
skipped). Every (adapter, k, prompt) runs on the engine in one continuous batch (`runs.py`). Then
pick k by a quality-efficiency criterion and freeze it:

    curve = profile_release_lengths(model, tokenizer, "sql", prompts, score, max_new_tokens=64)
    k = select_release_length(curve, max_accuracy_drop=0.01)      # or min_skip=0.5 (the paper's setting)
    policy = ProfiledRelease({"sql": k})

`calibrate_profiled` does this for several adapters (a `ValidationSet` each) and returns the
`ProfiledRelease`;
`save_release_policy` stores it beside the adapters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from ..policies import ProfiledRelease, ReleasePolicy
from .runs import run_cases
from ..config import int_in_range

if TYPE_CHECKING:
    from ..model import LoRazorModel

# Release lengths tried by default: dense where the testbed's and the paper's curves bend.
DEFAULT_RELEASE_LENGTHS = (0, 1, 2, 3, 4, 8, 16, 32, 64)


@dataclass(frozen=True)
class ReleasePoint:
    """One calibration measurement.

    Attributes:
        k: release length (None: the adapter is kept to the end, i.e. full LoRA).
        accuracy: fraction of prompts whose answer `score` accepted.
        skip_fraction: decode LoRA calls skipped over calls needed, weighted by decode length.
        tau: for a learned-policy point, its threshold (-inf: never release, i.e. full LoRA).
    """

    k: int | None
    accuracy: float
    skip_fraction: float
    tau: float | None = None

    @property
    def is_full_lora(self) -> bool:
        return self.k is None and (self.tau is None or self.tau == float("-inf"))


@dataclass
class ValidationSet:
    """One adapter's calibration data.

    Attributes:
        prompts: validation prompts (text, or token ids as the tokenizer would give them).
        score: `score(answer_text, prompt_index) -> bool`, the task's evaluator.
        generate_kwargs: this task's generation settings (`max_new_tokens`, `eos_token_id`, ...);
            they set how long answers run, so they belong to the task, not the calibration.
    """

    prompts: Sequence[str | Sequence[int]]
    score: Callable[[str, int], bool]
    generate_kwargs: dict = field(default_factory=dict)


def generate_answers(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, adapter: str | None, prompts: Sequence[str],
    generate_kwargs: dict, policy: ReleasePolicy | None = None, release: Sequence | None = None,
):
    """(answer texts, `LoRazorOutput`) of one batch of prompts on `adapter`, left-padded."""
    from .runs import encode_prompt

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    try:
        enc = tokenizer.pad({"input_ids": [encode_prompt(tokenizer, p) for p in prompts]}, return_tensors="pt")
    finally:
        tokenizer.padding_side = side
    ids = enc["input_ids"].to(model.device)
    out = model.generate(
        ids,
        attention_mask=enc["attention_mask"].to(model.device),
        adapter_ids=[adapter] * len(prompts),
        release_policy=policy,
        release=release,
        **generate_kwargs,
    )
    return tokenizer.batch_decode(out.sequences[:, ids.shape[1]:], skip_special_tokens=True), out


def policy_outcomes(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, adapter: str | None, data: ValidationSet,
    policy: ReleasePolicy | None, batch_size: int = 64, progress: bool = False,
) -> tuple[list[bool], float]:
    """(per-prompt correctness, decode skip) of `adapter` on `data` under a release `policy`
    (None: model default), on the engine with `batch_size` requests at once. `adapter` None runs
    the backbone alone (skip fraction 1.0 by definition)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return run_cases(model, tokenizer, [(adapter, data, policy)], batch_size, progress)[0]


def evaluate_policy(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, adapter: str | None, data: ValidationSet,
    policy: ReleasePolicy | None, batch_size: int = 64,
) -> tuple[float, float]:
    """(accuracy, decode skip) of `adapter` on `data` under a release `policy` (`policy_outcomes`)."""
    correct, skip = policy_outcomes(model, tokenizer, adapter, data, policy, batch_size)
    return accuracy_of(correct), skip


def accuracy_of(correct: Sequence[bool]) -> float:
    return sum(correct) / len(correct)


def evaluate_release(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, adapter: str | None, prompts: Sequence[str],
    score: Callable[[str, int], bool], k: int | None = None, batch_size: int = 64, **generate_kwargs: Any,
) -> ReleasePoint:
    """Accuracy and decode skip of `adapter` on `prompts` when released after k decode forwards.

    Args:
        model: a `LoRazorModel`.
        tokenizer: its tokenizer (left padding is set for the call).
        adapter: adapter name; None runs the backbone alone (skip fraction 1.0 by definition).
        prompts: validation prompts (text, or token ids as the tokenizer would give them).
        score: `score(answer_text, prompt_index) -> bool`, the task's evaluator.
        k: release length; None keeps the adapter to the end.
        batch_size: prompts per `generate` call.
        **generate_kwargs: passed to `model.generate` (`max_new_tokens`, `eos_token_id`, ...).
    """
    # Explicit even for k=None ("never"), so a default policy of the model does not apply.
    policy = ProfiledRelease({adapter: k}) if adapter is not None else None
    accuracy, skip = evaluate_policy(model, tokenizer, adapter, ValidationSet(prompts, score, generate_kwargs),
                                     policy, batch_size)
    return ReleasePoint(k, accuracy, skip)


def profile_release_lengths(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, adapter: str, prompts: Sequence[str],
    score: Callable[[str, int], bool], lengths: Sequence[int] = DEFAULT_RELEASE_LENGTHS, batch_size: int = 64,
    progress: bool = False, **generate_kwargs: Any,
) -> list[ReleasePoint]:
    """The release curve of one adapter: full LoRA (k=None) first, then each k in `lengths`."""
    data = ValidationSet(prompts, score, generate_kwargs)
    return profile_curves(model, tokenizer, {adapter: data}, lengths, batch_size, progress)[adapter]


def profile_curves(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, validation: dict[str, ValidationSet],
    lengths: Sequence[int] = DEFAULT_RELEASE_LENGTHS, batch_size: int = 64, progress: bool = False,
) -> dict[str, list[ReleasePoint]]:
    """Every adapter's release curve (full LoRA, then each k), all in one engine run."""
    for adapter in validation:
        if adapter not in model.adapter_names:
            raise KeyError(f"unknown adapter {adapter!r}; loaded adapters: {model.adapter_names}")
    for k in lengths:
        if not int_in_range(k, 0):
            raise ValueError(f"release lengths must be ints >= 0, got {k!r}")
    settings = [(adapter, k) for adapter in validation for k in (None, *lengths)]
    # Explicit even for k=None ("never"), so a default policy of the model does not apply.
    cases = [(adapter, validation[adapter], ProfiledRelease({adapter: k})) for adapter, k in settings]
    results = run_cases(model, tokenizer, cases, batch_size, progress, desc="profiled release lengths")
    curves: dict[str, list[ReleasePoint]] = {adapter: [] for adapter in validation}
    for (adapter, k), (correct, skip) in zip(settings, results):
        curves[adapter].append(ReleasePoint(k, accuracy_of(correct), skip))
    return curves


def _later_release(p: ReleasePoint) -> float:
    """Tie-break key: keeping the adapter longer is the safe side when validation cannot tell
    (a larger k, or a lower learned threshold)."""
    if p.tau is not None:
        return -p.tau
    return float("inf") if p.k is None else float(p.k)


def pareto_front(points: Sequence[ReleasePoint]) -> list[ReleasePoint]:
    """Points no other point beats on both accuracy and skip, by increasing skip (equal points stay)."""
    front = [p for p in points
             if not any(q.accuracy >= p.accuracy and q.skip_fraction >= p.skip_fraction
                        and (q.accuracy, q.skip_fraction) != (p.accuracy, p.skip_fraction) for q in points)]
    return sorted(front, key=lambda p: (p.skip_fraction, p.accuracy, _later_release(p)))


def select_release_length(
    points: Sequence[ReleasePoint], max_accuracy_drop: float | None = None, min_skip: float | None = None,
) -> int | None:
    """The release length k of `select_point` (None: never release)."""
    return select_point(points, max_accuracy_drop, min_skip).k


def select_point(
    points: Sequence[ReleasePoint], max_accuracy_drop: float | None = None, min_skip: float | None = None,
) -> ReleasePoint:
    """Pick an operating point from a calibration curve, by exactly one criterion.

    Points equal on both accuracy and skip go to the later release (k=None first, or the lower
    threshold): the validation data cannot tell them apart, and the later one is the safe side.

    Args:
        points: a curve from `profile_release_lengths` or `calibrate_learned` (it must hold the
            full-LoRA point: k=None, or tau=-inf).
        max_accuracy_drop: the most skipping whose accuracy is at most this far below full LoRA
            (e.g. 0.01 = one point); ties go to the higher accuracy.
        min_skip: the best accuracy among lengths that skip at least this fraction of decode LoRA
            calls (the paper's training-free setting uses 0.5); ties go to more skipping.

    Returns:
        The chosen point (the full-LoRA point when it is the only one that meets
        `max_accuracy_drop`).

    Raises:
        ValueError: no criterion or both, or no point reaches `min_skip`.
    """
    if (max_accuracy_drop is None) == (min_skip is None):
        raise ValueError("give exactly one of max_accuracy_drop and min_skip")
    full = [p for p in points if p.is_full_lora]
    if not full:
        raise ValueError("the curve needs its full-LoRA point (k=None or tau=-inf): use profile_release_lengths")
    front = pareto_front(points)
    if max_accuracy_drop is not None:
        if max_accuracy_drop < 0:
            raise ValueError(f"max_accuracy_drop must be >= 0, got {max_accuracy_drop}")
        ok = [p for p in front if p.accuracy >= full[0].accuracy - max_accuracy_drop - 1e-12]
        best = max(ok, key=lambda p: (p.skip_fraction, p.accuracy, _later_release(p)), default=full[0])
    else:
        if not 0.0 <= min_skip <= 1.0:
            raise ValueError(f"min_skip must be in [0, 1], got {min_skip}")
        ok = [p for p in front if p.skip_fraction >= min_skip]
        if not ok:
            best_skip = max(p.skip_fraction for p in points)
            raise ValueError(f"no release length skips {min_skip:.0%} of decode LoRA calls "
                             f"(at most {best_skip:.0%}); add smaller lengths")
        best = max(ok, key=lambda p: (p.accuracy, p.skip_fraction, _later_release(p)))
    return best


def calibrate_profiled(
    model: LoRazorModel,
    tokenizer: PreTrainedTokenizerBase,
    validation: dict[str, ValidationSet],
    max_accuracy_drop: float | None = None,
    min_skip: float | None = None,
    lengths: Sequence[int] = DEFAULT_RELEASE_LENGTHS,
    batch_size: int = 64,
    progress: bool = False,
) -> tuple[ProfiledRelease, dict[str, list[ReleasePoint]]]:
    """Profile every adapter of `validation` (one engine run for all) and pick its k by one
    criterion (`select_release_length`). `progress`: a tqdm bar with an ETA.

    Returns the frozen `ProfiledRelease` and the curves it was chosen from.
    """
    curves = profile_curves(model, tokenizer, validation, lengths, batch_size, progress)
    lengths_of = {}
    for adapter, curve in curves.items():
        try:
            lengths_of[adapter] = select_release_length(curve, max_accuracy_drop, min_skip)
        except ValueError as err:
            raise ValueError(f"adapter {adapter!r}: {err}") from None
    return ProfiledRelease(lengths_of), curves
