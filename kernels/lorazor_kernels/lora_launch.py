"""Launching GridTrim's kernels (`lora_kernels.py`): grid geometry per mode, K and N splits, PDL
options, and the entry points `lora_shrink`, `lora_expand` and `lora_fused`."""

from __future__ import annotations

import functools

import torch
import triton

from .kernel_config import KernelConfig, get_kernel_config
from .lora_kernels import BLOCK_R, _lora_expand_kernel, _lora_shrink_kernel, padded_rank
from .meta import LARGE_CLASS_CAPACITY, SMALL_CLASS_ROWS, LoRABatchMeta

_B_LAYOUT_WARNED = False


def _warn_if_b_is_row_major(lora_b: torch.Tensor) -> None:
    """Say once that a `[L, N, r]` B contiguous in r is read with strided loads: the fast layout
    stores B as `[L, r, N]` and passes its `.transpose(1, 2)` view (as `AdapterBank` does)."""
    global _B_LAYOUT_WARNED
    if lora_b.stride(1) != 1 and not _B_LAYOUT_WARNED:
        import warnings

        _B_LAYOUT_WARNED = True
        warnings.warn("lora_b [L, N, r] is contiguous along r: the expand kernel reads it with strided loads. "
                      "Store B as [L, r, N] and pass b.transpose(1, 2) for full-width loads.", stacklevel=3)


def _launches(meta: LoRABatchMeta, expand: bool):
    """Launch plan of a step: (programs on axis 0, tiles_per_slot, TILE_TABLE, slot list, CLASS_MAX_ROWS)."""
    bm = meta.block_m
    if meta.grid == "exact":
        return [(meta.num_tiles, 1, True, None, 0)]
    tiles = triton.cdiv(meta.row_bound, bm)
    if meta.grid == "two_class" and expand and meta.class_split:
        small_tiles = triton.cdiv(SMALL_CLASS_ROWS, bm)
        return [
            (meta.num_slots * small_tiles, small_tiles, False, None, SMALL_CLASS_ROWS),
            (LARGE_CLASS_CAPACITY * tiles, tiles, False, meta.large_slots, 0),
        ]
    return [(meta.num_slots * tiles, tiles, False, None, 0)]


