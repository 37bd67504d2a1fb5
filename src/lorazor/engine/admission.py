"""Admission: everything checked before a request is queued, so a bad request is refused (naming
the bad value) before it touches the running ones. `LoRazorEngine.add_request` and the server's
routes call `prepare_request` (it may run off the engine's thread: it reads the adapter registry's
snapshot), then `LoRazorEngine.queue_request` on the engine's thread."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList

from ..model.hf_generation import plan_generation
from ..policies.base import MAX_RELEASE, NEVER, ReleasePolicy, check_policy, is_release_step
from ..runner import batchable, grammar_cache
from .blocks import BACKBONE, adapter_identity, check_cache_salt, salted
from .request import Request
from ..config import int_in_range

# The most log-probabilities a request may ask for per token (OpenAI's top_logprobs limit).
MAX_LOGPROBS = 20


def prepare_request(engine, prompt_ids, adapter: str | None = None, generation_config=None, release=None,
                    request_id: str | None = None, generator: torch.Generator | None = None, **kwargs) -> Request:
    """Check a request against `engine` (a `LoRazorEngine`) and build it without queueing it: every
    check of `add_request`, nothing changed. Raises ValueError, TypeError or KeyError naming the bad
    value."""
    if request_id is None:
        request_id = f"req-{next(engine._ids)}"
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
    if request_id in engine.requests:
        raise ValueError(f"request_id {request_id!r} is already in use")
    prompt = check_prompt(prompt_ids, engine.runner.vocab_size)
    # The registry as its last change left it (this may run off the engine's thread); `queue_request`
    # checks again, on the engine's thread, that the adapter still has this digest.
    registered = engine.model.registry.snapshot
    if adapter is not None and adapter not in registered:
        raise KeyError(f"unknown adapter {adapter!r}; registered adapters: {list(registered)}")
    if adapter is not None:
        engine.model.registry.check_usable(adapter)
    cache_salt = check_cache_salt(kwargs.pop("cache_salt", None))
    structured_output = kwargs.pop("structured_output", None)
    tokenizer = kwargs.pop("tokenizer", None)
    logits_processor = kwargs.pop("logits_processor", None)
    logprobs = kwargs.pop("logprobs", None)
    policy = policy_of(engine, adapter, release, kwargs.pop("release_policy", None))
    vocab = engine.runner.vocab_size
    if logprobs is not None and not int_in_range(logprobs, 0, min(vocab, MAX_LOGPROBS)):
        raise ValueError(f"logprobs must be None or an int in [0, {min(vocab, MAX_LOGPROBS)}], got {logprobs!r}")
    config, flags = engine._configs.resolve(generation_config, kwargs)
    if (config.num_return_sequences or 1) != 1:
        raise ValueError(f"num_return_sequences={config.num_return_sequences}: add one request per sequence")
    # Planned on the CPU first: building a plan for the device makes tensors there, which waits
    # for the step in flight. Only a request the host samples needs its processors on the device.
    ids = torch.tensor([prompt], dtype=torch.long)
    plan = plan_generation(engine.runner.hf_model, config, flags, ids, torch.ones_like(ids),
                           logits_processor=logits_processor, tokenizer=tokenizer)
    # Stop strings do not need the host to sample: they are checked on the tokens read back.
    plain_greedy = (not plan.config.do_sample and len(plan.processors) == 0 and plan.stop_window is not None
                    and logprobs is None)
    sampling = batchable(plan, generator) if logprobs is None else None
    if not plain_greedy and sampling is None and engine.model.device.type != "cpu":
        ids = ids.to(engine.model.device)
        plan = plan_generation(engine.runner.hf_model, config, flags, ids, torch.ones_like(ids),
                               logits_processor=logits_processor, tokenizer=tokenizer)
    if plan.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1 for an engine request, got {plan.max_new_tokens}")
    check_length(engine, len(prompt), plan.max_new_tokens)
    request = Request(request_id, prompt, adapter, plan, policy, release, generator)
    if structured_output is not None:  # compiled once per spec (cached), checked before anything is queued
        request.constraint = grammar_cache(tokenizer, engine.runner.vocab_size).constraint(structured_output)
    request.adapter_digest = None if adapter is None else registered[adapter]
    request.cache_identity = salted(BACKBONE if adapter is None else adapter_identity(
        adapter, request.adapter_digest), cache_salt)
    request.logprobs = logprobs
    request.logprob_processors = LogitsProcessorList(logits_processor or [])
    # A request that reports log-probabilities is sampled on its own (`outputs.sample_on_host`).
    request.plain_greedy = plain_greedy
    request.sampling = sampling
    return request

def check_length(engine, prompt_len: int, max_new_tokens: int) -> None:
    """Raise ValueError when a request of this size can never run: the model's length limit
    first (the one a user can act on), then the KV pool."""
    engine.runner.check_length(prompt_len, max_new_tokens, engine.max_model_len, "max_model_len")
    total = prompt_len + max_new_tokens
    capacity = engine.pool.num_blocks * engine.pool.block_size
    if total > capacity:
        raise ValueError(f"prompt length {prompt_len} + max_new_tokens {max_new_tokens} = {total} tokens "
                         f"exceeds the KV pool ({engine.pool.num_blocks} blocks x {engine.pool.block_size})")

def check_prompt(prompt_ids, vocab: int) -> list[int]:
    """The prompt as a list of token ids in [0, vocab)."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 1 or prompt_ids.dtype.is_floating_point:
            raise ValueError(f"prompt_ids must be a 1-D integer tensor, got shape {tuple(prompt_ids.shape)} "
                             f"dtype {prompt_ids.dtype}")
        prompt_ids = prompt_ids.tolist()
    # By the set of element types and min/max (C loops): a Python loop per token costs ~0.1 ms
    # per 200 tokens, serial for every request of an offline batch.
    if not isinstance(prompt_ids, (list, tuple)) or not all(
            issubclass(kind, int) and not issubclass(kind, bool) for kind in set(map(type, prompt_ids))):
        raise TypeError("prompt_ids must be a list of token ids (ints) or a 1-D integer tensor")
    if not prompt_ids:
        raise ValueError("empty prompt: prompt_ids has no tokens")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        bad = next(t for t in prompt_ids if not 0 <= t < vocab)
        raise ValueError(f"prompt_ids holds token id {bad}, outside the vocabulary [0, {vocab})")
    return list(prompt_ids)

def policy_of(engine, adapter: str | None, release, policy) -> ReleasePolicy | None:
    """The request's release policy: its own `release_policy`, else the model's default
    (`LoRazorConfig.release` with `load_release_policy`); checked against the model here."""
    if release is not None and release != NEVER and not is_release_step(release):
        raise ValueError(f"release must be None, 'never' or an int in [0, {MAX_RELEASE}], got {release!r}")
    if policy is None and engine.model.config.release != "none":
        policy = engine.model.release_policy
    if policy is not None:
        check_policy(policy, engine.runner.hidden_size, engine.model.adapter_names)
    return None if adapter is None else policy
