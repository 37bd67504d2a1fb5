"""The serving engine: continuous batching over a LoRazorModel with a paged KV cache."""

from .engine import LoRazorEngine
from .request import RequestOutput

__all__ = ["LoRazorEngine", "RequestOutput"]
