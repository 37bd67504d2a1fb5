"""Decode attention over a KV cache with per-row key ranges, GQA without repeated KV heads.

Semantics (one new query token per row):
    for b, kv_head h, query head q of h's group:
        keys = k_cache[b, h, start[b]:end[b]]          # left padding before start, unwritten after end
        out[b, q] = softmax(scale * q_b,q . keys^T) @ v_cache[b, h, start[b]:end[b]]

Each program handles one (row, KV head) and all the query heads of its group, streaming the row's
valid keys once with an online softmax: it reads exactly the keys that exist, where SDPA over the
padded cache reads all of them.

`decode_attention_shrink` also runs the LoRA shrink of the projection that reads this output
(o_proj) in the same programs: each (row, KV head) program multiplies its group's output columns
by the row's adapter A and writes fp32 partials `u [H_kv, B, r_pad]`, which the expand kernel sums
(`lora_expand` takes split partials). One launch per layer less than attention + shrink.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .lora_kernels import padded_rank  # the rank width lora_expand reads

# Group rows are padded to the smallest legal dot dimension.
MIN_DOT = 16


@triton.jit
def _shrink_group_output(out, b, kv_head, a_ptr, slot_ptr, u_ptr, r_max,
                         stride_al, stride_ar, stride_ak, stride_us, stride_ub, stride_ur,
                         GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_R: tl.constexpr):
    """u[kv_head, b, :r_max] = out (this group's heads, as stored) @ A[slot(b), :, their columns].T."""
    slot = tl.load(slot_ptr + b)
    if slot >= 0:
        r = tl.arange(0, BLOCK_R)
        mask_r = r < r_max
        d = tl.arange(0, HEAD_DIM)
        a_slot = a_ptr + slot.to(tl.int64) * stride_al + r[:, None] * stride_ar
        part = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for gi in tl.static_range(GROUP):  # one head at a time keeps the A tile at [BR, D]
            head_out = tl.sum(tl.where((tl.arange(0, GROUP_PAD) == gi)[:, None], out, 0.0), 0)  # [D]
            cols = (kv_head * GROUP + gi) * HEAD_DIM + d
            a = tl.load(a_slot + cols[None, :] * stride_ak, mask=mask_r[:, None], other=0.0)
            part += tl.sum(a.to(tl.float32) * head_out[None, :], 1)
        tl.store(u_ptr + kv_head * stride_us + b * stride_ub + r * stride_ur, part, mask=mask_r)


@triton.jit
def _decode_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, start_ptr, end_ptr, scale,
    stride_qb, stride_qh, stride_kb, stride_kh, stride_ks, stride_vb, stride_vh, stride_vs, stride_ob, stride_oh,
    a_ptr, slot_ptr, u_ptr, r_max, stride_al, stride_ar, stride_ak, stride_us, stride_ub, stride_ur,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    DOT_PRECISION: tl.constexpr, SHRINK: tl.constexpr, BLOCK_R: tl.constexpr,
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
    out = (acc / l_i[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out, mask=mask_g[:, None])
    if SHRINK:  # the shrink reads the output as stored (rounded to its dtype), as a separate kernel would
        _shrink_group_output(out.to(tl.float32), b, kv_head, a_ptr, slot_ptr, u_ptr, r_max,
                             stride_al, stride_ar, stride_ak, stride_us, stride_ub, stride_ur,
                             GROUP, GROUP_PAD, HEAD_DIM, BLOCK_R)


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
    return _launch(query, k_cache, v_cache, start, end, scale, block_s)


def decode_attention_shrink(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float, lora_a: torch.Tensor, row_slot: torch.Tensor, block_s: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention`, plus the LoRA shrink of the projection that reads its output.

    `query`, `k_cache`, `v_cache`, `start`, `end`, `scale` and `block_s` are as in `decode_attention`.

    Args:
        lora_a: `[L, r_max, H * D]` A of the next projection (o_proj), columns in head-major order
            (head h's output is columns `[h * D, (h + 1) * D)`, as `[B, H, D]` flattens).
        row_slot: `[B]` int slot of each row, -1 for none.

    Returns:
        `(out [B, H, D], u [H_kv, B, r_pad] fp32)`: u summed over its first axis is
        `out.flatten(1) @ lora_a[slot].T` for each row with a slot (`lora_expand` sums it); rows
        without a slot and columns from r_max on are not written.
    """
    B, H, D = query.shape
    if lora_a.dim() != 3 or lora_a.shape[2] != H * D:
        raise ValueError(f"lora_a must be [L, r, H * D = {H * D}], got {tuple(lora_a.shape)}")
    if row_slot.shape != (B,):
        raise ValueError(f"row_slot must be [B={B}], got {tuple(row_slot.shape)}")
    u = torch.empty(k_cache.shape[1], B, padded_rank(lora_a.shape[1]), dtype=torch.float32, device=query.device)
    out = _launch(query, k_cache, v_cache, start, end, scale, block_s, (lora_a, row_slot, u))
    return out, u


def _launch(query, k_cache, v_cache, start, end, scale, block_s, shrink=None):
    B, H, D = query.shape
    h_kv = k_cache.shape[1]
    if H % h_kv or D < MIN_DOT or D & (D - 1):
        raise ValueError(f"decode_attention needs H % H_kv == 0 and D a power of two >= 16, got H={H}, "
                         f"H_kv={h_kv}, D={D}")
    group = H // h_kv
    out = torch.empty(B, H, D, dtype=query.dtype, device=query.device)
    if query.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("decode_attention needs a unit stride on the head dimension")
    # Without the shrink its pointers are never read: out and start stand in (no allocation per call).
    lora_a, row_slot, u = shrink if shrink is not None else (out, start, out)
    _decode_attention_kernel[(B, h_kv)](
        query, k_cache, v_cache, out, start, end, scale,
        query.stride(0), query.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        lora_a, row_slot, u, lora_a.shape[1] if shrink is not None else 0,
        *(lora_a.stride() if shrink is not None else (0, 0, 0)), *u.stride(),
        GROUP=group, GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_DIM=D, BLOCK_S=block_s,
        # fp32 dots default to tf32 on the GPU; keep fp32 exact (the fp32 parity tests need it).
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SHRINK=shrink is not None, BLOCK_R=u.shape[2] if shrink is not None else MIN_DOT,
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


@torch.library.custom_op("lorazor::decode_attention_shrink", mutates_args=())
def decode_attention_shrink_op(
    query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
    scale: float, lora_a: torch.Tensor, row_slot: torch.Tensor, backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention_shrink` (backend "triton") or its reference, as an opaque custom op."""
    if backend == "reference":
        return decode_attention_shrink_reference(query, k_cache, v_cache, start, end, scale, lora_a, row_slot)
    return decode_attention_shrink(query, k_cache, v_cache, start, end, scale, lora_a, row_slot)


@decode_attention_shrink_op.register_fake
def _(query, k_cache, v_cache, start, end, scale, lora_a, row_slot, backend):
    B, H, D = query.shape
    return (query.new_empty(B, H, D),
            query.new_empty(k_cache.shape[1], B, padded_rank(lora_a.shape[1]), dtype=torch.float32))


def decode_attention_shrink_reference(query, k_cache, v_cache, start, end, scale, lora_a, row_slot):
    """Pure-torch oracle of `decode_attention_shrink`: u's unwritten entries (rows without a slot,
    columns from r_max on) are 0 here."""
    out = decode_attention_reference(query, k_cache, v_cache, start, end, scale)
    B, H, D = query.shape
    h_kv = k_cache.shape[1]
    r = lora_a.shape[1]
    u = torch.zeros(h_kv, B, padded_rank(r), dtype=torch.float32, device=query.device)
    has = row_slot >= 0
    a = lora_a[row_slot.clamp(min=0)].float().view(B, r, h_kv, H // h_kv * D)  # [B, r, H_kv, group cols]
    per_group = torch.einsum("bhc,brhc->hbr", out.float().view(B, h_kv, H // h_kv * D), a)
    u[:, :, :r] = per_group * has[None, :, None]
    return out, u


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