def _meta_tensors(meta: LoRABatchMeta, table: bool, slot_list):
    """sorted_rows, slot_start, tile_slot, tile_rows, slot_list of a launch (unused ones: a stand-in)."""
    stand_in = meta.slot_start
    return (meta.sorted_rows, meta.slot_start, meta.tile_slot if table else stand_in,
            meta.tile_rows if table else stand_in, slot_list if slot_list is not None else stand_in)


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 dots default to tf32 on the GPU; keep fp32 exact so fp32 tests and the reference agree.
    return "ieee" if dtype == torch.float32 else "tf32"


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _hopper_or_newer(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pdl_options(cfg: KernelConfig, device: torch.device) -> dict:
    """Launch options for programmatic dependent launch: `cfg.pdl` on a Hopper or newer GPU."""
    return pdl_launch(cfg.pdl, device)


def pdl_launch(on: bool, device: torch.device) -> dict:
    """A kernel's `USE_GDC` and launch options: programmatic dependent launch if `on` and the GPU is
    Hopper or newer (off on older GPUs and the CPU)."""
    on = on and device.type == "cuda" and _hopper_or_newer(_cuda_index(device))
    return dict(USE_GDC=True, launch_pdl=True) if on else dict(USE_GDC=False)


def _split_k(meta: LoRABatchMeta, K: int, rank_blocks: int, cfg: KernelConfig, device: torch.device) -> int:
    """Split K so that shrink launches enough programs to keep the GPU's memory system busy."""
    max_splits = triton.cdiv(K, cfg.shrink_block_k)
    if cfg.shrink_split_k > 0:
        return min(cfg.shrink_split_k, max_splits)
    programs = sum(n for n, *_ in _launches(meta, expand=False)) * rank_blocks
    sms = _sm_count(_cuda_index(device)) if device.type == "cuda" else 1
    splits = triton.cdiv(cfg.target_programs_per_sm * sms, max(programs, 1))
    return max(1, min(max_splits, _at_most_steps(splits, max_splits, cfg.shrink_max_steps)))


def _k_ranges(split: int, K: int, block_k: int) -> tuple[int, int]:
    """(splits, K per split) for about `split` splits of K in whole `block_k` chunks (the last
    split may be shorter; rounding up to whole chunks can leave fewer splits than asked)."""
    k_per_split = triton.cdiv(triton.cdiv(K, split), block_k) * block_k
    return triton.cdiv(K, k_per_split), k_per_split


def _at_most_steps(splits: int, blocks: int, max_steps: int) -> int:
    """`splits`, raised so that no program loops over more than `max_steps` of the `blocks` (0: no cap).
    A long K (down_proj) or N (gate/up) then gets more, shorter programs than a short one."""
    return max(splits, triton.cdiv(blocks, max_steps)) if max_steps > 0 else splits


def _columns_per_program(programs: int, N: int, block_n: int, per_sm: int, device: torch.device,
                         max_steps: int = 0) -> int:
    """Expand columns per program: split N only as far as needed for about `per_sm` programs per SM
    (and at most `max_steps` column blocks per program)."""
    n_blocks = triton.cdiv(N, block_n)
    target = 1  # on the CPU (interpreter) one program per tile, unless max_steps asks for more
    if device.type == "cuda":
        target = triton.cdiv(per_sm * _sm_count(_cuda_index(device)), max(programs, 1))
    splits = max(1, min(n_blocks, _at_most_steps(target, n_blocks, max_steps)))
    return triton.cdiv(n_blocks, splits) * block_n


def _run_expand(y, lora_b, scaling, lora_rank, meta, cfg, mask_rank, u=None, x=None, lora_a=None, segments=None,
                write_only=False):
    """Every launch of the expand kernel for a step: fused (x and lora_a given) or from shrink's u,
    optionally over merged-projection segments (column edges, scaling `[G, L]`); `write_only`: the
    exact grid from u, overwriting y (see `lora_expand`)."""
    fused = u is None
    N = lora_b.shape[1]
    block_n = min(cfg.fused_block_n if fused else cfg.expand_block_n, max(16, triton.next_power_of_2(N)))
    segments = tuple(segments or ())
    while any(e % block_n for e in segments) and block_n > 16:
        block_n //= 2  # every column block must lie in one segment
    if any(e % block_n for e in segments):
        raise ValueError(f"segment edges {segments} must be multiples of 16")
    launches = _launches(meta, expand=True)
    per_sm = cfg.fused_programs_per_sm if fused else cfg.expand_programs_per_sm
    n_per_program = _columns_per_program(sum(n for n, *_ in launches), N, block_n, per_sm, y.device,
                                         0 if fused else cfg.expand_max_steps)
    stand_in = y  # for the pointers the variant does not read
    xs = (x.stride(0), x.stride(1)) if fused else (0, 0)
    a_s = (lora_a.stride(0), lora_a.stride(1), lora_a.stride(2)) if fused else (0, 0, 0)
    us = (0, 0, 0) if fused else (u.stride(0), u.stride(1), u.stride(2))
    # A plain projection is one segment [0, N); merged ones read scaling row g for segment g.
    seg_args = (*(segments + (N, N))[:2], scaling.stride(0) if segments else 0)
    # Write-only (the exact grid: one launch): one more program per BLOCK_M rows, for the rows without a slot (zeros).
    zero_programs = triton.cdiv(y.shape[0], meta.block_m) if write_only else 0
    for programs, tiles_per_slot, table, slot_list, class_rows in launches:
        _lora_expand_kernel[(programs + zero_programs, triton.cdiv(N, n_per_program))](
            x if fused else stand_in, lora_a if fused else stand_in, stand_in if fused else u, lora_b, y, scaling,
            lora_rank, *_meta_tensors(meta, table, slot_list),
            x.shape[1] if fused else 0, N, lora_b.shape[2], tiles_per_slot, n_per_program, *seg_args,
            y.shape[0], meta.num_slots, programs,
            *xs, *a_s, *us, lora_b.stride(0), lora_b.stride(1), lora_b.stride(2), y.stride(0), y.stride(1),
            TILE_TABLE=table, USE_SLOT_LIST=slot_list is not None, CLASS_MAX_ROWS=class_rows, MASK_RANK=mask_rank,
            FUSED=fused, SPLIT_K=1 if fused else u.shape[0], BLOCK_M=meta.block_m,
            BLOCK_N=block_n, BLOCK_R=padded_rank(lora_b.shape[2]), BLOCK_K=cfg.fused_block_k if fused else 16,
            DOT_PRECISION=_dot_precision(lora_b.dtype), WRITE_ONLY=write_only,
            num_warps=cfg.fused_num_warps if fused else cfg.expand_num_warps,
            num_stages=cfg.fused_num_stages if fused else cfg.expand_num_stages,
            **_pdl_options(cfg, y.device),
        )
    return y


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, lora_rank: torch.Tensor, meta: LoRABatchMeta,
    cfg: KernelConfig | None = None, mask_rank: bool = True,
) -> torch.Tensor:
    """Shrink `u = x @ A[slot].T` per row, as fp32 split-K partials.

    Args:
        x: `[M, K]` activations.
        lora_a: `[L, r_max, K]` stacked A weights.
        lora_rank: `[L]` int32 real rank per slot (0: slot absent in this layer).
        meta: the step's `LoRABatchMeta`.
        mask_rank: read each slot's rank and mask past it. False promises that every slot a row
            uses has zero weights past its rank (the bank's layout) and about r_max real columns:
            the kernels then skip the rank load, a dependent memory round trip.

    Returns:
        `[S, M, r_pad]` fp32 partials (sum over S is u); only rows with a slot and columns below
        that slot's rank are written.
    """
    cfg = cfg or get_kernel_config(x.device)
    M, K = x.shape
    r_pad = padded_rank(lora_a.shape[1])
    rank_blocks = r_pad // BLOCK_R
    split, k_per_split = _k_ranges(_split_k(meta, K, rank_blocks, cfg, x.device), K, cfg.shrink_block_k)
    u = torch.empty(split, M, r_pad, dtype=torch.float32, device=x.device)
    for programs, tiles_per_slot, table, slot_list, class_rows in _launches(meta, expand=False):
        _lora_shrink_kernel[(programs, split, rank_blocks)](
            x, lora_a, u, lora_rank,
            *_meta_tensors(meta, table, slot_list),
            K, lora_a.shape[1], tiles_per_slot, k_per_split,
            x.stride(0), x.stride(1), lora_a.stride(0), lora_a.stride(1), lora_a.stride(2),
            u.stride(0), u.stride(1), u.stride(2),
            TILE_TABLE=table, USE_SLOT_LIST=slot_list is not None, CLASS_MAX_ROWS=class_rows, MASK_RANK=mask_rank,
            BLOCK_M=meta.block_m, BLOCK_R=BLOCK_R, BLOCK_K=cfg.shrink_block_k,
            DOT_PRECISION=_dot_precision(x.dtype),
            num_warps=cfg.shrink_num_warps, num_stages=cfg.shrink_num_stages,
            **_pdl_options(cfg, x.device),
        )
    return u


