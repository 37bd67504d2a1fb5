"""BatchedLoRALinear: a PEFT LoRA linear replaced by base(x) + the batched LoRA delta of each row's slot.

`patch_lora_layers` swaps every PEFT LoRA layer of a model for one of these (sharing the base weights,
no copy) and returns what `unpatch_lora_layers` needs to put the PEFT layers back.
"""

from __future__ import annotations

import torch
from lorazor_kernels import linear_lora_op
from torch import nn

from .adapters import AdapterBank, ModuleLoRA, find_lora_layers
from .gemm_shrink import GEMM_SHRINK_MAX_ROWS, StackedWeight, stack_a_under
from .step import StepContext


def linear_step_lora(x, weight, bias, context: StepContext, lora_a, lora_b, scaling, rank, mask_rank: bool,
                     segments: tuple[int, ...] = (), stacked: StackedWeight | None = None) -> torch.Tensor:
    """`linear(x, weight, bias)` plus the step's batched LoRA delta (x of any leading shape).

    Outside a step, or when no row has an adapter, the plain linear. `segments`: merged projections.
    `stacked`: the A bank under the weight (gemm_shrink.py); a decode-sized forward of a batch that
    uses most of the bank then gets its shrink from the base GEMM and runs only the expand kernel.
    """
    meta = context.meta
    if meta is None or meta.has_lora is False:
        return nn.functional.linear(x, weight, bias)
    rows = x.numel() // x.shape[-1]
    if rows != meta.num_rows:
        raise RuntimeError(f"layer got {rows} rows but the step has {meta.num_rows}")
    dense = stacked is not None and context.dense_bank and rows <= GEMM_SHRINK_MAX_ROWS
    y = linear_lora_op(x.reshape(-1, x.shape[-1]), stacked.weight if dense else weight,
                       stacked.bias if dense else bias, lora_a, lora_b, scaling, rank, meta,
                       backend=context.backend, mask_rank=mask_rank, segments=segments,
                       stacked_n=stacked.n if dense else 0)
    return y.view(*x.shape[:-1], y.shape[-1])


class BatchedLoRALinear(nn.Module):
    """`y = base(x) + delta`, delta[m] = scaling[s] * B[s] A[s] x[m] for the slot s of row m.

    Args:
        base_layer: the frozen `nn.Linear` (shared with the PEFT model, not copied).
        lora: this module's stacked slot weights.
        context: the model's shared `StepContext`; outside a step the layer is the base layer.
    """

    def __init__(self, base_layer: nn.Linear, lora: ModuleLoRA, context: StepContext):
        super().__init__()
        self.base_layer = base_layer
        self.lora = lora
        self.context = context
        # (MergedGroup, index) when merged with the projections that share its input (merged.py).
        self.merged = None
        # `KernelConfig.gemm_shrink`: the slots' A stacked under the base weight (set_gemm_shrink).
        self.stacked: StackedWeight | None = None
        self._stacked_layout: StackedWeight | None = None

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.merged is not None:
            group, index = self.merged
            out = group.forward(x, index)
            if out is not None:
                return out
        lora, base = self.lora, self.base_layer
        return linear_step_lora(x, base.weight, base.bias, self.context, lora.lora_a, lora.lora_b, lora.scaling,
                                lora.rank, lora.mask_rank, stacked=self.stacked)

    def set_gemm_shrink(self, on: bool) -> None:
        """Let dense-bank decode steps compute the shrink in the base GEMM (gemm_shrink.py), or not.
        The first time it is turned on, the weight, bias and the slots' A move into one stacked
        tensor (their views stay valid for PEFT and the bank); later switches only choose the path."""
        if on and self._stacked_layout is None:
            base, lora = self.base_layer, self.lora
            self._stacked_layout, w, b, a = stack_a_under(
                base.weight.data, None if base.bias is None else base.bias.data, lora.lora_a)
            base.weight.data = w
            if b is not None:
                base.bias.data = b
            lora.lora_a = a
        self.stacked = self._stacked_layout if on else None

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, slots={self.lora.lora_a.shape[0]}"


def _parent_and_attr(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (root.get_submodule(parent_name) if parent_name else root), attr


def patch_lora_layers(root: nn.Module, bank: AdapterBank, context: StepContext) -> list[tuple[str, nn.Module]]:
    """Replace every PEFT LoRA layer under `root` by a `BatchedLoRALinear` (in place).

    Layers no adapter targets become their plain base layer. Returns `(name, peft_layer)` pairs for
    `unpatch_lora_layers`.
    """
    replaced = []
    for name, layer in find_lora_layers(root).items():
        parent, attr = _parent_and_attr(root, name)
        base = layer.get_base_layer()
        new = BatchedLoRALinear(base, bank.modules[name], context) if name in bank.modules else base
        setattr(parent, attr, new)
        replaced.append((name, layer))
    return replaced


def unpatch_lora_layers(root: nn.Module, replaced: list[tuple[str, nn.Module]]) -> None:
    """Put the PEFT layers saved by `patch_lora_layers` back."""
    for name, layer in replaced:
        parent, attr = _parent_and_attr(root, name)
        setattr(parent, attr, layer)
