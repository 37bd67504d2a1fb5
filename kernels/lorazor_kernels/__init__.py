"""lorazor_kernels: grouped LoRA shrink/expand kernels (GridTrim) and their pure-torch reference.

This package takes tensors and step metadata; it knows nothing about models.
"""

from .decode_attention import decode_attention, decode_attention_op, decode_attention_reference
from .fp8 import dequantize, fp8_linear, fp8_linear_reference, quantize_rows
from .kernel_config import KernelConfig, get_kernel_config
from .lora_launch import lora_expand, lora_fused, lora_shrink
from .meta import GRID_MODES, LoRABatchMeta, build_batch_meta, row_bound, slot_bound_class
from .paged_attention import (paged_attention, paged_attention_call, paged_attention_op, paged_attention_reference,
                              tile_shape, write_pool, write_pool_op, write_positions,
                              write_positions_op)
from .ops import add_batched_lora_, base_linear, batched_lora, linear_lora_op
from .reference import NO_ADAPTER, lora_delta_reference
from .token_fill import fill_pending, fill_pending_reference, warm_up_fill

__all__ = [
    "GRID_MODES",
    "KernelConfig",
    "LoRABatchMeta",
    "NO_ADAPTER",
    "add_batched_lora_",
    "base_linear",
    "batched_lora",
    "build_batch_meta",
    "decode_attention",
    "decode_attention_op",
    "decode_attention_reference",
    "dequantize",
    "fill_pending",
    "fill_pending_reference",
    "fp8_linear",
    "fp8_linear_reference",
    "get_kernel_config",
    "linear_lora_op",
    "lora_delta_reference",
    "lora_expand",
    "lora_fused",
    "lora_shrink",
    "paged_attention",
    "paged_attention_call",
    "paged_attention_op",
    "paged_attention_reference",
    "quantize_rows",
    "row_bound",
    "slot_bound_class",
    "tile_shape",
    "warm_up_fill",
    "write_pool",
    "write_pool_op",
    "write_positions",
    "write_positions_op",
]
