"""Adapters: folders read and checked (`loader`), GPU slots (`bank`), and which adapter is where
(`registry`); `types` holds what they share, `names` the folder's file names and the name rule.

The public names are imported on first use (PEP 562), so `names` can be read without torch (the
command line checks adapter folders before anything heavy loads)."""

import importlib

# Public name -> the submodule that defines it.
_PUBLIC = {
    "NO_ADAPTER": ".bank", "AdapterBank": ".bank", "ModuleLoRA": ".bank", "SlotImage": ".bank",
    "AdapterSource": ".loader", "check_adapter_name": ".loader", "check_lora_config": ".loader",
    "read_adapter": ".loader", "AdapterError": ".types", "AdapterWeights": ".types",
    "check_lora_layer": ".peft_layers", "find_lora_layers": ".peft_layers", "peft_adapter_weights": ".peft_layers",
    "AdapterRegistry": ".registry", "AdapterStatus": ".registry",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name):
    if name in _PUBLIC:
        value = getattr(importlib.import_module(_PUBLIC[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
