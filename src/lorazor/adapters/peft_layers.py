"""Adapters held by a `peft.PeftModel`: its LoRA layers, validated, and each adapter's weights."""

from __future__ import annotations

from torch import nn

from ..lora.types import AdapterError, AdapterWeights


def _lora_layer_types():
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora import Linear as LoraLinear

    return LoraLayer, LoraLinear


def find_lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> PEFT LoraLayer, for every LoRA-wrapped module of `model` but the wrappers
    of parameters (`target_parameters`: MoE experts, `find_expert_wrappers`)."""
    lora_layer, _ = _lora_layer_types()
    return {name: m for name, m in model.named_modules() if isinstance(m, lora_layer) and not is_param_wrapper(m)}


def is_param_wrapper(layer: nn.Module) -> bool:
    """PEFT's LoRA on a parameter (`target_parameters`), not on a module."""
    return type(layer).__name__ == "ParamWrapper" and hasattr(layer, "parameter_name")


def find_expert_wrappers(model: nn.Module) -> dict[str, nn.Module]:
    """Qualified name -> PEFT ParamWrapper, for every `target_parameters` LoRA of `model` (nested
    wrappers of one experts module each appear under their own names). A wrapper of anything but a
    fused experts module's `gate_up_proj` / `down_proj` is refused."""
    from ..lora.experts import fused_prefix

    found = {name: m for name, m in model.named_modules() if is_param_wrapper(m)}
    for name, layer in found.items():
        if fused_prefix(name) is None or layer.parameter_name not in ("gate_up_proj", "down_proj"):
            raise AdapterError(f"{name}: LoRA on parameter {layer.parameter_name!r} (target_parameters) is served only "
                               "on MoE experts' gate_up_proj and down_proj")
    return found


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
    """Adapter `name`'s weights from PEFT layers (module name -> LoraLayer, or ParamWrapper of MoE
    experts, split per expert: `lora/experts.py`), on their device."""
    from ..lora.experts import fused_prefix, split_fused_pair

    weights = AdapterWeights()
    for module, layer in layers.items():
        if name not in layer.lora_A:
            continue
        a, b, scale = layer.lora_A[name].weight.detach(), layer.lora_B[name].weight.detach(), float(layer.scaling[name])
        if is_param_wrapper(layer):
            for expert_module, a_e, b_e in split_fused_pair(a, b, layer.num_experts, fused_prefix(module),
                                                            layer.parameter_name):
                weights.modules[expert_module] = (a_e, b_e, scale)
        else:
            weights.modules[module] = (a, b, scale)
    return weights
