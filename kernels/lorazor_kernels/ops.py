"""Entry points: the batched LoRA delta through the Triton kernels or the reference.

`linear_lora_op` is what model layers call (base GEMM + delta, metadata built once per step and
passed in); `add_batched_lora_` adds the delta to a given output; `batched_lora` builds the
metadata itself, for tests and one-off use.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .fp8 import fp8_linear, fp8_linear_op
from .kernel_config import KernelConfig, get_kernel_config
from .lora_launch import lora_expand, lora_fused, lora_shrink
from .meta import LoRABatchMeta, build_batch_meta
from .reference import check_lora_args, lora_delta_reference

BACKENDS = ("triton", "reference")


def _full_rank(lora_a: torch.Tensor) -> torch.Tensor:
    return torch.full((lora_a.shape[0],), lora_a.shape[1], dtype=torch.int32, device=lora_a.device)


def add_batched_lora_(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    lora_rank: torch.Tensor,
    meta: LoRABatchMeta,
    backend: str = "triton",
    cfg: KernelConfig | None = None,
    mask_rank: bool = True,
    segments: tuple[int, ...] | list[int] | None = None,
) -> torch.Tensor:
    """Add the batched LoRA delta into `y` in place.

    Semantics:
        y[m] += scaling[s] * (x[m] @ lora_a[s, :r].T) @ lora_b[s, :, :r].T
        for every row m with s = meta.row_slot[m] >= 0 and r = lora_rank[s] > 0

    Args:
        y: `[M, N]` base output, updated in place.
        x: `[M, K]` input activations.
        lora_a: `[L, r_max, K]`; lora_b: `[L, N, r_max]`; scaling: `[L]`; lora_rank: `[L]` int32.
        meta: step metadata from `build_batch_meta(row_slot, L, grid)`.
        backend: "triton" (GPU, or CPU under TRITON_INTERPRET=1) or "reference".
        cfg: kernel launch config (default: the device's tuned file); `cfg.fused` picks one fused
            kernel or shrink + expand.
        mask_rank: False skips the per-slot rank load in the kernels; only valid when every slot
            a row uses has zero weights past its rank (the `AdapterBank` layout) and rank ~r_max.
        segments: merged projections (see `lora_expand`): y is `[M, N_1 + ... + N_G]`, lora_a is
            the members' A stacked `[L, G * r, K]`, lora_b `[L, sum N, r]`, scaling `[G, L]`, and
            `segments` the inner column edges. Members must share one rank (no rank load).

    Returns:
        `y`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if segments and mask_rank:
        raise ValueError("segments need mask_rank=False (merged members share one rank, zero-padded weights)")
    if meta.has_lora is False:
        return y
    if backend == "reference":
        return _add_reference_(y, x, lora_a, lora_b, scaling, lora_rank, meta, segments)
    return _triton_delta(y, x, lora_a, lora_b, scaling, lora_rank, meta, cfg or get_kernel_config(y.device),
                         mask_rank, segments)


def _triton_delta(y, x, lora_a, lora_b, scaling, lora_rank, meta, cfg, mask_rank, segments, write_only=False):
    """The delta into y by the Triton kernels, fused (`cfg.fused`) or shrink + expand: added, or with
    `write_only` written over it."""
    if cfg.fused:
        return lora_fused(x, lora_a, lora_b, scaling, lora_rank, y, meta, cfg, mask_rank, segments=segments or None,
                          write_only=write_only)
    u = lora_shrink(x, lora_a, lora_rank, meta, cfg, mask_rank)
    return lora_expand(u, lora_b, scaling, lora_rank, y, meta, cfg, mask_rank, segments=segments or None,
                       write_only=write_only)


def _add_reference_(y, x, lora_a, lora_b, scaling, lora_rank, meta, segments):
    """The reference delta added into y; merged projections one segment at a time."""
    if not segments:
        return y.add_(lora_delta_reference(x, lora_a, lora_b, scaling, meta.row_slot, lora_rank).to(y.dtype))
    G = scaling.shape[0]
    r = lora_a.shape[1] // G
    edges = (0, *segments, y.shape[1])
    for g in range(G):
        lo, hi = edges[g], edges[g + 1]
        # No rank here, as in the kernels: `lora_rank` is one member's, and a slot that member does
        # not target (rank 0) may still hold another member's weights. Merged members hold zeros
        # past each slot's rank, so the full width is exact.
        delta = lora_delta_reference(x, lora_a[:, g * r:(g + 1) * r], lora_b[:, lo:hi], scaling[g],
                                     meta.row_slot, None)
        y[:, lo:hi] += delta.to(y.dtype)
    return y


def _linear_lora(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, lora_rank: torch.Tensor, row_slot: torch.Tensor, sorted_rows: torch.Tensor,
    slot_start: torch.Tensor, tile_slot: torch.Tensor | None, tile_rows: torch.Tensor | None,
    large_slots: torch.Tensor | None, grid: str, num_slots: int, block_m: int, row_bound: int, class_split: bool,
    backend: str, mask_rank: bool, segments: list[int], config_key: str, weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    meta = LoRABatchMeta(grid, x.shape[0], num_slots, block_m, sorted_rows, slot_start, row_slot, tile_slot,
                         tile_rows, row_bound, large_slots, class_split)
    cfg = None
    if backend == "triton":
        cfg = _CONFIGS[config_key] if config_key else get_kernel_config(x.device)
    # fp8 base weights take their own GEMM (`base_linear`), then the delta added.
    if weight_scale is None and cfg is not None and cfg.gemm_adds_lora and grid == "exact" and bias is None:
        return _lora_then_gemm(x, weight, lora_a, lora_b, scaling, lora_rank, meta, cfg, mask_rank, segments)
    y = base_linear(x, weight, bias, weight_scale)
    return add_batched_lora_(y, x, lora_a, lora_b, scaling, lora_rank, meta, backend, cfg, mask_rank=mask_rank,
                             segments=segments or None)


# The registered op: torch.compile needs it (an opaque node in the graph); eager callers skip its
# dispatcher, whose Python checks per call cost more than the kernels of a small step (`linear_lora_op`).
_linear_lora_op = torch.library.custom_op("lorazor::linear_lora", mutates_args=())(_linear_lora)


def _lora_then_gemm(x, weight, lora_a, lora_b, scaling, lora_rank, meta, cfg, mask_rank, segments):
    """`KernelConfig.gemm_adds_lora`: the delta written (not added) into a fresh buffer by a write-only
    expand (after its shrink, or fused with it), then the GEMM adds x @ W.T to it in its epilogue (one
    pass over the output instead of the expand's read + write)."""
    return _write_only_delta(x, weight, lora_a, lora_b, scaling, lora_rank, meta, cfg, mask_rank,
                             segments).addmm_(x, weight.t())


def _write_only_delta(x, weight, lora_a, lora_b, scaling, lora_rank, meta, cfg, mask_rank, segments, out=None):
    """The delta alone, `[M, N]`, written (not added) by the write-only expand into `out` (default: a fresh
    buffer on the current stream)."""
    out = x.new_empty(x.shape[0], weight.shape[0]) if out is None else out
    return _triton_delta(out, x, lora_a, lora_b, scaling, lora_rank, meta, cfg, mask_rank, segments, write_only=True)


def _linear_lora_beside(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lora_a: torch.Tensor, lora_b: torch.Tensor,
    scaling: torch.Tensor, lora_rank: torch.Tensor, row_slot: torch.Tensor, sorted_rows: torch.Tensor,
    slot_start: torch.Tensor, tile_slot: torch.Tensor | None, tile_rows: torch.Tensor | None,
    large_slots: torch.Tensor | None, grid: str, num_slots: int, block_m: int, row_bound: int, class_split: bool,
    backend: str, mask_rank: bool, segments: list[int], config_key: str, weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`KernelConfig.lora_beside_gemm`: (x @ W.T + bias, the delta), the delta's shrink and write-only
    expand on a side stream while the base GEMM runs on the caller's (`exact` grid, Triton kernels).
    The caller adds the two (compiled, inductor folds the add into the op that consumes the sum)."""
    meta = LoRABatchMeta(grid, x.shape[0], num_slots, block_m, sorted_rows, slot_start, row_slot, tile_slot,
                         tile_rows, row_bound, large_slots, class_split)
    cfg = _CONFIGS[config_key] if config_key else get_kernel_config(x.device)
    delta_args = (x, weight, lora_a, lora_b, scaling, lora_rank, meta, cfg, mask_rank, segments)
    if not x.is_cuda:
        return base_linear(x, weight, bias, weight_scale), _write_only_delta(*delta_args)
    # Every tensor the side stream reads or writes was made on the caller's stream before the fork (the delta
    # too: a buffer allocated on the side stream could be reused there while the caller still reads it), and
    # the caller's stream waits for the side stream before the outputs are used or anything is freed.
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    delta = x.new_empty(x.shape[0], weight.shape[0])
    side.wait_stream(main)
    with torch.cuda.stream(side):
        _write_only_delta(*delta_args, out=delta)
    y = base_linear(x, weight, bias, weight_scale)
    main.wait_stream(side)
    return y, delta


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the LoRA kernels run on beside the base GEMM, one per device."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


_linear_lora_beside_op = torch.library.custom_op("lorazor::linear_lora_beside", mutates_args=())(_linear_lora_beside)


@_linear_lora_beside_op.register_fake
def _(x, weight, bias, lora_a, lora_b, scaling, lora_rank, row_slot, sorted_rows, slot_start, tile_slot, tile_rows,
      large_slots, grid, num_slots, block_m, row_bound, class_split, backend, mask_rank, segments,
      config_key, weight_scale=None):
    return x.new_empty(x.shape[0], weight.shape[0]), x.new_empty(x.shape[0], weight.shape[0])


@_linear_lora_op.register_fake
def _(x, weight, bias, lora_a, lora_b, scaling, lora_rank, row_slot, sorted_rows, slot_start, tile_slot, tile_rows,
      large_slots, grid, num_slots, block_m, row_bound, class_split, backend, mask_rank, segments,
      config_key, weight_scale=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


# KernelConfigs passed to `linear_lora_op`, by key: the registered op takes the key (a string), not
# the dataclass.
_CONFIGS: dict[str, KernelConfig] = {}


def _config_key(cfg: KernelConfig | None) -> str:
    if cfg is None:
        return ""
    key = repr(cfg)
    _CONFIGS.setdefault(key, cfg)
    return key


def linear_lora_op(x, weight, bias, lora_a, lora_b, scaling, lora_rank, meta: LoRABatchMeta,
                   backend: str = "triton", mask_rank: bool = True, segments: tuple[int, ...] = (),
                   cfg: KernelConfig | None = None, weight_scale: torch.Tensor | None = None):
    """`linear(x, weight, bias)` plus the batched LoRA delta, as the registered custom op
    `lorazor::linear_lora` (x `[M, K]`; the other arguments as in `add_batched_lora_`).

    The base GEMM, then the delta added in place; with `KernelConfig.gemm_adds_lora` (`exact`
    grid, no bias) the delta first, written by a write-only expand, and the GEMM adding x @ W.T to
    it. torch.compile treats the op as opaque, so compiled model code runs the GEMM and the Triton
    kernels as they are. `weight_scale`: fp8 base weights' per-channel scales (`fp8.py`); the GEMM is
    then `fp8_linear`. `cfg`: the kernel launch config (default: the device's tuned file, looked
    up per call through a cached device name). With `KernelConfig.lora_beside_gemm` (`exact` grid) the
    delta's kernels run on a side stream beside the GEMM and the sum is formed here, outside the op, where
    torch.compile fuses it into the next elementwise kernel. (The shrink alone on a side stream, the
    expand after the GEMM, was measured slower end to end: `benchmarks/results/archive/e2e_ab_overlap_e8044b4/`.)
    """
    if meta.has_lora is False:
        return base_linear(x, weight, bias, weight_scale)
    args = (x, weight, bias, lora_a, lora_b, scaling, lora_rank, meta.row_slot, meta.sorted_rows, meta.slot_start,
            meta.tile_slot, meta.tile_rows, meta.large_slots, meta.grid, meta.num_slots, meta.block_m,
            meta.row_bound, meta.class_split, backend, mask_rank, list(segments), _config_key(cfg), weight_scale)
    compiling = torch.compiler.is_compiling()
    if backend == "triton" and meta.grid == "exact" and _beside_gemm(cfg, x.device):
        y, delta = (torch.ops.lorazor.linear_lora_beside if compiling else _linear_lora_beside)(*args)
        return y + delta
    return (torch.ops.lorazor.linear_lora if compiling else _linear_lora)(*args)


def _beside_gemm(cfg: KernelConfig | None, device: torch.device) -> bool:
    """`lora_beside_gemm` of `cfg`, else of the device's config (a constant to torch.compile)."""
    return cfg.lora_beside_gemm if cfg is not None else _device_beside_gemm(device)


@torch._dynamo.assume_constant_result
def _device_beside_gemm(device: torch.device) -> bool:
    # Reading the config file's path is not traceable: dynamo calls this once and keeps the answer.
    return get_kernel_config(device).lora_beside_gemm


def base_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The base layer's product (x of any leading shape): a plain linear, or with `weight_scale` over
    fp8 weights (`fp8.py`)."""
    if weight_scale is None:
        return torch.nn.functional.linear(x, weight, bias)
    gemm = fp8_linear_op if torch.compiler.is_compiling() else fp8_linear
    y = gemm(x.reshape(-1, x.shape[-1]), weight, weight_scale, bias)
    return y.view(*x.shape[:-1], y.shape[-1])


def batched_lora(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: torch.Tensor,
    row_slot: torch.Tensor,
    grid: str = "exact",
    lora_rank: torch.Tensor | None = None,
    backend: str = "auto",
    block_m: int = 16,
    fused: bool | None = None,
    mask_rank: bool = True,
) -> torch.Tensor:
    """Batched LoRA delta `[M, N]` for rows mapped to slots (rows with slot -1 get 0).

    Args:
        x: `[M, K]`; lora_a: `[L, r, K]`; lora_b: `[L, N, r]`; scaling: `[L]`;
        row_slot: `[M]` int slot per row, -1 for none.
        grid: "full", "active_rows", "two_class" or "exact".
        lora_rank: optional `[L]` real rank per slot (defaults to r for every slot).
        backend: "triton", "reference", or "auto": Triton for CUDA tensors (and under
            `TRITON_INTERPRET=1`), the pure-torch reference otherwise (a CPU without the interpreter).
        block_m: row-tile height of the kernels.
        fused: one fused kernel (True) or shrink + expand (False); None: the device config's choice.
        mask_rank: see `add_batched_lora_` (False needs zeros past each slot's rank in A and B).

    Returns:
        `[M, N]` delta in `x.dtype`.
    """
    check_lora_args(x, lora_a, lora_b, scaling, row_slot, lora_rank)
    if backend == "auto":
        backend = "triton" if x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" else "reference"
    rank = _full_rank(lora_a) if lora_rank is None else lora_rank.to(torch.int32)
    y = torch.zeros(x.shape[0], lora_b.shape[1], dtype=x.dtype, device=x.device)
    meta = build_batch_meta(row_slot, lora_a.shape[0], grid, block_m)
    cfg = get_kernel_config(x.device)
    if fused is not None:
        cfg = dataclasses.replace(cfg, fused=fused)
    return add_batched_lora_(y, x, lora_a, lora_b, scaling, rank, meta, backend, cfg, mask_rank)
