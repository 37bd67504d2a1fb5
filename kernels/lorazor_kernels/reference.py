"""Pure-torch reference of the batched LoRA delta: the oracle for every kernel and the CPU path.

Semantics:
    for m in range(M):
        s = row_slot[m]
        if s >= 0 and rank[s] > 0:
            r = rank[s]
            delta[m] = scaling[s] * (x[m] @ lora_a[s, :r].T) @ lora_b[s, :, :r].T
        else:
            delta[m] = 0
"""

from __future__ import annotations

import torch

NO_ADAPTER = -1


def check_lora_args(x, lora_a, lora_b, scaling, row_slot, lora_rank=None) -> None:
    """Validate shapes and dtypes shared by every LoRA entry point; errors name the bad value."""
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [M, K], got shape {tuple(x.shape)}")
    if lora_a.dim() != 3 or lora_b.dim() != 3:
        raise ValueError(
            f"lora_a must be [L, r, K] and lora_b [L, N, r], got {tuple(lora_a.shape)} and {tuple(lora_b.shape)}"
        )
    n_slots, r, k = lora_a.shape
    if k != x.shape[1]:
        raise ValueError(f"lora_a has K={k} but x has K={x.shape[1]}")
    if lora_b.shape[0] != n_slots or lora_b.shape[2] != r:
        raise ValueError(f"lora_b shape {tuple(lora_b.shape)} does not match lora_a shape {tuple(lora_a.shape)}")
    if scaling.shape != (n_slots,):
        raise ValueError(f"scaling must be [L={n_slots}], got {tuple(scaling.shape)}")
    if row_slot.shape != (x.shape[0],):
        raise ValueError(f"row_slot must be [M={x.shape[0]}], got {tuple(row_slot.shape)}")
    if row_slot.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"row_slot must be int32 or int64, got {row_slot.dtype}")
    if lora_rank is not None and lora_rank.shape != (n_slots,):
        raise ValueError(f"lora_rank must be [L={n_slots}], got {tuple(lora_rank.shape)}")


def lora_delta_reference(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    row_slot: torch.Tensor,
    lora_rank: torch.Tensor | None = None,
) -> torch.Tensor:
    """Batched LoRA delta, one slot at a time (host loop; the CPU path, not a fast path).

    Args:
        x: `[M, K]` activations.
        lora_a: `[L, r_max, K]` stacked LoRA A weights (PEFT's `lora_A.weight` per slot).
        lora_b: `[L, N, r_max]` stacked LoRA B weights.
        scaling: `[L]` float scale per slot (alpha / r, or alpha / sqrt(r) with rsLoRA).
        row_slot: `[M]` int slot per row, `-1` for no adapter.
        lora_rank: optional `[L]` int real rank per slot (0: the slot has no weights here).

    Returns:
        `[M, N]` delta in `x.dtype`; rows without a slot are exactly 0.
    """
    check_lora_args(x, lora_a, lora_b, scaling, row_slot, lora_rank)
    delta = x.new_zeros(x.shape[0], lora_b.shape[1])
    for s in torch.unique(row_slot[row_slot >= 0]).tolist():
        r = lora_a.shape[1] if lora_rank is None else int(lora_rank[s])
        if r == 0:
            continue
        rows = (row_slot == s).nonzero().squeeze(1)
        xa = x[rows].to(lora_a.dtype) @ lora_a[s, :r].T
        delta[rows] = ((xa @ lora_b[s, :, :r].T) * scaling[s]).to(x.dtype)
    return delta
