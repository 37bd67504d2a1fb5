"""Decode attention over a KV cache with per-row key ranges, GQA without repeated KV heads.

Semantics (one new query token per row):
    for b, kv_head h, query head q of h's group:
        keys = k_cache[b, h, start[b]:end[b]]          # left padding before start, unwritten after end
        out[b, q] = softmax(scale * q_b,q . keys^T) @ v_cache[b, h, start[b]:end[b]]

Each program handles one (row, KV head) and all the query heads of its group, streaming the row's
valid keys once with an online softmax: it reads exactly the keys that exist, where SDPA over the
padded cache reads all of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Group rows are padded to the smallest legal dot dimension.
MIN_DOT = 16


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, end_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    start = tl.load(start_ptr + b)
    end = tl.load(end_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    mask_g = g < GROUP
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=mask_g[:, None], other=0.0)
    k_base = k_ptr + b * stride_kb + kv_head * stride_kh
    v_base = v_ptr + b * stride_vb + kv_head * stride_vh
    m_i = tl.full((GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    for s0 in range(start, end, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        mask_s = s < end
        k = tl.load(k_base + s[:, None] * stride_ks + d[None, :], mask=mask_s[:, None], other=0.0)  # [BS, D]
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [GP, BS]
        scores = tl.where(mask_s[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + s[:, None] * stride_vs + d[None, :], mask=mask_s[:, None], other=0.0)  # [BS, D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
             mask=mask_g[:, None])


def decode_attention(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float, block_s: int = 64,
) -> torch.Tensor:
    """Attention of one query token per row over the row's cached keys `[start, end)`.

    Args:
        query: `[B, H, D]` (any strides with a unit last stride).
        k_cache: `[B, H_kv, S, D]`, H a multiple of H_kv, D a power of two >= 16.
        v_cache: `[B, H_kv, S, D]`, like `k_cache`.
        start: `[B]` int first valid key of each row.
        end: `[B]` int one past the last valid key (start < end <= S).
        scale: softmax scale (1 / sqrt(D) usually).

    Returns:
        `[B, H, D]` in `query.dtype`.
    """
    B, H, D = query.shape
    h_kv = k_cache.shape[1]
    if H % h_kv or D < MIN_DOT or D & (D - 1):
        raise ValueError(f"decode_attention needs H % H_kv == 0 and D a power of two >= 16, got H={H}, "
                         f"H_kv={h_kv}, D={D}")
    group = H // h_kv
    out = torch.empty(B, H, D, dtype=query.dtype, device=query.device)
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("decode_attention needs a unit stride on the head dimension")
    _decode_attention_kernel[(B, h_kv)](
        query, k_cache, v_cache, out, start, end, scale,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK_S=block_s,
        # fp32 dots default to tf32 on the GPU; keep fp32 exact (the fp32 parity tests need it).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


@torch.library.custom_op("lorazor::decode_attention", mutates_args=())
def decode_attention_op(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`decode_attention` as an opaque custom op, so torch.compile leaves the kernel as it is."""
    return decode_attention(query, k_cache, v_cache, start, end, scale)


@decode_attention_op.register_fake
def _(query, k_cache, v_cache, start, end, scale):
    return query.new_empty(query.shape[0], query.shape[1], query.shape[2])


def decode_attention_reference(query, k_cache, v_cache, start, end, scale) -> torch.Tensor:
    """Pure-torch oracle of `decode_attention` (masking, GQA by repeating KV heads)."""
    B, H, D = query.shape
    S = k_cache.shape[2]
    group = H // k_cache.shape[1]
    k = k_cache.repeat_interleave(group, 1).float()
    v = v_cache.repeat_interleave(group, 1).float()
    pos = torch.arange(S, device=query.device)
    valid = (pos[None] >= start[:, None]) & (pos[None] < end[:, None])
    scores = torch.einsum("bhd,bhsd->bhs", query.float(), k) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return torch.einsum("bhs,bhsd->bhd", scores.softmax(-1), v).to(query.dtype)
