"""The LoRA delta of MoE token-expert pairs, each from its own slot and expert, read in place.

For pair p (a token routed to expert e_p, its adapter in slot s_p, -1: none):

    delta[p] = scaling[e_p, s_p] * B[s_p, e_p] @ (A[s_p, e_p] @ x[p])      (0 where s_p < 0)

with the bank's stacked expert views A `[L, E, r, K]`, B `[L, E, N, r]` (any strides) and scaling
`[E, L]`. `expert_lora_reference` gathers each pair's A and B (a `[P, r, K]` copy per projection);
`expert_lora` runs one Triton shrink program per pair and one expand program per (pair, column
block), which read the pair's slot weights where they lie: no gathered copy, pairs without an adapter
exit at once. Weights past a slot's rank are zero (the bank's layout); the kernels load the ranks as
one power-of-two block, masked past the bank's r_max.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def expert_lora_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                          slot: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """`[P, N]` deltas in torch ops (see the module docstring)."""
    active = slot >= 0
    s = slot.clamp(min=0)
    a = lora_a[s, expert]  # [P, r, K]
    b = lora_b[s, expert]  # [P, N, r]
    shrunk = torch.bmm(a, x.to(a.dtype)[:, :, None])
    delta = torch.bmm(b, shrunk)[..., 0]
    scale = scaling[expert, s] * active
    return (delta * scale[:, None].to(delta.dtype)).to(x.dtype)


@triton.jit(do_not_specialize=["K"])
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, expert_ptr, t_ptr, K, stride_x, sa_slot, sa_expert, sa_r,
                   R: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_K: tl.constexpr):
    p = tl.program_id(0)
    slot = tl.load(slot_ptr + p)
    ranks = tl.arange(0, R_BLOCK)
    in_rank = ranks < R
    acc = tl.zeros((R_BLOCK,), dtype=tl.float32)
    if slot >= 0:
        base = a_ptr + slot.to(tl.int64) * sa_slot + tl.load(expert_ptr + p).to(tl.int64) * sa_expert
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            inside = ks < K
            x = tl.load(x_ptr + p.to(tl.int64) * stride_x + ks, mask=inside, other=0.0).to(tl.float32)
            a = tl.load(base + ranks[:, None] * sa_r + ks[None, :], mask=in_rank[:, None] & inside[None, :],
                        other=0.0)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
    tl.store(t_ptr + p * R_BLOCK + ranks, acc)


@triton.jit(do_not_specialize=["N"])
def _expand_kernel(t_ptr, b_ptr, scaling_ptr, slot_ptr, expert_ptr, out_ptr, N, sb_slot, sb_expert, sb_n, sb_r,
                   s_scaling, R: tl.constexpr, R_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr):
    p = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < N
    slot = tl.load(slot_ptr + p)
    delta = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if slot >= 0:
        expert = tl.load(expert_ptr + p)
        ranks = tl.arange(0, R_BLOCK)
        in_rank = ranks < R
        t = tl.load(t_ptr + p * R_BLOCK + ranks)  # zero past R (the shrink's masked loads)
        base = b_ptr + slot.to(tl.int64) * sb_slot + expert.to(tl.int64) * sb_expert
        b = tl.load(base + cols[:, None] * sb_n + ranks[None, :] * sb_r, mask=inside[:, None] & in_rank[None, :],
                    other=0.0)
        scale = tl.load(scaling_ptr + expert * s_scaling + slot)
        delta = tl.sum(b.to(tl.float32) * t[None, :], axis=1) * scale
    tl.store(out_ptr + p.to(tl.int64) * N + cols, delta.to(out_ptr.dtype.element_ty), mask=inside)


def _expert_lora(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                 slot: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    pairs, k = x.shape
    r, n = lora_a.shape[2], lora_b.shape[2]
    if lora_a.stride(3) != 1 or scaling.stride(1) != 1:
        raise ValueError("expert_lora needs A's K and the scalings' slots contiguous")
    r_block = triton.next_power_of_2(r)  # all r_max ranks as one block (zero past each slot's rank)
    out = torch.empty(pairs, n, dtype=x.dtype, device=x.device)
    if pairs == 0:
        return out
    t = torch.empty(pairs, r_block, dtype=torch.float32, device=x.device)
    x = x if x.stride(1) == 1 else x.contiguous()
    slot, expert = slot.to(torch.int32).contiguous(), expert.to(torch.int32).contiguous()
    _shrink_kernel[(pairs,)](x, lora_a, slot, expert, t, k, x.stride(0), lora_a.stride(0), lora_a.stride(1),
                             lora_a.stride(2), R=r, R_BLOCK=r_block, BLOCK_K=128)
    block_n = 64
    _expand_kernel[(pairs, triton.cdiv(n, block_n))](t, lora_b, scaling, slot, expert, out, n, lora_b.stride(0),
                                                     lora_b.stride(1), lora_b.stride(2), lora_b.stride(3),
                                                     scaling.stride(0), R=r, R_BLOCK=r_block,
                                                     BLOCK_N=block_n)
    return out


# An opaque op for torch.compile (the kernels launch from Python).
expert_lora = torch.library.custom_op("lorazor::expert_lora", mutates_args=())(_expert_lora)


@expert_lora.register_fake
def _(x, lora_a, lora_b, scaling, slot, expert):
    return x.new_empty(x.shape[0], lora_b.shape[2])
