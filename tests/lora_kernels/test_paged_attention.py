"""The Triton paged attention against its pure-torch reference: packed decode tokens and prefill
chunks of several requests, scattered blocks, GQA, partial tiles."""

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, TOL
from lorazor_kernels import paged_attention, paged_attention_reference, tile_shape


def make_case(lengths_and_new, H, H_kv, D, page, dtype, seed):
    """Requests (context after this step, new tokens this step): a shuffled pool, each request's
    blocks scattered, its new tokens packed into one query sequence."""
    g = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-ctx // page) for ctx, _ in lengths_and_new]
    total = sum(blocks_needed) + 3
    order = torch.randperm(total, generator=g).tolist()
    max_blocks = max(blocks_needed) + 2
    tables = torch.zeros(len(lengths_and_new), max_blocks, dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_needed):
        tables[r, :n] = torch.tensor(order[used:used + n])
        used += n
    k_pool = torch.randn(total * page, H_kv, D, generator=g).to(DEVICE, dtype)
    v_pool = torch.randn(total * page, H_kv, D, generator=g).to(DEVICE, dtype)
    N = sum(new for _, new in lengths_and_new)
    query = torch.randn(N, H, D, generator=g).to(DEVICE, dtype)
    return query, k_pool, v_pool, tables.to(DEVICE)


def tiles(lengths_and_new, block_q, select=lambda new: True):
    """Tiles of `block_q` queries over the requests `select` picks (by their new-token count);
    packed offsets count every request's tokens."""
    req, q0s, pos, num = [], [], [], []
    start = 0
    for r, (ctx, new) in enumerate(lengths_and_new):
        for i in range(0, new if select(new) else 0, block_q):
            req.append(r)
            q0s.append(start + i)
            pos.append(ctx - new + i)
            num.append(min(block_q, new - i))
        start += new
    as_t = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)  # noqa: E731
    return as_t(req), as_t(q0s), as_t(pos), as_t(num)


@pytest.mark.parametrize("H, H_kv, D, page", [(4, 4, 16, 4), (6, 2, 32, 16), (24, 8, 64, 16), (8, 1, 16, 8)])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_mixed_prefill_and_decode(H, H_kv, D, page, dtype):
    # (context after the step, tokens computed this step): decode rows, a whole prompt, a later
    # chunk of a prompt, a chunk that ends mid-tile, and a single-token chunk.
    case = [(1, 1), (37, 1), (23, 23), (70, 19), (5, 5), (130, 1), (17, 3)]
    query, k_pool, v_pool, tables = make_case(case, H, H_kv, D, page, dtype, seed=H * D)
    group = H // H_kv
    out = torch.full_like(query, float("nan"))
    # Two launches write disjoint tokens of one output: decode tiles, then prefill tiles.
    bq = tile_shape(group, single_query=False)[0]
    for select, block_q in ((lambda n: n == 1, 1), (lambda n: n > 1, bq)):
        paged_attention(query, k_pool, v_pool, tables, *tiles(case, block_q, select), D**-0.5, page, block_q,
                        out=out)
    full = tiles(case, 1)
    ref = paged_attention_reference(query, k_pool, v_pool, tables, *full, D**-0.5, page)
    assert not out.isnan().any(), "a token was not written"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_other_requests_blocks_never_leak():
    # Poison every pool position that no request owns: the outputs must stay finite and exact.
    case = [(9, 1), (20, 6)]
    query, k_pool, v_pool, tables = make_case(case, 4, 2, 16, 4, torch.float32, seed=3)
    owned = torch.zeros(k_pool.shape[0], dtype=torch.bool, device=DEVICE)
    for r, (ctx, _) in enumerate(case):
        s = torch.arange(ctx, device=DEVICE)
        owned[tables[r].long()[s // 4] * 4 + s % 4] = True
    k_pool[~owned] = 1e4
    v_pool[~owned] = float("nan")
    t = tiles(case, 1)
    out = paged_attention(query, k_pool, v_pool, tables, *t, 0.25, 4, 1)
    torch.testing.assert_close(out, paged_attention_reference(query, k_pool, v_pool, tables, *t, 0.25, 4))
    assert out.isfinite().all()


def test_refuses_wrong_block_q():
    q = torch.randn(2, 4, 16, device=DEVICE)
    kv = torch.randn(8, 2, 16, device=DEVICE)
    t = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="block_q=3 does not match"):
        paged_attention(q, kv, kv, t[None], t, t, t, t + 1, 1.0, 4, 3)


def test_custom_op_runs_both_launches_and_zero_fills_padding():
    # `lorazor::paged_attention` (what the engine calls, opaque to torch.compile): decode and prefill
    # tiles in one call, kernel against reference; with zero_fill a token outside every tile (graph
    # padding) is zero, also through torch.compile.
    from lorazor_kernels import paged_attention_op

    case = [(9, 1), (30, 12), (4, 1), (50, 7), (6, 1)]
    H, H_kv, D, page = 6, 2, 32, 8
    query, k_pool, v_pool, tables = make_case(case, H, H_kv, D, page, torch.float32, seed=5)
    bq = tile_shape(H // H_kv, single_query=False)[0]
    decode = tiles(case, 1, lambda n: n == 1)
    prefill = tiles(case, bq, lambda n: n > 1)
    padded = torch.cat([query, torch.randn(3, H, D, device=DEVICE)])  # three padding tokens
    args = (padded, k_pool, v_pool, tables, *decode, *prefill, D**-0.5, page, bq, True)
    ref = paged_attention_op(*args, False)
    torch.testing.assert_close(paged_attention_op(*args, True), ref, **TOL[torch.float32])
    assert ref[-3:].abs().max() == 0 and ref[:-3].abs().max() > 0
    compiled = torch.compile(lambda *a: paged_attention_op(*a) * 2, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(*args, False), 2 * ref)
