"""The batched decode loop: one forward per step for the whole batch, HF generation semantics.

Prefill runs every row's prompt with its adapter; each decode step asks the release policy which
rows keep their adapter, runs one forward over the new tokens with that row -> slot map, and picks
the next tokens through HF's logits processors (greedy or seeded sampling) and stopping criteria
(`hf_generation.GenerationPlan`). Finished rows emit the pad token. With only max length and EOS
to check, "all rows finished" is checked on the host every `STOP_CHECK_EVERY` steps (one sync each,
not per step); trailing all-finished columns are trimmed at the end, so outputs have HF's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.utils import ModelOutput

from .hf_generation import GenerationPlan
from ..policies.base import ReleasePolicy, ReleaseState
from ..runner.release import decode_counts
from ..runner.sampling import float_scores, next_tokens

# Check "all rows finished" on the host once every this many steps (one sync each, not per step).
STOP_CHECK_EVERY = 16


@dataclass
class LoRazorOutput(ModelOutput):
    """What `LoRazorModel.generate` returns: a `transformers.utils.ModelOutput` (`out[0]` and
    `out.sequences` are the tokens; decode them with `tokenizer.batch_decode(out.sequences)`).

    Attributes:
        sequences: `[B, T + n]` prompt followed by the generated tokens (pad after a row stopped).
        scores: with `output_scores=True`, one `[B, V]` float tensor per generated token: the
            scores after the logits processors, as HF returns them.
        logits: with `output_logits=True`, the raw logits of every generated token.
        release_steps: `[B]` decode step at which each row released its adapter (it used it in
            prefill and decode forwards 0..k-1); -1 if it never released or had no adapter.
        decode_steps: `[B]` decode forwards each row needed (generated tokens - 1).
        lora_decode_steps: `[B]` of those, how many ran with the row's adapter.
    """

    sequences: torch.Tensor | None = None
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    release_steps: torch.Tensor | None = None
    decode_steps: torch.Tensor | None = None
    lora_decode_steps: torch.Tensor | None = None

    @property
    def skip_fraction(self) -> float:
        """Decode LoRA calls skipped over calls needed, weighted by decode length (paper A.4)."""
        total = int(self.decode_steps.sum())
        return 0.0 if total == 0 else 1.0 - int(self.lora_decode_steps.sum()) / total

    def rows(self, n: int) -> "LoRazorOutput":
        """The first `n` rows (drops CUDA-graph bucket padding)."""
        cut = lambda t: None if t is None else t[:n]  # noqa: E731
        steps = lambda ts: None if ts is None else tuple(t[:n] for t in ts)  # noqa: E731
        return LoRazorOutput(sequences=cut(self.sequences), scores=steps(self.scores), logits=steps(self.logits),
                             release_steps=cut(self.release_steps), decode_steps=cut(self.decode_steps),
                             lora_decode_steps=cut(self.lora_decode_steps))


def _grow(rows: torch.Tensor, batch: int, fill) -> torch.Tensor:
    """`rows` `[n]` extended to `[batch]` with `fill` (the bucket padding rows)."""
    if rows.shape[0] == batch:
        return rows
    return torch.cat([rows, rows.new_full((batch - rows.shape[0],), fill)])


def decode_loop(
    model,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    row_slot: torch.Tensor,
    plan: GenerationPlan,
    policy: ReleasePolicy | None,
    release_overrides=None,
    generator: torch.Generator | None = None,
    streamer=None,
    cache_len: int | None = None,
    real_rows: int | None = None,
) -> LoRazorOutput:
    """Run prefill + decode for a validated, left-padded batch on `model.runner`. See
    `LoRazorModel.generate`.

    `cache_len`: KV-cache length (>= T + max_new_tokens). `real_rows`: rows past this index are
    bucket padding: they never count as unfinished and are never streamed.
    """
    B, T = input_ids.shape
    max_new_tokens = plan.max_new_tokens
    real_rows = B if real_rows is None else real_rows
    device = input_ids.device
    eos, pad = plan.eos, plan.pad
    eos_t = torch.tensor(eos, dtype=torch.long, device=device)
    runner = model.runner
    state = ReleaseState.create(row_slot, release_overrides)
    if policy is not None:
        policy.bind(model.bank.names, model.bank.num_slots, device)
    # One host check per call: a batch without adapters skips LoRA entirely (no kernel launches),
    # and the number of distinct adapters bounds the exact grid.
    runner.context.begin_batch(row_slot)
    # A streamer sees every step's tokens anyway (a sync each): stop exactly where HF stops.
    check_every = 1 if streamer is not None else STOP_CHECK_EVERY

    tokens = torch.full((B, T + max_new_tokens), pad, dtype=torch.long, device=device)
    tokens[:, :T] = input_ids
    unfinished = torch.ones(B, dtype=torch.bool, device=device)
    unfinished[real_rows:] = False
    gen_len = torch.zeros(B, dtype=torch.long, device=device)
    done_at = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)
    next_pos = attention_mask.sum(-1)
    kept_scores, kept_logits = [], []
    if streamer is not None:
        streamer.put(input_ids[:real_rows].cpu())

    cache = runner.cache_for(B, cache_len or T + max_new_tokens, device)
    state = runner.begin_release(state, policy, cache)
    logits, hidden = runner.prefill(input_ids, attention_mask, cache, row_slot)
    for t in range(max_new_tokens):
        # Processors, sampling and criteria see the real rows only, never the bucket padding.
        raw = float_scores(logits[:real_rows])
        scores = plan.processors(tokens[:real_rows, : T + t], raw)
        tok = torch.where(unfinished, _grow(next_tokens(scores, plan.config.do_sample, generator), B, pad), pad)
        tokens[:, T + t] = tok
        if plan.output_scores:
            kept_scores.append(scores)
        if plan.output_logits:
            kept_logits.append(raw)
        if streamer is not None:
            streamer.put(tok[:real_rows].cpu())
        gen_len += unfinished.long()
        stops = plan.finished_rows(tokens[:real_rows, : T + t + 1], tok[:real_rows], scores, eos_t)
        if stops is not None:
            newly = unfinished & _grow(stops, B, False)
            done_at.masked_fill_(newly, t)
            unfinished &= ~newly
        if t == max_new_tokens - 1:
            break
        if (t + 1) % check_every == 0:
            # One host sync per check: stop when every row finished, and drop LoRA from the step
            # (the backbone graph) once every row released its adapter.
            any_unfinished, any_active = torch.stack([unfinished.any(), state.active.any()]).tolist()
            if not any_unfinished:
                break
            if not any_active:
                runner.context.enabled = False
        write_pos = torch.full((B,), T + t, dtype=torch.long, device=device)
        logits, hidden, _ = runner.run_decode_step(tok, next_pos, write_pos, cache, state, policy, t, hidden)
        next_pos = next_pos + 1
    if streamer is not None:
        streamer.end()
    # HF stops right after the step where every row finished.
    steps_run = min(max_new_tokens, int(done_at[:real_rows].max()) + 1) if max_new_tokens else 0
    # clone: with CUDA graphs the state is a static buffer that the next call overwrites.
    release_steps = state.release_step.clone()
    decode_steps, lora_decode = decode_counts(gen_len, release_steps, row_slot >= 0)
    return LoRazorOutput(
        sequences=tokens[:, : T + steps_run],
        scores=tuple(kept_scores[:steps_run]) if plan.output_scores else None,
        logits=tuple(kept_logits[:steps_run]) if plan.output_logits else None,
        release_steps=release_steps, decode_steps=decode_steps, lora_decode_steps=lora_decode,
    )
