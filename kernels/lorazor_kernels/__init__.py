"""lorazor_kernels: the Triton kernels of a LoRazor step, each beside its pure-torch reference.

- LoRA (GridTrim): grouped shrink and expand over the rows that still need an adapter
  (`lora_kernels.py`, launched by `lora_launch.py`; `ops.py`: the base GEMM plus the batched delta as
  one op), their grid built from each step's row -> slot map (`meta.py`, on the device: `meta_kernel.py`);
- attention: decode attention over a contiguous cache (`decode_attention.py`) and paged attention
  with the pool writes (`paged_attention.py`);
- fp8 weights: per-channel quantization and the weight-only fp8 GEMM (`fp8.py`);
- MoE experts: each token-expert pair's LoRA delta from its own slot and expert (`expert_lora.py`), a
  decode step's few pairs through their experts' base weights (`expert_gemv.py`), the pairs' outputs
  back to their tokens (`expert_combine.py`), and fp8 experts
  (`expert_fp8.py`: per-channel quantization, a sorted step's scaled grouped GEMM);
- the engine's asynchronous step: the next step's input tokens filled on the device (`token_fill.py`);
- launch settings per GPU (`kernel_config.py`, `configs/`); `reference.py`: the pure-torch LoRA delta.

The package takes tensors and step metadata; it imports no lorazor, transformers or peft.
"""

from .decode_attention import decode_attention, decode_attention_op, decode_attention_reference
from .expert_combine import expert_combine, expert_combine_reference
from .expert_fp8 import expert_grouped_fp8, quantize_experts
from .expert_gemv import DECODE_PAIRS, expert_gemv, expert_gemv_reference
from .expert_lora import expert_lora, expert_lora_reference
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
    "DECODE_PAIRS",
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
    "expert_combine",
    "expert_combine_reference",
    "expert_gemv",
    "expert_gemv_reference",
    "expert_grouped_fp8",
    "expert_lora",
    "expert_lora_reference",
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
    "quantize_experts",
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
