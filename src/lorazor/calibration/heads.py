"""Train and calibrate StepTrim's learned release heads (paper 3.2.2) from paired continuations.

For each training prompt of an adapter, generate with the adapter to the end (ON) and record the
final hidden state the policy would see before decode forward t, for t in `RELEASE_POSITIONS`. From
each reachable t, generate again releasing there (OFF, the `k = t` continuation; greedy decoding
makes ON shared by every t). The example (h_t, risky) is risky when ON's answer is correct and OFF's
is not. A logistic head per adapter, `s = w . h + b`, learns that risk (BCE with equal weight per
request, L2 on w); candidate thresholds come from quantiles of its training scores, each is run on
the validation split, and one operating point is picked from the Pareto front like the profiled k.

    policy, curves = calibrate_learned(model, tokenizer, train={"sql": ...}, validation={"sql": ...}, min_skip=0.5)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedTokenizerBase

from ..policies import LearnedRelease, ProfiledRelease, ReleasePolicy
from .lengths import ReleasePoint, ValidationSet, accuracy_of, generate_answers, select_point
from .runs import run_cases

if TYPE_CHECKING:
    from ..model import LoRazorModel

# Decode positions where training examples are taken (paper eq. 11).
RELEASE_POSITIONS = (0, 1, 2, 3, 7, 15, 31, 63)
# Quantiles of the training scores tried as thresholds (plus -inf and +inf).
THRESHOLD_QUANTILES = (0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)


@dataclass
class ReleaseExamples:
    """Training examples of one adapter's head.

    Attributes:
        hidden: `[n, H]` fp32 final hidden states seen before the release decision.
        risky: `[n]` bool, True when releasing there turned a correct answer wrong.
        request: `[n]` int, the prompt each example came from (for equal weight per request).
        position: `[n]` int, the decode position t of each example.
    """

    hidden: torch.Tensor
    risky: torch.Tensor
    request: torch.Tensor
    position: torch.Tensor


class _HiddenRecorder(ReleasePolicy):
    """Keeps every adapter; records the hidden states the policy sees at the chosen positions."""

    def __init__(self, positions: Sequence[int]):
        super().__init__()
        self.positions = set(positions)
        self.seen: dict[int, torch.Tensor] = {}

    def keep(self, step, hidden, state):
        if step in self.positions:
            self.seen[step] = hidden.detach().float().cpu().clone()
        return torch.ones_like(state.active)


def collect_release_examples(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, adapter: str, data: ValidationSet,
    positions: Sequence[int] = RELEASE_POSITIONS, batch_size: int = 64, progress: bool = False,
) -> ReleaseExamples:
    """Paired ON/OFF continuations of `adapter` on `data` (its training prompts), as labelled examples.
    They run through `generate()`, whose release policy sees each decode step's hidden states."""
    if adapter not in model.adapter_names:
        raise KeyError(f"unknown adapter {adapter!r}; loaded adapters: {model.adapter_names}")
    if not data.prompts:
        raise ValueError("prompts is empty: training the head needs prompts")
    hidden, risky, request, position = [], [], [], []
    never = ProfiledRelease({adapter: None})
    starts = range(0, len(data.prompts), batch_size)
    if progress:
        from tqdm.auto import tqdm

        starts = tqdm(starts, desc=f"{adapter}: paired continuations", unit="batch")
    for start in starts:
        chunk = list(data.prompts[start : start + batch_size])
        recorder = _HiddenRecorder(positions)
        texts, out = generate_answers(model, tokenizer, adapter, chunk, data.generate_kwargs, recorder)
        on_ok = [bool(data.score(t, start + i)) for i, t in enumerate(texts)]
        steps = out.decode_steps.tolist()
        for t in positions:
            reach = [i for i in range(len(chunk)) if t < steps[i] and t in recorder.seen]
            if not reach:
                continue
            off_texts, _ = generate_answers(model, tokenizer, adapter, chunk, data.generate_kwargs, never,
                                            release=[t] * len(chunk))
            for i in reach:
                off_ok = bool(data.score(off_texts[i], start + i))
                hidden.append(recorder.seen[t][i])
                risky.append(on_ok[i] and not off_ok)
                request.append(start + i)
                position.append(t)
    if not hidden:
        raise ValueError(f"no decode position of {list(positions)} was reached: answers are shorter than the positions")
    return ReleaseExamples(torch.stack(hidden), torch.tensor(risky), torch.tensor(request), torch.tensor(position))


