"""The LoRA shrink inside the base GEMM when the batch uses most of the bank (`KernelConfig.gemm_shrink`).

A decode step's base GEMMs read their weights once for a few hundred rows, so they are bound by
weight bytes, not by math. With the bank's A `[L, G * r, K]` stacked under W `[N, K]`, the one GEMM
`x @ [W; A].T` also returns every slot's shrink `x @ A[s].T`, and the expand kernel reads each row's
own slot's columns of it (`add_lora_expand_every_slot_`): 4 LoRA launches per decoder layer instead
of 8.

The GEMM then reads the whole A bank, whatever the batch uses. That pays only when the batch uses
most of it, so the layers take this path in the top class of distinct adapters (`StepContext
.dense_bank`: more than half of the bank's slots in the batch, for the `exact` grid), in decode-sized
forwards; every other step runs the base GEMM over W's rows and the shrink kernel over the slots
the batch uses.

Nothing is copied for good: W, the bias and the slots' A become views into the stacked tensors, so
`add_adapter` keeps writing where the GEMM reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Up to this many rows a forward may compute its shrink in the GEMM (decode batches); past a few
# hundred rows a bf16 GEMM is bound by math and the extra columns would cost their full FLOPs.
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
    bias_ext = None if bias is None else torch.cat([bias, bias.new_zeros(ext.shape[0] - n)])
    stacked = StackedWeight(ext, bias_ext, n)
    return stacked, ext[:n], None if bias_ext is None else bias_ext[:n], ext[n:].view(lora_a.shape)
