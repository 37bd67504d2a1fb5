"""Picking next tokens from logits, for `generate()` and the engine.

`next_tokens` is greedy or multinomial sampling on processed scores (HF's processors ran before);
`float_scores` makes the fp32 copy processors may change in place.

Sampling draws one token per row as `argmax(p / q)` with `q ~ Exp(1)` (`draw`), which is how
`torch.multinomial(p, 1)` itself draws one sample, from the same generator stream: the same tokens,
minus multinomial's check that every probability is finite. That check is an `_assert_async`: on a
GPU a row with NaN logits would trip a device-side assert and poison the CUDA context, ending every
request in the process. Here such a row just gets some token; the engine finds the row by its
non-finite logits (`finite_rows`) and ends that request alone.

Batched sampling for the engine: the common HF sampling settings of many requests in one pass.

HF applies a request's logits processors to its own scores, and the engine would then read each
sampled token back on its own: one host sync per request and step. A request whose processors are
only HF's temperature, top-k, top-p and min-p warpers (in HF's order, with HF's defaults for the
filter value and tokens to keep), with no seeded generator and no stopping criteria besides EOS,
length, stop strings and max time (checked on the host from the tokens), is sampled here together
with every other such request of the step. Each row keeps its own settings, and a row's processed
scores equal what HF's warpers give for that row alone
(tests/engine/test_engine_sampler.py). Other requests are sampled one by one, as HF does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from .uploads import to_device

ORDER = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """`[n]` token ids, one drawn from each row of `probs` `[n, V]` (`torch.multinomial(probs, 1)`'s
    draw, without its device-side assert on non-finite rows)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(-1)


def next_tokens(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    if not do_sample:
        return scores.argmax(-1)
    return draw(torch.softmax(scores, dim=-1), generator)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """`[n]` bool: rows of `[n, V]` logits with no NaN or infinity. One reduction pass (NaN and
    infinities survive a sum); no host sync."""
    return torch.isfinite(logits.sum(-1, dtype=torch.float32))


def float_scores(logits: torch.Tensor) -> torch.Tensor:
    """Float32 logits as a fresh normal tensor: processors may change it in place, and CUDA graphs
    overwrite the logits buffer at the next replay."""
    scores = logits.float()
    return scores.clone() if scores is logits else scores


@dataclass(frozen=True)
class SamplingParams:
    """One request's warper settings (neutral values where its plan has no such warper)."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    min_p: float = 0.0  # 0.0: off


def batchable(plan, generator) -> SamplingParams | None:
    """The request's settings when it can be sampled in a batch, else None."""
    if not plan.config.do_sample or generator is not None or plan.stop_window is None:
        return None
    kinds = [type(p) for p in plan.processors]
    if any(k not in ORDER for k in kinds) or kinds != sorted(kinds, key=ORDER.index) or len(set(kinds)) != len(kinds):
        return None
    values = {}
    for p in plan.processors:
        if not isinstance(p, TemperatureLogitsWarper) and (
            p.filter_value != float("-inf") or p.min_tokens_to_keep != 1
        ):
            return None
        if isinstance(p, TemperatureLogitsWarper):
            values["temperature"] = float(p.temperature)
        elif isinstance(p, TopKLogitsWarper):
            values["top_k"] = int(p.top_k)
        elif isinstance(p, TopPLogitsWarper):
            values["top_p"] = float(p.top_p)
        else:
            values["min_p"] = float(p.min_p)
    return SamplingParams(**values)


def warp(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """HF's warpers, row by row settings, on `[n, V]` float scores (a new tensor)."""
    device = scores.device
    column = lambda name, dtype: to_device([getattr(p, name) for p in params], device, dtype)[:, None]  # noqa: E731
    scores = scores / column("temperature", torch.float32)
    if any(p.top_k for p in params):
        k = column("top_k", torch.long).clamp(max=scores.shape[-1])
        # The largest k from the host's settings, not from the device tensor (no sync).
        top = torch.topk(scores, min(max(p.top_k for p in params), scores.shape[-1])).values
        threshold = top.gather(1, (k - 1).clamp(min=0))
        scores = scores.masked_fill((scores < threshold) & (k > 0), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = column("top_p", torch.float32)
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - top_p)
        remove[:, -1:] = False  # keep at least one token
        remove &= top_p < 1.0
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if any(p.min_p > 0.0 for p in params):
        min_p = column("min_p", torch.float32)
        probs = torch.softmax(scores, dim=-1)
        remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(-1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove & (min_p > 0.0), float("-inf"))
    return scores


def sample(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """`[n]` sampled token ids for `[n, V]` logits, each row under its own settings."""
    return draw(torch.softmax(warp(logits.float(), params), dim=-1))
