"""The batched decode loop: one forward per step for the whole batch, HF generation semantics.

Prefill runs every row's prompt with its adapter; each decode step asks the release policy which
rows keep their adapter, runs one forward over the new tokens with that row -> slot map, and picks
the next tokens through HF's logits processors (greedy or seeded sampling). Finished rows emit the
pad token. Stopping is checked on the host only every `STOP_CHECK_EVERY` steps; trailing all-finished
columns are trimmed at the end, so outputs have HF's length.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from transformers import GenerationConfig, LogitsProcessorList
from transformers.generation.logits_process import (
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .policies.base import ReleasePolicy, ReleaseState

# New tokens when neither max_new_tokens nor max_length is given (HF's default max_length).
DEFAULT_NEW_TOKENS = 20
# Check "all rows finished" on the host once every this many steps (one sync each, not per step).
STOP_CHECK_EVERY = 16


@dataclass
class LoRazorOutput:
    """What `LoRazorModel.generate` returns.

    Attributes:
        sequences: `[B, T + n]` prompt followed by the generated tokens (pad after EOS).
        release_steps: `[B]` decode step at which each row released its adapter (it used it in
            prefill and decode forwards 0..k-1); -1 if it never released or had no adapter.
        decode_steps: `[B]` decode forwards each row needed (generated tokens - 1).
        lora_decode_steps: `[B]` of those, how many ran with the row's adapter.
    """

    sequences: torch.Tensor
    release_steps: torch.Tensor
    decode_steps: torch.Tensor
    lora_decode_steps: torch.Tensor

    @property
    def skip_fraction(self) -> float:
        """Decode LoRA calls skipped over calls needed, weighted by decode length (paper A.4)."""
        total = int(self.decode_steps.sum())
        return 0.0 if total == 0 else 1.0 - int(self.lora_decode_steps.sum()) / total


def resolve_generation_config(
    default: GenerationConfig | None, given: GenerationConfig | None, kwargs: dict, prompt_len: int
) -> tuple[GenerationConfig, int]:
    """HF precedence: explicit config (or the model's) updated by kwargs; unknown kwargs are an error.

    Returns the config and max_new_tokens (0 is allowed here; HF's config rejects it).
    """
    cfg = copy.deepcopy(given if given is not None else (default or GenerationConfig()))
    kwargs = dict(kwargs)
    max_new = kwargs.pop("max_new_tokens", None)
    unused = cfg.update(**kwargs)
    if unused:
        raise TypeError(f"unknown generation arguments {sorted(unused)}")
    if cfg.num_beams not in (None, 1):
        raise NotImplementedError(f"beam search is not supported (num_beams={cfg.num_beams})")
    if max_new is None:
        max_new = cfg.max_new_tokens
    if max_new is None:
        # HF's fallback: max_length when set, else 20 new tokens.
        max_new = max(cfg.max_length - prompt_len, 0) if cfg.max_length is not None else DEFAULT_NEW_TOKENS
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new!r}")
    return cfg, max_new


def eos_ids(cfg: GenerationConfig) -> list[int]:
    eos = cfg.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def build_logits_processors(cfg: GenerationConfig, prompt_len: int, device, extra=None) -> LogitsProcessorList:
    """The processors HF's `generate` applies for these settings, in HF's order."""
    procs = LogitsProcessorList()
    eos = eos_ids(cfg)
    if cfg.repetition_penalty is not None and cfg.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    if eos and cfg.min_length:
        procs.append(MinLengthLogitsProcessor(cfg.min_length, eos, device=device))
    if eos and cfg.min_new_tokens:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, cfg.min_new_tokens, eos, device=device))
    if extra:
        procs.extend(extra)
    if cfg.do_sample:
        if cfg.temperature is not None and cfg.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(cfg.temperature))
        if cfg.top_k:
            procs.append(TopKLogitsWarper(top_k=cfg.top_k, min_tokens_to_keep=1))
        if cfg.top_p is not None and cfg.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=cfg.top_p, min_tokens_to_keep=1))
    return procs


def next_tokens(scores: torch.Tensor, do_sample: bool, generator: torch.Generator | None) -> torch.Tensor:
    if not do_sample:
        return scores.argmax(-1)
    probs = torch.softmax(scores, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def decode_loop(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row_slot: torch.Tensor,
    cfg: GenerationConfig,
    max_new_tokens: int,
    policy: ReleasePolicy | None,
    release_overrides=None,
    generator: torch.Generator | None = None,
    logits_processor=None,
    cache_len: int | None = None,
    real_rows: int | None = None,
) -> LoRazorOutput:
    """Run prefill + decode for a validated, left-padded batch. See `LoRazorModel.generate`.

    `cache_len`: KV-cache length (>= T + max_new_tokens). `real_rows`: rows past this index are
    bucket padding: they never count as unfinished.
    """
    B, T = input_ids.shape
    device = input_ids.device
    eos = eos_ids(cfg)
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else (eos[0] if eos else 0)
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    procs = build_logits_processors(cfg, T, device, logits_processor)
    state = ReleaseState.create(row_slot, release_overrides)
    if policy is not None:
        policy.bind(model.bank.names, model.bank.num_slots, device)
    # One host check per call: a batch without adapters skips LoRA entirely (no kernel launches),
    # and the number of distinct adapters bounds the exact grid.
    model.context.begin_batch(row_slot)

    tokens = torch.full((B, T + max_new_tokens), pad, dtype=torch.long, device=device)
    tokens[:, :T] = input_ids
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    if real_rows is not None:
        unfinished[real_rows:] = False
    gen_len = torch.zeros(B, dtype=torch.long, device=device)
    lora_steps = torch.zeros(B, dtype=torch.long, device=device)
    done_at = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    next_pos = attention_mask.sum(-1)

    cache = model.cache_for(B, cache_len or T + max_new_tokens, device)
    state = model.begin_release(state, policy, cache)
    hidden, logits = model.prefill(input_ids, attention_mask, cache, row_slot)
    steps_run = max_new_tokens
    for t in range(max_new_tokens):
        scores = procs(tokens[:, : T + t], logits.float())
        tok = torch.where(unfinished, next_tokens(scores, cfg.do_sample, generator), pad)
        tokens[:, T + t] = tok
        gen_len += unfinished.long()
        if eos:
            newly = unfinished & torch.isin(tok, eos_t)
            done_at.masked_fill_(newly, t)
            unfinished &= ~newly
        if t == max_new_tokens - 1:
            break
        if (t + 1) % STOP_CHECK_EVERY == 0:
            # One host sync per STOP_CHECK_EVERY steps: stop when every row finished, and drop LoRA
            # from the step (the backbone graph) once every row released its adapter.
            any_unfinished, any_active = torch.stack([unfinished.any(), state.active.any()]).tolist()
            if not any_unfinished:
                break
            if not any_active:
                model.context.enabled = False
        write_pos = torch.full((B,), T + t, dtype=torch.long, device=device)
        hidden, logits, step_slot = model.run_decode_step(tok, next_pos, write_pos, cache, state, policy, t, hidden)
        lora_steps += (step_slot >= 0) & unfinished
        next_pos = next_pos + 1
    # HF stops right after the step where every row finished.
    if eos:
        all_done = int(done_at[:real_rows].max())
        steps_run = min(max_new_tokens, all_done + 1)
    sequences = tokens[:, : T + steps_run]
    decode_steps = (gen_len - 1).clamp(min=0) * (row_slot >= 0)
    lora_decode = torch.minimum(lora_steps, decode_steps)
    # clone: with CUDA graphs the state is a static buffer that the next call overwrites.
    return LoRazorOutput(sequences, state.release_step.clone(), decode_steps, lora_decode)
