"""The model runner shared by `generate()` and the engine: forwards, LM head, LoRA step context, KV
caches, CUDA graphs and StepTrim decisions (see `runner.py`)."""

from .runner import ModelRunner

__all__ = ["ModelRunner"]
