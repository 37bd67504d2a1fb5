"""Adapters: folders read and checked (`loader`), which adapter is where (`registry`), PEFT's own
layers read (`peft_layers`); `names` holds the folder's file names and the name rule. The GPU slots
(`AdapterBank`) and the weights' types belong to the LoRA layers below (`lorazor.lora.bank`,
`lorazor.lora.types`): their names are offered here too.

The public names are imported on first use (PEP 562), so `names` can be read without torch (the
command line checks adapter folders before anything heavy loads)."""

from typing import TYPE_CHECKING

from .. import _lazy_getattr

if TYPE_CHECKING:  # what type checkers and the API docs (static analysis) read as the public names
    from ..lora.bank import NO_ADAPTER, AdapterBank, ModuleLoRA, SlotImage
    from .loader import AdapterSource, check_adapter_name, check_lora_config, read_adapter
    from .peft_layers import check_lora_layer, find_expert_wrappers, find_lora_layers, peft_adapter_weights
    from .registry import AdapterRegistry, AdapterStatus
    from ..lora.types import AdapterError, AdapterWeights

# Public name -> the submodule that defines it.
_PUBLIC = {
    "NO_ADAPTER": "..lora.bank", "AdapterBank": "..lora.bank", "ModuleLoRA": "..lora.bank", "SlotImage": "..lora.bank",
    "AdapterSource": ".loader", "check_adapter_name": ".loader", "check_lora_config": ".loader",
    "read_adapter": ".loader", "AdapterError": "..lora.types", "AdapterWeights": "..lora.types",
    "check_lora_layer": ".peft_layers", "find_lora_layers": ".peft_layers", "peft_adapter_weights": ".peft_layers",
    "find_expert_wrappers": ".peft_layers",
    "AdapterRegistry": ".registry", "AdapterStatus": ".registry",
}

__all__ = [
    "AdapterBank",
    "AdapterError",
    "AdapterRegistry",
    "AdapterSource",
    "AdapterStatus",
    "AdapterWeights",
    "ModuleLoRA",
    "NO_ADAPTER",
    "SlotImage",
    "check_adapter_name",
    "check_lora_config",
    "check_lora_layer",
    "find_expert_wrappers",
    "find_lora_layers",
    "peft_adapter_weights",
    "read_adapter",
]


__getattr__ = _lazy_getattr(__name__, _PUBLIC)