def train_risk_head(examples: ReleaseExamples, l2: float = 0.1, steps: int = 100) -> tuple[torch.Tensor, float]:
    """Logistic risk head on standardized features, folded back to raw hidden states: (w `[H]`, b).

    Loss: BCE where each request's examples weigh 1 in total, plus `l2 * |w|^2` (on the standardized
    weights). Labels all equal give w = 0 and a bias that says so.
    """
    # Clones: examples recorded under inference mode cannot be saved for backward.
    x = examples.hidden.detach().float().clone()
    y = examples.risky.float().clone()
    if bool(y.all()) or not bool(y.any()):
        return torch.zeros(x.shape[1]), (10.0 if bool(y.all()) else -10.0)
    _, inverse, counts = torch.unique(examples.request, return_inverse=True, return_counts=True)
    weight = 1.0 / counts[inverse].float()
    weight = weight / weight.sum()
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mean) / std
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.tensor(float(torch.logit((y * weight).sum().clamp(1e-4, 1 - 1e-4))), requires_grad=True)
    opt = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = (torch.nn.functional.binary_cross_entropy_with_logits(z @ w + b, y, reduction="none") * weight).sum()
        loss = loss + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    w_raw = (w / std).detach()
    return w_raw, float(b.detach() - (w_raw * mean).sum())


def calibrate_learned(
    model: LoRazorModel, tokenizer: PreTrainedTokenizerBase, train: dict[str, ValidationSet],
    validation: dict[str, ValidationSet], max_accuracy_drop: float | None = None, min_skip: float | None = None,
    positions: Sequence[int] = RELEASE_POSITIONS, quantiles: Sequence[float] = THRESHOLD_QUANTILES,
    l2: float = 0.1, batch_size: int = 64, progress: bool = False,
) -> tuple[LearnedRelease, dict[str, list[ReleasePoint]]]:
    """Train a head per adapter on `train`, pick its threshold on `validation` (`select_point`);
    every (adapter, threshold) runs on the engine in one continuous batch. `progress`: tqdm bars.

    Returns the frozen `LearnedRelease` and, per adapter, the validation curve over thresholds.
    """
    missing = sorted(set(train) ^ set(validation))
    if missing:
        raise ValueError(f"train and validation must name the same adapters; differing: {missing}")
    trained, cases = {}, []
    with torch.inference_mode():
        for adapter in train:
            examples = collect_release_examples(model, tokenizer, adapter, train[adapter], positions, batch_size,
                                                progress)
            with torch.inference_mode(False):
                w, b = train_risk_head(examples, l2)
            scores = examples.hidden @ w + b
            taus = sorted(
                {float("-inf"), float("inf"), *torch.quantile(scores, torch.tensor(list(quantiles))).tolist()}
            )
            trained[adapter] = (w, b, taus)
            cases += [(adapter, validation[adapter], LearnedRelease({adapter: (w, b, tau)})) for tau in taus]
    results = run_cases(model, tokenizer, cases, batch_size, progress, desc="learned thresholds")
    heads, curves = {}, {adapter: [] for adapter in train}
    for (adapter, _, policy), (correct, skip) in zip(cases, results):
        curves[adapter].append(ReleasePoint(None, accuracy_of(correct), skip, tau=policy.heads[adapter][2]))
    for adapter, (w, b, _) in trained.items():
        try:
            heads[adapter] = (w, b, select_point(curves[adapter], max_accuracy_drop, min_skip).tau)
        except ValueError as err:
            raise ValueError(f"adapter {adapter!r}: {err}") from None
    return LearnedRelease(heads), curves
