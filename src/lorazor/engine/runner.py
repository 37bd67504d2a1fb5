"""One engine step as tensors: the scheduled chunks packed into one sequence, one forward, the logits
of every request whose known tokens are all computed.

Per packed token: its id, its position in its request, its LoRA slot (the request's adapter while
the request holds it: prefill always, decode forward d while d is before the release step, -1
after), and its flat position in the paged KV pool. The StepTrim decision for a decode forward is
taken here, once per request and step, before the forward that it concerns.
"""

from __future__ import annotations

import torch

from .paged import PAGED_KWARG, PagedKVCache, PagedStep
from .scheduler import Chunk


def decide_release(chunk: Chunk) -> None:
    """StepTrim for the decode forwards in this chunk, each decided once, before it runs (a recomputed
    request replays its decisions): a fixed length k keeps the adapter while d < k; a learned head
    keeps it while w . h + b >= tau on the final hidden state of the forward before."""
    request = chunk.request
    if request.adapter is None or request.release_step >= 0:
        return
    first_decode = len(request.prompt)
    for position in range(max(chunk.start, first_decode), chunk.start + chunk.num_tokens):
        d = position - first_decode
        if d < request.decided:
            continue
        request.decided = d + 1
        if request.release_k is not None:
            release = d >= request.release_k
        elif request.head is not None:
            w, b, tau = request.head
            release = float(request.last_hidden.float() @ w + b) < tau
        else:
            release = False
        if release:
            request.release_step = d
            return


def run_step(model, cache: PagedKVCache, chunks: list[Chunk]) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward the packed chunks; returns `[len(chunks), V]` float32 logits and `[len(chunks), H]`
    final hidden states at each chunk's last token."""
    device = model.device
    ids, positions, adapters, slots, segments, last = [], [], [], [], [], []
    for chunk in chunks:
        request = chunk.request
        decide_release(chunk)
        span = range(chunk.start, chunk.start + chunk.num_tokens)
        first = len(ids)  # this chunk's first token in the packed sequence
        tokens = request.tokens
        ids.extend(tokens[p] for p in span)
        positions.extend(span)
        adapters.extend(request.adapter if request.uses_adapter_at(p) else None for p in span)
        context = chunk.start + chunk.num_tokens
        flat = cache.positions(request.block_table, context, device)
        segments.append((first, chunk.num_tokens, context, flat))
        slots.append(flat[chunk.start:])
        last.append(len(ids) - 1)
    # Loads the step's adapters that are not in GPU slots (before the forward that reads them).
    token_slot = model.registry.slots_for(adapters, device=device)
    step = PagedStep(cache, torch.cat(slots), segments)
    cache.step = step
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)
    # The packed attention is driven by `step`; HF still wants a bool 4-D mask to pass through.
    mask = torch.ones(1, 1, len(ids), 1, dtype=torch.bool, device=device)
    model.context.begin_batch(token_slot)
    try:
        hidden = model._decoder_forward(input_ids, position_ids, mask, cache, token_slot, 1, **{PAGED_KWARG: step})
        with torch.inference_mode():
            hidden = hidden[0, last]
            logits = model._lm_head(hidden)
    finally:
        cache.step = None
    return logits.float(), hidden
