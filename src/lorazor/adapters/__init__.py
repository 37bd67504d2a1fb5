"""Adapters: folders read and checked (`loader`), GPU slots (`bank`), and which adapter is where
(`registry`); `types` holds what they share."""

from .bank import NO_ADAPTER, AdapterBank, ModuleLoRA, SlotImage
from .loader import AdapterSource, check_adapter_name, check_lora_config, read_adapter
from .types import AdapterError, AdapterWeights
from .peft_layers import check_lora_layer, find_lora_layers, peft_adapter_weights
from .registry import AdapterRegistry, AdapterStatus

__all__ = [
    "NO_ADAPTER", "AdapterBank", "AdapterError", "AdapterRegistry", "AdapterSource", "AdapterStatus", "AdapterWeights",
    "ModuleLoRA", "SlotImage", "check_adapter_name", "check_lora_config", "check_lora_layer", "find_lora_layers",
    "peft_adapter_weights", "read_adapter",
]
