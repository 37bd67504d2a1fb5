"""BatchedLoRALinear: a PEFT LoRA linear replaced by base(x) + the batched LoRA delta of each row's slot.

`patch_layers` swaps every target module of a model (a PEFT LoRA layer or a plain nn.Linear) for one
of these (sharing the base weights, no copy) and returns what `unpatch_layers` needs to put them back.
"""

from __future__ import annotations

import torch
from lorazor_kernels import base_linear, linear_lora_op
from torch import nn

from .bank import AdapterBank, ModuleLoRA
from .context import StepContext


def linear_step_lora(x, weight, bias, context: StepContext, lora_a, lora_b, scaling, rank, mask_rank: bool,
                     segments: tuple[int, ...] = (), weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`linear(x, weight, bias)` plus the step's batched LoRA delta (x of any leading shape).

    Outside a step, or when no row has an adapter, the plain linear. `segments`: merged projections;
    `weight_scale`: fp8 base weights' per-channel scales (`lorazor.quant`).
    """
    meta = context.meta
    if meta is None or meta.has_lora is False:
        return base_linear(x, weight, bias, weight_scale)
    # The row count from a tensor's size, not `meta.num_rows`: torch.compile would guard on that int
    # and recompile for every batch size.
    if x.numel() // x.shape[-1] != meta.row_slot.shape[0]:
        raise RuntimeError(f"layer got {x.numel() // x.shape[-1]} rows but the step has {meta.row_slot.shape[0]}")
    y = linear_lora_op(x.reshape(-1, x.shape[-1]), weight, bias, lora_a, lora_b, scaling, rank, meta,
                       backend=context.backend, mask_rank=mask_rank, segments=segments, weight_scale=weight_scale)
    return y.view(*x.shape[:-1], y.shape[-1])


class BatchedLoRALinear(nn.Module):
    """`y = base(x) + delta`, delta[m] = scaling[s] * B[s] A[s] x[m] for the slot s of row m.

    Args:
        base_layer: the frozen `nn.Linear` (shared with the PEFT model, not copied), or an
            `Fp8Linear` (`lorazor.quant`) once the base is quantized.
        lora: this module's stacked slot weights.
        context: the model's shared `StepContext`; outside a step the layer is the base layer.
    """

    def __init__(self, base_layer: nn.Module, lora: ModuleLoRA, context: StepContext):
        super().__init__()
        self.base_layer = base_layer
        self.lora = lora
        self.context = context
        # (MergedGroup, index) when merged with the projections that share its input (merged.py).
        self.merged = None

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
                                lora.rank, lora.mask_rank, weight_scale=getattr(base, "weight_scale", None))

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, slots={self.lora.lora_a.shape[0]}"


def _parent_and_attr(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    parent_name, _, attr = name.rpartition(".")
    return (root.get_submodule(parent_name) if parent_name else root), attr


def patch_layers(root: nn.Module, bank: AdapterBank, context: StepContext,
                 peft_layers: list[str] = ()) -> list[tuple[str, nn.Module]]:
    """Replace every bank module under `root` (a PEFT LoRA layer or a plain nn.Linear) by a
    `BatchedLoRALinear` over its base linear, in place; PEFT LoRA layers outside the bank become
    their plain base layer. Returns `(name, old module)` pairs for `unpatch_layers`.
    """
    replaced = []
    for name in [*bank.modules, *(n for n in peft_layers if n not in bank.modules)]:
        if name in bank.stacked:
            continue  # an expert's slot module: its layer is the experts module's (`experts.py`)
        parent, attr = _parent_and_attr(root, name)
        old = getattr(parent, attr)
        base = old.get_base_layer() if hasattr(old, "get_base_layer") else old
        if not isinstance(base, nn.Linear):
            raise TypeError(f"LoRA target {name} is a {type(base).__name__}, not an nn.Linear")
        setattr(parent, attr, BatchedLoRALinear(base, bank.modules[name], context) if name in bank.modules else base)
        replaced.append((name, old))
    return replaced


def unpatch_layers(root: nn.Module, replaced: list[tuple[str, nn.Module]]) -> None:
    """Put the modules saved by `patch_layers` back."""
    for name, layer in replaced:
        parent, attr = _parent_and_attr(root, name)
        setattr(parent, attr, layer)
