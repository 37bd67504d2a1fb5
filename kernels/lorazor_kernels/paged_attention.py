"""Causal attention of packed query tokens over a paged KV pool (the engine's attention).

Semantics: query tokens of several requests are packed into one sequence `[N, H, D]`. A *tile* is a
run of consecutive query tokens of one request: `num` tokens from packed index `q_start`, at
positions `pos0 .. pos0 + num - 1` of their request. Token i of a tile attends (causally) to its
request's keys at positions `0 .. pos0 + i`, which live in the pool at
`block_table[request, p // block_size] * block_size + p % block_size`:

    for each tile t, KV head h, query head q of h's group, query i of the tile:
        keys = pool[request's positions 0 .. pos0[t] + i]
        out[q_start[t] + i, q] = softmax(scale * q . keys^T) @ values

One program per (tile, KV head) serves every query head of the group and every query of the tile
as rows of one dot, so each key block is read once per tile. Decode tokens are tiles of one query;
prefill chunks are cut into tiles of `BLOCK_Q` queries. Block tables and tiles are data: a CUDA graph
captured once serves any requests, lengths and block assignments.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_DOT = 16


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, table_ptr, tile_req_ptr, tile_q_ptr, tile_pos_ptr, tile_num_ptr, scale,
    stride_qn, stride_qh, stride_kp, stride_kh, stride_vp, stride_vh, stride_on, stride_oh, stride_table,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, PAGE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1).to(tl.int64)
    req = tl.load(tile_req_ptr + t).to(tl.int64)
    q0 = tl.load(tile_q_ptr + t).to(tl.int64)
    pos0 = tl.load(tile_pos_ptr + t)
    num = tl.load(tile_num_ptr + t)
    # Row m of the dot is query m // GROUP_PAD of the tile, head m % GROUP_PAD of the group.
    m = tl.arange(0, BLOCK_Q * GROUP_PAD)
    qi = m // GROUP_PAD
    g = m % GROUP_PAD
    row_ok = (qi < num) & (g < GROUP)
    q_pos = pos0 + qi  # causal bound of each row (rows past `num` are never stored)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    q = tl.load(q_ptr + (q0 + qi)[:, None] * stride_qn + heads[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full((BLOCK_Q * GROUP_PAD,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_Q * GROUP_PAD,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q * GROUP_PAD, HEAD_DIM), dtype=tl.float32)
    context = pos0 + num  # keys 0 .. context - 1 exist for this tile
    table = table_ptr + req * stride_table
    for s0 in range(0, context, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        key_ok = s < context
        block = tl.load(table + s // PAGE, mask=key_ok, other=0).to(tl.int64)
        flat = block * PAGE + s % PAGE
        k = tl.load(k_ptr + flat[:, None] * stride_kp + kv_head * stride_kh + d[None, :], mask=key_ok[:, None],
                    other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        # Every row sees key 0, so the first block gives each row a finite maximum.
        scores = tl.where(key_ok[None, :] & (s[None, :] <= q_pos[:, None]), scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + flat[:, None] * stride_vp + kv_head * stride_vh + d[None, :], mask=key_ok[:, None],
                    other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    # Empty tiles (count 0: padding of a captured step) saw no key: divide by 1, store nothing.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q0 + qi)[:, None] * stride_on + heads[:, None] * stride_oh + d[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def tile_shape(group: int, single_query: bool) -> tuple[int, int]:
    """(BLOCK_Q, GROUP_PAD) of a launch: a decode launch has one query per tile and pads the group
    to a legal dot dimension; a prefill launch stacks queries until the dot has 64 rows."""
    group_pad = triton.next_power_of_2(group)
    if single_query:
        return 1, max(MIN_DOT, group_pad)
    return max(64 // group_pad, 1), group_pad


def paged_attention(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                    tile_req: torch.Tensor, tile_q: torch.Tensor, tile_pos: torch.Tensor, tile_num: torch.Tensor,
                    scale: float, page_size: int, block_q: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of packed query tokens over paged keys and values (see the module docstring).

    Args:
        query: `[N, H, D]` (unit stride on D).
        k_pool, v_pool: `[P, H_kv, D]` pool positions (P = blocks * page_size), H a multiple of H_kv,
            D a power of two >= 16.
        block_tables: `[R, max_blocks]` int32, one row per request.
        tile_req, tile_q, tile_pos, tile_num: `[T]` int32 per tile: request row, first packed query
            token, position of that token, number of queries (1 .. block_q).
        scale: softmax scale. page_size: positions per block.
        block_q: queries per tile of this launch (1 for decode tiles; `tile_shape`).
        out: `[N, H, D]` output to write (tokens not covered by a tile are left untouched).
    """
    N, H, D = query.shape
    h_kv = k_pool.shape[1]
    if H % h_kv or D < MIN_DOT or D & (D - 1):
        raise ValueError(f"paged_attention needs H % H_kv == 0 and D a power of two >= 16, got H={H}, "
                         f"H_kv={h_kv}, D={D}")
    if query.stride(2) != 1 or k_pool.stride(2) != 1 or v_pool.stride(2) != 1:
        raise ValueError("paged_attention needs a unit stride on the head dimension")
    group = H // h_kv
    single = block_q == 1
    bq, group_pad = tile_shape(group, single)
    if bq != block_q:
        raise ValueError(f"block_q={block_q} does not match this group size {group}: use tile_shape() ({bq})")
    if out is None:
        out = torch.empty(N, H, D, dtype=query.dtype, device=query.device)
    num_tiles = tile_req.shape[0]
    if num_tiles == 0:
        return out
    _paged_attention_kernel[(num_tiles, h_kv)](
        query, k_pool, v_pool, out, block_tables, tile_req, tile_q, tile_pos, tile_num, scale,
        query.stride(0), query.stride(1), k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=bq, HEAD_DIM=D, BLOCK_S=64 if single else 32, PAGE=page_size,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def paged_attention_reference(query, k_pool, v_pool, block_tables, tile_req, tile_q, tile_pos, tile_num, scale,
                              page_size) -> torch.Tensor:
    """Pure-torch oracle of `paged_attention`, one tile at a time (fp32 math, GQA by repeated heads)."""
    N, H, D = query.shape
    group = H // k_pool.shape[1]
    out = torch.zeros_like(query)
    for req, q0, pos0, num in zip(tile_req.tolist(), tile_q.tolist(), tile_pos.tolist(), tile_num.tolist()):
        context = pos0 + num
        s = torch.arange(context, device=query.device)
        flat = block_tables[req].long()[s // page_size] * page_size + s % page_size
        k = k_pool[flat].float().repeat_interleave(group, 1)  # [context, H, D]
        v = v_pool[flat].float().repeat_interleave(group, 1)
        q = query[q0:q0 + num].float()  # [num, H, D]
        scores = torch.einsum("nhd,shd->hns", q, k) * scale
        causal = s[None] <= (pos0 + torch.arange(num, device=query.device))[:, None]
        scores = scores.masked_fill(~causal[None], float("-inf"))
        out[q0:q0 + num] = torch.einsum("hns,shd->nhd", scores.softmax(-1), v).to(query.dtype)
    return out


def paged_attention_step(query: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_tables: torch.Tensor,
                       decode_req: torch.Tensor, decode_q: torch.Tensor, decode_pos: torch.Tensor,
                       decode_num: torch.Tensor, prefill_req: torch.Tensor, prefill_q: torch.Tensor,
                       prefill_pos: torch.Tensor, prefill_num: torch.Tensor, scale: float, page_size: int,
                       block_q: int, zero_fill: bool, use_kernel: bool) -> torch.Tensor:
    """One step's attention as an opaque custom op (torch.compile leaves it whole): the decode tiles
    (one query each) and the prefill tiles (`block_q` queries each) of `query` `[N, H, D]` into one
    output, through the Triton kernel or (`use_kernel=False`) the reference. Tokens outside every
    tile are zeros with `zero_fill` (graph padding), else unspecified."""
    decode = (decode_req, decode_q, decode_pos, decode_num)
    prefill = (prefill_req, prefill_q, prefill_pos, prefill_num)
    if not use_kernel:
        out = query.new_zeros(query.shape)
        for tiles in (decode, prefill):
            if tiles[0].shape[0]:
                out += paged_attention_reference(query, k_pool, v_pool, block_tables, *tiles, scale, page_size)
        return out
    out = torch.zeros_like(query) if zero_fill else torch.empty_like(query)
    for tiles, bq in ((decode, 1), (prefill, block_q)):
        if tiles[0].shape[0]:
            paged_attention(query, k_pool, v_pool, block_tables, *tiles, scale, page_size, bq, out=out)
    return out


# The registered op: torch.compile needs it (an opaque node in the graph); eager callers may call
# `paged_attention_step` itself and skip the op's dispatcher (`paged_attention_call`).
paged_attention_op = torch.library.custom_op("lorazor::paged_attention", mutates_args=())(paged_attention_step)


def paged_attention_call(*args) -> torch.Tensor:
    """`paged_attention_op`'s arguments: the op under torch.compile, else the function itself."""
    return (paged_attention_op if torch.compiler.is_compiling() else paged_attention_step)(*args)


@paged_attention_op.register_fake
def _(query, k_pool, v_pool, block_tables, decode_req, decode_q, decode_pos, decode_num, prefill_req, prefill_q,
      prefill_pos, prefill_num, scale, page_size, block_q, zero_fill, use_kernel):
    return torch.empty_like(query)


# ---- writing a step's keys and values into the pool ---------------------------------------------
def write_pool(pool: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """`pool[slots[i]] = rows[i]` in place (`pool` `[P, H_kv, D]`, `rows` `[N, H_kv, D]`)."""
    pool.index_copy_(0, slots, rows.to(pool.dtype))


# An opaque op that mutates the pool, for compiled steps. Written as plain code, the scatter became an
# inductor kernel that mutates the pool, and inductor's autotuning saves and restores every argument a
# kernel mutates while it benchmarks configs: a copy of the whole KV pool (tens of GB at the default
# `gpu_memory_utilization`) -> out of memory. Inductor never compiles or autotunes a custom op, and
# re-inplaces its mutation (no functional copy of the pool: `tests/model/test_compile.py`).
write_pool_op = torch.library.custom_op("lorazor::write_pool", mutates_args=("pool",))(write_pool)


@write_pool_op.register_fake
def _(pool, slots, rows):
    return None


def write_positions(cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, source: torch.Tensor) -> None:
    """`cache[rows[b], :, positions[b]] = source[b]` in place (`cache` `[B, H, S, D]`, one position per
    row: the contiguous KV cache of `generate()`)."""
    cache[rows, :, positions] = source.to(cache.dtype)


# The same for `generate()`'s contiguous cache, for the same reason as `write_pool_op`.
write_positions_op = torch.library.custom_op("lorazor::write_positions", mutates_args=("cache",))(write_positions)


@write_positions_op.register_fake
def _(cache, rows, positions, source):
    return None
