"""fp8 base weights under many LoRA adapters (`LoRazorConfig(quantization="fp8")`).

At build, every linear projection of the decoder (attention and MLP, adapted or not) is quantized
to float8_e4m3fn with one scale per output channel (`lorazor_kernels.fp8`), and so are a mixture of
experts' fused expert weights, per expert and output channel (`quantize_experts`: the experts then
run in `lora/experts.py`'s layer, never transformers' own); adapters, norms, routers, embeddings and
the LM head stay in the model's dtype. A quantized projection is an `Fp8Linear`: a
`BatchedLoRALinear` over one runs the fp8 GEMM and adds its LoRA delta as before, so every path
(generate, the engine, graphs, StepTrim) serves fp8 bases unchanged. The original weights are freed:
a quantized model cannot be unpatched back to its PeftModel.
"""

from __future__ import annotations

import torch
from lorazor_kernels import base_linear, dequantize, quantize_rows
from lorazor_kernels import quantize_experts as quantize_expert_weights
from lorazor_kernels.fp8 import block_scaled, check_block_scales
from torch import nn

from ..config import QUANTIZATIONS  # noqa: F401  (what `LoRazorConfig.quantization` accepts)
from ..lora.experts import find_experts
from ..lora.layers import BatchedLoRALinear


class Fp8Linear(nn.Module):
    """A linear over float8_e4m3fn weights `[N, K]` and float32 scales: per output channel `[N]`, or an
    fp8 checkpoint's own 128x128 block scales `[ceil(N / 128), ceil(K / 128)]`.

    Attributes:
        weight: the fp8 weights (a frozen parameter, so `.data` views work as for nn.Linear).
        weight_scale: `[N]` or `[ceil(N / 128), ceil(K / 128)]` float32.
        bias: the original bias in the model dtype, or None.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        if block_scaled(weight_scale):
            check_block_scales(weight, weight_scale)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight_scale = nn.Parameter(weight_scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        weight, scale = quantize_rows(linear.weight)
        return cls(weight, scale, linear.bias)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weights this layer computes with, in `dtype` (for references and PEFT comparisons)."""
        return dequantize(self.weight, self.weight_scale, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return base_linear(x, self.weight, self.bias, self.weight_scale)

    def extra_repr(self) -> str:
        scales = "128x128 block scales" if block_scaled(self.weight_scale) else "per-channel scales"
        return f"in={self.in_features}, out={self.out_features}, fp8 (e4m3, {scales})"


def quantize_decoder(decoder: nn.Module, prequantized: dict | None = None) -> int:
    """Quantize every linear projection under `decoder` in place: a `BatchedLoRALinear`'s base
    layer, or a plain nn.Linear; the replaced weights are freed. `prequantized`: nn.Linear -> (fp8
    weight, scales) to use instead of quantizing its weights (an fp8 checkpoint's,
    `checkpoint.py`). Returns how many."""
    prequantized = prequantized or {}

    def quantized(linear: nn.Linear) -> Fp8Linear:
        if linear in prequantized:
            weight, scale = prequantized[linear]
            return Fp8Linear(weight.to(linear.weight.device), scale.to(linear.weight.device), linear.bias)
        return Fp8Linear.from_linear(linear)

    count = 0
    for parent in list(decoder.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BatchedLoRALinear) and isinstance(child.base_layer, nn.Linear):
                old, child.base_layer = child.base_layer, quantized(child.base_layer)
            elif isinstance(child, nn.Linear):
                old = child
                setattr(parent, name, quantized(child))
            else:
                continue
            # The full-precision weights go: a PEFT layer that still holds this linear sees an empty one.
            old.weight.data = torch.empty(0, dtype=old.weight.dtype, device=old.weight.device)
            count += 1
    return count


def quantize_experts(decoder: nn.Module) -> int:
    """Quantize the fused experts of every MoE layer under `decoder` in place: `gate_up_proj` and
    `down_proj` become float8_e4m3fn with scales `gate_up_proj_scale` / `down_proj_scale` `[E, N]`
    (one per expert and output channel); the full-precision weights are freed. The experts run in
    `BatchedLoRAExperts` (`patch_experts`), never transformers' own module. Returns how many experts
    modules."""
    modules = find_experts(decoder).values()
    for module in modules:
        for name in ("gate_up_proj", "down_proj"):
            weight, scale = quantize_expert_weights(getattr(module, name).data)
            setattr(module, name, nn.Parameter(weight, requires_grad=False))
            setattr(module, f"{name}_scale", nn.Parameter(scale, requires_grad=False))
    return len(modules)
