"""SiLU-and-multiply fused with the LoRA shrink of the projection that reads its output (down_proj).

Semantics (the gated MLP of Llama, Mistral, Qwen2, as HF computes it in the weights' dtype):
    h[m] = dtype(dtype(silu(gate[m])) * up[m])
    u[m] = h[m] @ lora_a[s].T                      for every row m with a slot s (fp32 partials)

One kernel instead of the activation kernel plus the shrink kernel: one launch per layer less.
Programs follow the `exact` grid's tile table (each tile: one slot, up to BLOCK_M of its rows, so
one A tile serves the whole tile, as in the shrink kernel), then one program per BLOCK_M rows
without an adapter (h only, from the end of `sorted_rows`). K is split over grid axis 1; the
expand kernel sums the splits' partials.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .kernel_config import KernelConfig, get_kernel_config
from .lora_kernels import padded_rank
from .meta import LoRABatchMeta
from .reference import lora_shrink_reference


@triton.jit
def _silu_mul_shrink_kernel(
    gate_ptr, up_ptr, h_ptr, a_ptr, u_ptr, sorted_rows_ptr, slot_start_ptr, tile_slot_ptr, tile_rows_ptr,
    M, K, r_max, num_tiles, num_slots, k_per_split,
    stride_gm, stride_gk, stride_pm, stride_pk, stride_hm, stride_hk,
    stride_al, stride_ar, stride_ak, stride_us, stride_um, stride_ur,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    lanes = tl.arange(0, BLOCK_M)
    if pid < num_tiles:  # a tile of one slot's rows (unused tiles hold none)
        slot = tl.load(tile_slot_ptr + pid)
        rows = tl.load(tile_rows_ptr + pid * BLOCK_M + lanes).to(tl.int64)
        mask_m = rows >= 0
    else:  # rows without an adapter, which sort after every slot's rows
        slot = tl.full([], -1, tl.int32)
        offs = tl.load(slot_start_ptr + num_slots) + (pid - num_tiles) * BLOCK_M + lanes
        mask_m = offs < M
        rows = tl.load(sorted_rows_ptr + offs, mask=mask_m, other=0).to(tl.int64)
    if tl.sum(mask_m.to(tl.int32)) == 0:
        return
    rows = tl.maximum(rows, 0)
    offs_r = tl.arange(0, BLOCK_R)
    mask_r = offs_r < r_max
    a_rows = a_ptr + tl.maximum(slot, 0).to(tl.int64) * stride_al + offs_r[:, None] * stride_ar
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        mask = mask_m[:, None] & (k < K)[None, :]
        g = tl.load(gate_ptr + rows[:, None] * stride_gm + k[None, :] * stride_gk, mask=mask, other=0.0)
        p = tl.load(up_ptr + rows[:, None] * stride_pm + k[None, :] * stride_pk, mask=mask, other=0.0)
        g32 = g.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype)  # rounded as HF's separate act_fn output is
        h = (act.to(tl.float32) * p.to(tl.float32)).to(g.dtype)
        tl.store(h_ptr + rows[:, None] * stride_hm + k[None, :] * stride_hk, h, mask=mask)
        if slot >= 0:
            a = tl.load(a_rows + k[None, :] * stride_ak, mask=mask_r[:, None] & (k < K)[None, :], other=0.0)
            acc += tl.dot(h.to(a.dtype), tl.trans(a), input_precision=DOT_PRECISION)
    if slot >= 0:
        tl.store(u_ptr + pid_k * stride_us + rows[:, None] * stride_um + offs_r[None, :] * stride_ur, acc,
                 mask=mask_m[:, None] & mask_r[None, :])


def shrink_splits(num_rows: int, K: int, cfg: KernelConfig, device: torch.device) -> int:
    """K splits of `silu_mul_shrink`: from static shapes only (the compiled step's fake output
    shape must match), enough for about `cfg.target_programs_per_sm` programs per SM."""
    max_splits = triton.cdiv(K, cfg.shrink_block_k)
    if cfg.shrink_split_k > 0:
        return min(cfg.shrink_split_k, max_splits)
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    row_tiles = 2 * triton.cdiv(num_rows, 16)  # tiles with rows, about twice the full tiles
    return max(1, min(max_splits, triton.cdiv(cfg.target_programs_per_sm * sms, row_tiles)))


def silu_mul_shrink(gate: torch.Tensor, up: torch.Tensor, lora_a: torch.Tensor, meta: LoRABatchMeta,
                    cfg: KernelConfig | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`h = silu(gate) * up` and the LoRA shrink of h for the `exact` grid's rows, in one kernel.

    Args:
        gate: `[M, K]` (any strides: a slice of the merged gate/up output).
        up: `[M, K]`, like gate.
        lora_a: `[L, r_max, K]` A of the projection that reads h (down_proj); zeros past each
            slot's rank (the bank's layout).
        meta: the step's `exact` metadata (tile table).

    Returns:
        `(h [M, K] in gate's dtype, u [S, M, r_pad] fp32 partials)`: `lora_expand` sums u's splits;
        rows without a slot are not written in u.
    """
    if meta.grid != "exact":
        raise ValueError(f"silu_mul_shrink needs the exact grid's tile table, got grid {meta.grid!r}")
    M, K = gate.shape
    if up.shape != (M, K) or lora_a.dim() != 3 or lora_a.shape[2] != K:
        raise ValueError(f"gate {tuple(gate.shape)}, up {tuple(up.shape)} and lora_a {tuple(lora_a.shape)} "
                         "must be [M, K], [M, K] and [L, r, K]")
    cfg = cfg or get_kernel_config(gate.device)
    split = shrink_splits(M, K, cfg, gate.device)
    k_per_split = triton.cdiv(triton.cdiv(K, split), cfg.shrink_block_k) * cfg.shrink_block_k
    h = torch.empty(M, K, dtype=gate.dtype, device=gate.device)
    u = torch.empty(split, M, padded_rank(lora_a.shape[1]), dtype=torch.float32, device=gate.device)
    programs = meta.num_tiles + triton.cdiv(M, meta.block_m)
    _silu_mul_shrink_kernel[(programs, triton.cdiv(K, k_per_split))](
        gate, up, h, lora_a, u, meta.sorted_rows, meta.slot_start, meta.tile_slot, meta.tile_rows,
        M, K, lora_a.shape[1], meta.num_tiles, meta.num_slots, k_per_split,
        gate.stride(0), gate.stride(1), up.stride(0), up.stride(1), h.stride(0), h.stride(1),
        lora_a.stride(0), lora_a.stride(1), lora_a.stride(2), u.stride(0), u.stride(1), u.stride(2),
        BLOCK_M=meta.block_m, BLOCK_R=u.shape[2], BLOCK_K=cfg.shrink_block_k,
        DOT_PRECISION="ieee" if gate.dtype == torch.float32 else "tf32",
        num_warps=cfg.shrink_num_warps, num_stages=cfg.shrink_num_stages,
    )
    return h, u


