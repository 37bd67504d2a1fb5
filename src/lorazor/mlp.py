"""Gated SiLU MLPs (Llama, Mistral, Qwen2) whose merged gate/up and activation run as one op.

HF computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`. When gate/up are a merged group
(`merge_projections`) and `KernelConfig.silu_mul_expand` is on, the MLP runs
`down_proj(linear_lora_silu_mul_op(x, ...))` instead: the merged base GEMM, the LoRA shrink, and one
kernel that adds each row's delta to the gate/up output and writes `silu(gate) * up`
(`lorazor_kernels/silu_expand.py`). Outside a LoRazor step, in steps without adapters, or while the
group takes its per-module path (mixed ranks), the MLP is HF's.
"""

from __future__ import annotations

import types

from lorazor_kernels import linear_lora_silu_mul_op
from torch import nn

from .layers import check_rows
from .merged import MergedGroup

# The activations computed as silu(x): torch's module and transformers' (5.x builds ACT2FN["silu"] as it).
SILU_CLASSES = ("SiLU", "SiLUActivation")


def _hf_forward(mlp: nn.Module, x):
    return mlp.down_proj(mlp.act_fn(mlp.gate_proj(x)) * mlp.up_proj(x))


def _fused_forward(mlp: nn.Module, x):
    group: MergedGroup = mlp.gate_proj.merged[0]
    context = group.context
    meta = context.meta
    if not context.silu_mul_expand or meta is None or meta.has_lora is False or group.uses_mask_rank():
        return _hf_forward(mlp, x)
    check_rows(x, meta)
    h = linear_lora_silu_mul_op(x.reshape(-1, x.shape[-1]), group.weight, group.bias, group.lora_a, group.lora_b,
                                group.scaling, group.rank, meta, backend=context.backend)
    group.ran_merged = True
    return mlp.down_proj(h.view(*x.shape[:-1], h.shape[-1]))


def _fusable(module: nn.Module) -> bool:
    gate, up = getattr(module, "gate_proj", None), getattr(module, "up_proj", None)
    if getattr(module, "down_proj", None) is None or type(getattr(module, "act_fn", None)).__name__ not in SILU_CLASSES:
        return False
    merged = getattr(gate, "merged", None)
    return merged is not None and merged[0].members == [gate, up]


def install_gated_mlps(model: nn.Module) -> int:
    """Give every gated SiLU MLP whose gate/up are merged the fused forward; returns how many.
    The forward checks `StepContext.silu_mul_expand` at each call."""
    count = 0
    for module in model.modules():
        if _fusable(module):
            module.forward = types.MethodType(_fused_forward, module)
            count += 1
    return count


def uninstall_gated_mlps(model: nn.Module) -> None:
    """HF's own MLP forward again."""
    for module in model.modules():
        if module.__dict__.get("forward") is not None and getattr(module.forward, "__func__", None) is _fused_forward:
            del module.forward
