"""Gated MLPs (Llama, Mistral, Qwen2) whose down_proj LoRA shrink runs in the activation kernel.

HF computes `down_proj(act_fn(gate_proj(x)) * up_proj(x))`. With `KernelConfig.mlp_down_shrink`,
`silu(gate) * up` and down_proj's shrink run as one kernel (`lorazor_kernels.silu_mul_shrink_op`)
that leaves its partials on down_proj, which then launches only its expand. Steps without the
`exact` grid's tile table, without adapters, or outside a LoRazor step take HF's path.
"""

from __future__ import annotations

import types

from lorazor_kernels import silu_mul_shrink_op
from torch import nn

from .layers import BatchedLoRALinear


def _fused_forward(mlp: nn.Module, x):
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    down = mlp.down_proj
    meta = down.context.lora_meta
    rows = gate.numel() // gate.shape[-1]
    if meta is None or meta.grid != "exact" or meta.num_rows != rows:
        return down(mlp.act_fn(gate) * up)
    width = gate.shape[-1]
    h, down.pending_partials = silu_mul_shrink_op(gate.reshape(rows, width), up.reshape(rows, width),
                                                  down.lora.lora_a, *meta.op_args(), down.context.backend)
    return down(h.view(gate.shape))


# The activations computed as silu(x): torch's module and transformers' (5.x builds ACT2FN["silu"] as it).
SILU_CLASSES = ("SiLU", "SiLUActivation")


def _fusable(module: nn.Module) -> bool:
    parts = [getattr(module, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    return (all(p is not None for p in parts) and isinstance(parts[2], BatchedLoRALinear)
            and type(getattr(module, "act_fn", None)).__name__ in SILU_CLASSES)


def mark_mlp_shrink(model: nn.Module, on: bool) -> None:
    """Run down_proj's shrink in the activation kernel of every gated SiLU MLP (or stop)."""
    for module in model.modules():
        if not _fusable(module):
            continue
        if on:
            module.forward = types.MethodType(_fused_forward, module)
        elif "forward" in module.__dict__:
            del module.forward
