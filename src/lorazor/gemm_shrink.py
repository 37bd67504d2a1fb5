"""The LoRA shrink inside the base GEMM: every slot's A stacked under the projection's weight.

A decode step's base GEMMs read their weights once for a few hundred rows, so they are bound by
weight bytes, not by math. Stacking the bank's A `[L, G * r, K]` under W `[N, K]` makes the one
GEMM also return `x @ A[s].T` for every slot s: `y_ext = x @ [W; A].T` is `[M, N + L * G * r]`. The
expand kernel then reads each row's own slot's columns of it (`lora_expand` with a bank-wide u), so
a projection runs 2 launches instead of 3 and no shrink kernel at all.

The GEMM reads the whole bank's A each step, whatever the batch uses. On the H200 with a 128-slot
bank that costs about what the 4 shrink launches per layer cost at 1 adapter, and saves 14 us per
layer at 128 (`benchmarks/results/lora_forms_llama-3.2-3b.md`). It is `KernelConfig.gemm_shrink`.

Nothing is copied for good: W, the bias and the slots' A become views into the stacked tensors, so
`add_adapter` keeps writing where the GEMM reads. Forwards with many rows (prefill) take the plain
GEMM over W's view and the shrink kernel: past a few hundred rows the GEMM is bound by math, and
the extra columns would cost their full FLOPs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Up to this many rows a forward computes the shrink in the GEMM (decode batches); more take the
# shrink kernel. A bf16 GEMM on the H200 is bound by weight bytes below about 300 rows.
GEMM_SHRINK_MAX_ROWS = 512


@dataclass
class StackedWeight:
    """`weight [N + L * G * r, K]`: the base weight with every slot's A under it; `bias` likewise
    (zeros under it) or None; `n`: N, the base output width."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    n: int


def stack_a_under(weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor):
    """Stack `lora_a [L, G * r, K]` under `weight [N, K]` in one new tensor.

    Returns `(stacked, weight_view, bias_view, lora_a_view)`: the caller points its parameters at
    the views (the old tensors are then free), so adapter writes land where the GEMM reads.
    """
    n, k = weight.shape
    if lora_a.shape[-1] != k or lora_a.dtype != weight.dtype:
        raise ValueError(f"A {tuple(lora_a.shape)} {lora_a.dtype} cannot go under W {tuple(weight.shape)} "
                         f"{weight.dtype}: K and dtype must match")
    ext = torch.cat([weight, lora_a.reshape(-1, k)])
    bias_ext = None
    if bias is not None:
        bias_ext = torch.cat([bias, bias.new_zeros(ext.shape[0] - n)])
    stacked = StackedWeight(ext, bias_ext, n)
    return stacked, ext[:n], None if bias_ext is None else bias_ext[:n], ext[n:].view(lora_a.shape)


def use_gemm_shrink(stacked: StackedWeight | None, x: torch.Tensor) -> bool:
    """Whether this forward computes its shrink in the GEMM (static shapes only: graph-safe)."""
    return stacked is not None and x.numel() // x.shape[-1] <= GEMM_SHRINK_MAX_ROWS


def linear_with_shrink(x: torch.Tensor, stacked: StackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """`(y, u)`: y `[..., N]` the base output (a view into the GEMM's output, written in place by the
    expand) and u `[M, L * G * r]` every slot's shrink of the M rows."""
    y_ext = nn.functional.linear(x, stacked.weight, stacked.bias)
    return y_ext[..., : stacked.n], y_ext.view(-1, y_ext.shape[-1])[:, stacked.n:]
