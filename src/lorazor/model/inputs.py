"""Batch inputs of `generate` and forwards: validation, `num_return_sequences` expansion, text prompts."""

from __future__ import annotations

import torch


def check_batch(model, input_ids, attention_mask, adapter_ids) -> tuple[torch.Tensor, list]:
    """Validate a left-padded batch for `model`; returns the attention mask (ones when None) and the
    per-row adapter names (`adapter_ids=None`: every row on the backbone).

    Every error names the bad value. One host sync per call, never per step.
    """
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(f"input_ids must be a torch.Tensor of token ids, got {type(input_ids).__name__}")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if B == 0:
        raise ValueError("empty batch: input_ids has 0 rows")
    if T == 0:
        raise ValueError("empty prompt: input_ids has 0 columns")
    if B > model.config.max_batch_size:
        raise ValueError(f"batch size {B} exceeds max_batch_size={model.config.max_batch_size}")
    if adapter_ids is None:
        adapter_ids = [None] * B
    if isinstance(adapter_ids, str):
        raise TypeError(f"adapter_ids must be a list with one entry per row, got the string {adapter_ids!r}")
    if len(adapter_ids) != B:
        raise ValueError(f"adapter_ids has {len(adapter_ids)} entries but the batch has {B} rows")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    # One host sync per call (never per step) for the checks below.
    vocab = model.model.get_input_embeddings().num_embeddings
    low, high, empty, right = torch.stack([
        input_ids.min(), input_ids.max(), (attention_mask.sum(-1) == 0).any(), (attention_mask[:, -1] == 0).any(),
    ]).tolist()
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        row = int((input_ids == bad).any(-1).nonzero()[0])
        raise ValueError(f"input_ids holds token id {bad} (row {row}), outside the vocabulary [0, {vocab})")
    if empty:
        row = int((attention_mask.sum(-1) == 0).nonzero()[0])
        raise ValueError(f"attention_mask row {row} is all 0: every row needs at least one token")
    if right:
        raise ValueError("right padding is not supported: pad on the left (tokenizer.padding_side='left')")
    return attention_mask.to(input_ids.device), list(adapter_ids)


def expand_rows(n: int, max_batch_size: int, input_ids, attention_mask, adapter_ids, release):
    """Each row of a validated batch repeated `n` times (HF's `num_return_sequences` layout:
    copies adjacent)."""
    if input_ids.shape[0] * n > max_batch_size:
        raise ValueError(f"{input_ids.shape[0]} prompts x num_return_sequences={n} rows exceed "
                         f"max_batch_size={max_batch_size}")
    repeat = lambda seq: None if seq is None else [x for x in seq for _ in range(n)]  # noqa: E731
    return (input_ids.repeat_interleave(n, dim=0), attention_mask.repeat_interleave(n, dim=0), repeat(adapter_ids),
            repeat(release))


def encode_prompts(tokenizer, prompts, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded `(input_ids, attention_mask)` of text prompts, on `device`."""
    if isinstance(prompts, str) or not all(isinstance(p, str) for p in prompts):
        raise TypeError("prompts must be a list of strings")
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(list(prompts), return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    return enc["input_ids"].to(device), enc["attention_mask"].to(device)
