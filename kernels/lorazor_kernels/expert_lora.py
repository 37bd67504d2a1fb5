"""The LoRA deltas of MoE token-expert pairs, each from its own slot and expert, read in place.

For pair p (a token routed to expert e_p, its adapter in slot s_p, -1: none) and projection j of
one or two that share the pairs' input x (an expert's gate and up):

    delta_j[p] = scaling_j[e_p, s_p] * B_j[s_p, e_p] @ (A_j[s_p, e_p] @ x[p])      (0 where s_p < 0)

with the bank's stacked expert views A_j `[L, E, r, K]`, B_j `[L, E, N, r]` (any strides) and
scaling_j `[E, L]`; the result is the deltas side by side, `[P, J * N]` (gate then up, as in the
experts' fused gate_up output). `expert_lora_reference` gathers each pair's A and B (a `[P, r, K]`
copy per projection). `expert_lora` reads the pairs' slot weights where they lie, in two launches
whatever J: a shrink over (pair, projection, K split) and an expand over (pair, projection, column
block); pairs without an adapter exit at once. The launch shapes follow the pair count: a decode
step's few pairs split K (partial rank vectors the expand sums) and take narrow column blocks so
that enough programs run; a large step's programs read 256-column blocks. The expand reads a pair's
B `[N, r]` fastest where the bank keeps each expert's B contiguous (it does: `lora/bank.py`).
Weights past a slot's rank are zero (the bank's layout); the kernels load the ranks as one
power-of-two block, masked past the bank's r_max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 256
# Programs a launch should have at least (about four per SM of an H100): fewer pairs split K.
MIN_PROGRAMS = 512


def expert_lora_reference(x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor],
                          scaling: list[torch.Tensor], slot: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """`[P, J * N]` deltas in torch ops (see the module docstring)."""
    active = slot >= 0
    s = slot.clamp(min=0).long()
    e = expert.long()
    deltas = []
    for a_j, b_j, scaling_j in zip(lora_a, lora_b, scaling, strict=True):
        a = a_j[s, e]  # [P, r, K]
        b = b_j[s, e]  # [P, N, r]
        shrunk = torch.bmm(a, x.to(a.dtype)[:, :, None])
        delta = torch.bmm(b, shrunk)[..., 0]
        scale = scaling_j[e, s] * active
        deltas.append((delta * scale[:, None].to(delta.dtype)).to(x.dtype))
    return torch.cat(deltas, dim=-1)


@triton.jit(do_not_specialize=["K", "k_per_split"])
def _shrink_kernel(x_ptr, a0_ptr, a1_ptr, slot_ptr, expert_ptr, t_ptr, K, k_per_split, stride_x, sa_slot, sa_expert,
                   sa_r, R: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
                   PROJS: tl.constexpr):
    p = tl.program_id(0)
    proj = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(slot_ptr + p)
    ranks = tl.arange(0, R_BLOCK)
    in_rank = ranks < R
    acc = tl.zeros((R_BLOCK,), dtype=tl.float32)
    if slot >= 0:
        offset = slot.to(tl.int64) * sa_slot + tl.load(expert_ptr + p).to(tl.int64) * sa_expert
        if proj == 0:
            base = a0_ptr + offset
        else:
            base = a1_ptr + offset
        k_start = split * k_per_split
        for k0 in range(k_start, k_start + k_per_split, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            inside = ks < K
            x = tl.load(x_ptr + p.to(tl.int64) * stride_x + ks, mask=inside, other=0.0).to(tl.float32)
            a = tl.load(base + ranks[:, None] * sa_r + ks[None, :], mask=in_rank[:, None] & inside[None, :],
                        other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(t_ptr + ((p * PROJS + proj) * SPLITS + split) * R_BLOCK + ranks, acc)


@triton.jit(do_not_specialize=["N"])
def _expand_kernel(t_ptr, b0_ptr, b1_ptr, scaling0_ptr, scaling1_ptr, slot_ptr, expert_ptr, out_ptr, N, sb_slot,
                   sb_expert, sb_n, sb_r, s_scaling, R: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                   SPLITS: tl.constexpr, PROJS: tl.constexpr):
    p = tl.program_id(0)
    proj = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < N
    slot = tl.load(slot_ptr + p)
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        expert = tl.load(expert_ptr + p)
        ranks = tl.arange(0, R_BLOCK)
        in_rank = ranks < R
        offset = slot.to(tl.int64) * sb_slot + expert.to(tl.int64) * sb_expert
        if proj == 0:
            base = b0_ptr + offset
            scale = tl.load(scaling0_ptr + expert * s_scaling + slot)
        else:
            base = b1_ptr + offset
            scale = tl.load(scaling1_ptr + expert * s_scaling + slot)
        # The K splits' partial rank vectors (zero past R: the shrink's masked loads).
        row = t_ptr + (p * PROJS + proj) * SPLITS * R_BLOCK
        t = tl.zeros((R_BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLITS):
            t += tl.load(row + s * R_BLOCK + ranks)
        b = tl.load(base + cols[:, None] * sb_n + ranks[None, :] * sb_r, mask=inside[:, None] & in_rank[None, :],
                    other=0.0)
        delta = tl.sum(b.to(tl.float32) * t[None, :], axis=1) * scale
    tl.store(out_ptr + p.to(tl.int64) * (PROJS * N) + proj * N + cols, delta.to(out_ptr.dtype.element_ty),
             mask=inside)


def launch_shape(pairs: int, projections: int, k: int) -> tuple[int, int]:
    """(K splits, expand column block) for a launch over `pairs` pairs (see the module docstring)."""
    programs = max(pairs * projections, 1)
    splits = min(triton.next_power_of_2(max(MIN_PROGRAMS // programs, 1)), triton.cdiv(k, BLOCK_K))
    splits = 1 << (splits.bit_length() - 1)  # a power of two: few compiled variants
    return splits, (64 if programs * 4 < MIN_PROGRAMS else 256)


def _expert_lora(x: torch.Tensor, lora_a: list[torch.Tensor], lora_b: list[torch.Tensor], scaling: list[torch.Tensor],
                 slot: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    projs = len(lora_a)
    if projs not in (1, 2) or len(lora_b) != projs or len(scaling) != projs:
        raise ValueError(f"expert_lora takes one or two projections' A, B and scalings, got {projs}")
    pairs, k = x.shape
    r, n = lora_a[0].shape[2], lora_b[0].shape[2]
    a0, a1 = lora_a[0], lora_a[-1]
    b0, b1 = lora_b[0], lora_b[-1]
    if a0.shape != a1.shape or a0.stride() != a1.stride() or b0.shape != b1.shape or b0.stride() != b1.stride():
        raise ValueError("expert_lora's two projections need A and B stacks of one shape and layout")
    if a0.stride(3) != 1 or any(s.stride(1) != 1 or s.stride() != scaling[0].stride() for s in scaling):
        raise ValueError("expert_lora needs A's K and the scalings' slots contiguous")
    r_block = triton.next_power_of_2(r)  # all r_max ranks as one block (zero past each slot's rank)
    out = torch.empty(pairs, projs * n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    splits, block_n = launch_shape(pairs, projs, k)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    t = torch.empty(pairs, projs, splits, r_block, dtype=torch.float32, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    slot, expert = slot.to(torch.int32).contiguous(), expert.to(torch.int32).contiguous()  # no copy if int32
    _shrink_kernel[(pairs, projs, splits)](x, a0, a1, slot, expert, t, k, k_per_split, x.stride(0), a0.stride(0),
                                           a0.stride(1), a0.stride(2), R=r, R_BLOCK=r_block, BLOCK_K=BLOCK_K,
                                           SPLITS=splits, PROJS=projs)
    _expand_kernel[(pairs, projs, triton.cdiv(n, block_n))](t, b0, b1, scaling[0], scaling[-1], slot, expert, out, n,
                                                             b0.stride(0), b0.stride(1), b0.stride(2), b0.stride(3),
                                                             scaling[0].stride(0), R=r, R_BLOCK=r_block,
                                                             BLOCK_N=block_n, SPLITS=splits, PROJS=projs)
    return out


# An opaque op for torch.compile (the kernels launch from Python).
expert_lora = torch.library.custom_op("lorazor::expert_lora", mutates_args=())(_expert_lora)


@expert_lora.register_fake
def _(x, lora_a, lora_b, scaling, slot, expert):
    return x.new_empty(x.shape[0], len(lora_a) * lora_b[0].shape[2])
