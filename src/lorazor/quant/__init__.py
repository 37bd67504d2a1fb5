"""Quantized base weights behind the same linear API: fp8 (`fp8.py`)."""

from .fp8 import QUANTIZATIONS, Fp8Linear, quantize_decoder, quantize_experts

__all__ = ["QUANTIZATIONS", "Fp8Linear", "quantize_decoder", "quantize_experts"]
