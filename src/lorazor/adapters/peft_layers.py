"""Adapters held by a `peft.PeftModel`: its LoRA layers, validated, and each adapter's weights."""

from __future__ import annotations

from torch import nn

from ..lora.types import AdapterError, AdapterWeights


def _lora_layer_types():
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear

    return LoraLayer, LoraLinear


def find_lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> PEFT LoraLayer, for every LoRA-wrapped module of `model`."""
    lora_layer, _ = _lora_layer_types()
    return {name: m for name, m in model.named_modules() if isinstance(m, lora_layer)}


def check_lora_layer(module_name: str, layer: nn.Module, adapters: list[str]) -> None:
    """Refuse a PEFT layer whose adapters LoRazor cannot batch (non-Linear, lm_head, merged, variants)."""
    _, lora_linear = _lora_layer_types()
    present = [a for a in adapters if a in layer.r]
    if not present:
        return
    if not isinstance(layer, lora_linear) or not isinstance(layer.get_base_layer(), nn.Linear):
        raise AdapterError(
            f"adapter {present[0]!r} targets {module_name} ({type(layer).__name__} over "
            f"{type(layer.get_base_layer()).__name__}): only nn.Linear targets are supported, not embeddings or conv"
        )
    if module_name.split(".")[-1] == "lm_head":
        raise AdapterError(f"adapter {present[0]!r} targets lm_head, which LoRazor does not support")
    if layer.merged_adapters:
        raise AdapterError(f"adapters {layer.merged_adapters} are merged into {module_name}: unmerge them first")
    if getattr(layer, "fan_in_fan_out", False):
        raise AdapterError(f"{module_name} uses fan_in_fan_out (Conv1D), which LoRazor does not support")
    variants = [a for a in present if a in getattr(layer, "lora_variant", {})]
    if variants:
        raise AdapterError(f"adapter {variants[0]!r} is a LoRA variant (DoRA/aLoRA/...) at {module_name}")


def peft_adapter_weights(layers: dict[str, nn.Module], name: str) -> AdapterWeights:
    """Adapter `name`'s weights from PEFT layers (module name -> LoraLayer), on their device."""
    weights = AdapterWeights()
    for module, layer in layers.items():
        if name in layer.lora_A:
            weights.modules[module] = (layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach(),
                                       float(layer.scaling[name]))
    return weights