def _check_expand(lora_b, scaling, meta, mask_rank, segments, write_only) -> None:
    """The expand's arguments that the kernel cannot check: refused with the bad value named."""
    if write_only and meta.grid != "exact":
        raise ValueError(f"write_only needs the exact grid, got grid {meta.grid!r}")
    _warn_if_b_is_row_major(lora_b)
    if segments is not None:
        if mask_rank:
            raise ValueError("segments need mask_rank=False (uniform ranks, zero-padded weights)")
        if not 1 <= len(segments) <= 2 or scaling.dim() != 2 or scaling.shape[0] != len(segments) + 1:
            raise ValueError(f"segments {tuple(segments)} need scaling [len(segments) + 1, L], got "
                             f"{tuple(scaling.shape)}")


def lora_expand(
    u: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, lora_rank: torch.Tensor,
    y: torch.Tensor, meta: LoRABatchMeta, cfg: KernelConfig | None = None, mask_rank: bool = True,
    segments: tuple[int, ...] | None = None, write_only: bool = False,
) -> torch.Tensor:
    """Expand in place: `y[m] += scaling[s] * u[m] @ B[s].T` for every row m with a slot s.

    Args:
        u: `[S, M, r_pad]` fp32 partials from `lora_shrink` (of A stacked `[L, G * r_max, K]` for G
            merged segments).
        lora_b: `[L, N, r_max]` stacked B weights.
        scaling: `[L]` scale per slot.
        lora_rank: `[L]` int32 real rank per slot.
        y: `[M, N]` output, updated in place (rows without a slot are untouched).
        meta: the step's `LoRABatchMeta`.
        mask_rank: as in `lora_shrink`.
        segments: merged projections (e.g. q/k/v as one `[M, N_q + N_k + N_v]` output): the inner
            column edges, one or two of them, multiples of 16. Segment g uses u's columns
            `[g * r_max, (g + 1) * r_max)` (shrink of A stacked `[L, G * r_max, K]`), B's columns of
            the segment, and `scaling[g]` (scaling `[G, L]`). Needs `mask_rank=False`.
        write_only: `exact` grid only: overwrite y with the delta instead of adding to it, without
            reading y (it may be uninitialized): rows without a slot get zeros. Used when the base
            GEMM adds its product to the delta (`KernelConfig.gemm_adds_lora`).

    Returns:
        `y`.
    """
    _check_expand(lora_b, scaling, meta, mask_rank, segments, write_only)
    width = (len(segments or ()) + 1) * lora_b.shape[2]  # G * r_max columns of u are read
    if u.dim() != 3 or u.shape[1] != y.shape[0] or u.shape[2] < width:
        raise ValueError(f"u must be lora_shrink's partials [S, M = {y.shape[0]}, >= {width}], got {tuple(u.shape)}")
    return _run_expand(y, lora_b, scaling, lora_rank, meta, cfg or get_kernel_config(y.device), mask_rank, u=u,
                       segments=segments, write_only=write_only)