def silu_mul_shrink_reference(gate, up, lora_a, row_slot) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch oracle of `silu_mul_shrink` (one split; rows without a slot get zeros in u)."""
    h = (torch.nn.functional.silu(gate.float()).to(gate.dtype).float() * up.float()).to(gate.dtype)
    r = lora_a.shape[1]
    u = torch.zeros(1, gate.shape[0], padded_rank(r), dtype=torch.float32, device=gate.device)
    u[0, :, :r] = lora_shrink_reference(h, lora_a, row_slot).float()
    return h, u


@torch.library.custom_op("lorazor::silu_mul_shrink", mutates_args=())
def silu_mul_shrink_op(
    gate: torch.Tensor, up: torch.Tensor, lora_a: torch.Tensor, row_slot: torch.Tensor, sorted_rows: torch.Tensor,
    slot_start: torch.Tensor, tile_slot: torch.Tensor | None, tile_rows: torch.Tensor | None,
    large_slots: torch.Tensor | None, grid: str, num_slots: int, block_m: int, row_bound: int, class_split: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`silu_mul_shrink` (backend "triton") or its reference, as an opaque custom op; the metadata
    comes as `LoRABatchMeta.op_args()`."""
    if backend == "reference":
        return silu_mul_shrink_reference(gate, up, lora_a, row_slot)
    meta = LoRABatchMeta.from_op_args(row_slot, sorted_rows, slot_start, tile_slot, tile_rows, large_slots, grid,
                                      num_slots, block_m, row_bound, class_split)
    return silu_mul_shrink(gate, up, lora_a, meta)


@silu_mul_shrink_op.register_fake
def _(gate, up, lora_a, row_slot, sorted_rows, slot_start, tile_slot, tile_rows, large_slots, grid, num_slots,
      block_m, row_bound, class_split, backend):
    M, K = gate.shape
    split = 1 if backend == "reference" else shrink_splits(M, K, get_kernel_config(gate.device), gate.device)
    return gate.new_empty(M, K), gate.new_empty(split, M, padded_rank(lora_a.shape[1]), dtype=torch.float32)
