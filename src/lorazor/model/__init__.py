"""The model layer: `LoRazorModel` (built from a PeftModel or adapter folders), `generate()` with
Hugging Face's generation semantics, and the guard that keeps one call at a time on a model."""

from .generate import LoRazorOutput
from .guard import ModelBusyError, ModelClosedError
from .model import LoRazorModel

__all__ = ["LoRazorModel", "LoRazorOutput", "ModelBusyError", "ModelClosedError"]