def lora_fused(
    x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, lora_rank: torch.Tensor,
    y: torch.Tensor, meta: LoRABatchMeta, cfg: KernelConfig | None = None, mask_rank: bool = True,
    segments: tuple[int, ...] | None = None, write_only: bool = False,
) -> torch.Tensor:
    """Shrink and expand in one kernel: `y[m] += scaling[s] * (x[m] @ A[s].T) @ B[s].T` in place.

    Same arguments as `lora_shrink` + `lora_expand` (x `[M, K]`, lora_a `[L, r_max, K]`, lora_b
    `[L, N, r_max]`, scaling `[L]`, lora_rank `[L]`, y `[M, N]`, `segments` with lora_a `[L, G *
    r_max, K]` and scaling `[G, L]`, `write_only`); one launch per grid-mode launch instead of two,
    and u never leaves the registers. Returns `y`.
    """
    _check_expand(lora_b, scaling, meta, mask_rank, segments, write_only)
    if lora_a.shape[1] < (len(segments or ()) + 1) * lora_b.shape[2]:
        raise ValueError(f"lora_a must stack {len(segments or ()) + 1} segments of rank {lora_b.shape[2]}, got "
                         f"{tuple(lora_a.shape)}")
    return _run_expand(y, lora_b, scaling, lora_rank, meta, cfg or get_kernel_config(y.device), mask_rank,
                       x=x, lora_a=lora_a, segments=segments, write_only=write_only)
