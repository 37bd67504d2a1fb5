"""OpenAI sampling fields -> engine `add_request` arguments, and OpenAI's penalties as a logits processor.

The app turns a request into plain keyword arguments (`generation_kwargs`) that can cross the pipe
to the engine's process; where the engine runs, `engine_arguments` builds what cannot be sent as
plain data (the seeded generator, the penalty processor, the tokenizer for stop strings).
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from ..model.hf_generation import SAMPLING_EPS
from .protocol import DEFAULT_MAX_TOKENS, SEED_RANGE, ApiError, SamplingFields


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties and logit bias, on a request's own scores.

    Semantics (OpenAI's definition; counts over the generated tokens only, as vLLM counts them):
        c[j] = number of times token j was generated so far
        scores[j] -= frequency_penalty * c[j] + presence_penalty * (c[j] > 0)
        scores[j] += logit_bias[j]
    """

    def __init__(self, prompt_len: int, presence: float, frequency: float, bias: dict[int, float]):
        self.prompt_len, self.presence, self.frequency = prompt_len, float(presence), float(frequency)
        self.bias_ids = torch.tensor(list(bias), dtype=torch.long)
        self.bias_values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        generated = input_ids[:, self.prompt_len:]
        if generated.shape[1] and (self.presence or self.frequency):
            counts = torch.zeros_like(scores).scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
            scores -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        if self.bias_ids.numel():
            ids = self.bias_ids.to(scores.device)
            scores[:, ids] += self.bias_values.to(scores.device, scores.dtype)
        return scores


def generation_kwargs(request: SamplingFields, tokenizer, max_tokens: int | None, logprobs: int | None) -> dict:
    """Plain engine arguments for an OpenAI request (OpenAI semantics: temperature 0, or below the
    engine's `SAMPLING_EPS`, is greedy; no top-k unless `top_k` is given; numbers as floats, as
    JavaScript's 2 stands for 2.0; `seed` stays a number until the engine's process)."""
    temperature = 1.0 if request.temperature is None else float(request.temperature)
    max_new = max_tokens or DEFAULT_MAX_TOKENS
    kwargs = dict(max_new_tokens=max_new, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  release=request.release, logprobs=logprobs)
    if request.cache_salt is not None:
        kwargs["cache_salt"] = request.cache_salt
    if temperature < SAMPLING_EPS:
        kwargs["do_sample"] = False
    else:
        kwargs.update(do_sample=True, temperature=temperature, top_p=float(request.top_p or 1.0),
                      top_k=max(request.top_k or 0, 0))
        if request.min_p:
            kwargs["min_p"] = float(request.min_p)
    if request.repetition_penalty not in (None, 1.0):
        kwargs["repetition_penalty"] = float(request.repetition_penalty)
    # ignore_eos: EOS is kept from being sampled until max_tokens, so the output always has max_tokens.
    min_new = max_new if request.ignore_eos else request.min_tokens
    if min_new:
        if min_new > max_new:
            raise ApiError(400, f"min_tokens={min_new} exceeds max_tokens={max_new}", param="min_tokens")
        kwargs["min_new_tokens"] = min_new
    if request.stops:
        kwargs["stop_strings"] = request.stops  # the engine matches them with its tokenizer
    if request.presence_penalty or request.frequency_penalty or request.logit_bias:
        kwargs["openai_penalties"] = (float(request.presence_penalty), float(request.frequency_penalty),
                                      {int(k): float(v) for k, v in (request.logit_bias or {}).items()})
    return kwargs


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice `index`'s seed: the request's seed, then the next ones (wrapped into torch's range),
    so `n` seeded choices differ from each other and each is reproducible."""
    if seed is None:
        return None
    low, high = SEED_RANGE
    return (seed - low + index) % (high - low + 1) + low


def engine_arguments(kwargs: dict, engine, tokenizer) -> dict:
    """`add_request` arguments from a request's plain ones, built where `engine` runs: `seed`
    becomes a seeded generator on its device, OpenAI's penalties a logits processor, and stop
    strings get the tokenizer that matches them to tokens.

    Raises:
        ValueError: a `logit_bias` token id outside the model's vocabulary.
    """
    kwargs = dict(kwargs)
    device = engine.model.device
    seed = kwargs.pop("seed", None)
    if seed is not None:
        kwargs["generator"] = torch.Generator(device=device).manual_seed(seed)
    penalties = kwargs.pop("openai_penalties", None)
    if penalties is not None:
        presence, frequency, bias = penalties
        vocab = engine.runner.vocab_size
        bad = [t for t in bias if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"logit_bias names token id {bad[0]}, outside the vocabulary [0, {vocab})")
        kwargs["logits_processor"] = [OpenAIPenalties(len(kwargs["prompt_ids"]), presence, frequency, bias)]
    if kwargs.get("stop_strings") or kwargs.get("structured_output") is not None:
        kwargs["tokenizer"] = tokenizer
    return kwargs
