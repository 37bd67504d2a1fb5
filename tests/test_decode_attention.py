"""The Triton decode attention against its pure-torch reference (per-row key ranges, GQA)."""

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, TOL
from lorazor_kernels import (
    add_batched_lora_,
    add_lora_expand_,
    build_batch_meta,
    decode_attention,
    decode_attention_reference,
    decode_attention_shrink,
    decode_attention_shrink_reference,
)


def _attention_inputs(B, H, H_kv, S, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, H_kv, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, H_kv, S, D, generator=g).to(DEVICE, dtype)
    start = torch.randint(0, S // 2, (B,), generator=g)
    end = torch.minimum(start + 1 + torch.randint(0, S, (B,), generator=g), torch.tensor(S))
    return q, k, v, start.to(DEVICE), end.to(DEVICE), g


@pytest.mark.parametrize("B, H, H_kv, S, D, L, r", [(5, 6, 2, 70, 32, 3, 5), (9, 8, 2, 130, 64, 4, 8),
                                                     (4, 24, 8, 40, 128, 2, 16), (3, 4, 4, 16, 16, 1, 3)])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_attention_shrink_then_expand_equals_separate_lora(B, H, H_kv, S, D, L, r, dtype):
    """The fused o_proj shrink: its partials match the reference, and expanding them adds the same
    delta as the separate shrink + expand on attention's output (rows without a slot untouched)."""
    q, k, v, start, end, g = _attention_inputs(B, H, H_kv, S, D, dtype, seed=B * S + r)
    lora_a = (torch.randn(L, r, H * D, generator=g) / (H * D) ** 0.5).to(DEVICE, dtype)
    lora_b = torch.randn(L, 48, r, generator=g).to(DEVICE, dtype)  # non-zero B
    scaling = (torch.rand(L, generator=g) + 0.5).to(DEVICE)
    rank = torch.full((L,), r, dtype=torch.int32, device=DEVICE)
    row_slot = torch.randint(-1, L, (B,), generator=g)
    row_slot[0] = -1  # at least one row without an adapter
    row_slot = row_slot.to(DEVICE)
    out, u = decode_attention_shrink(q, k, v, start, end, D**-0.5, lora_a, row_slot)
    ref_out, ref_u = decode_attention_shrink_reference(q, k, v, start, end, D**-0.5, lora_a, row_slot)
    torch.testing.assert_close(out.float(), ref_out.float(), **TOL[dtype])
    has = row_slot >= 0
    torch.testing.assert_close(u[:, has, :r], ref_u[:, has, :r], **TOL[dtype])
    meta = build_batch_meta(row_slot, L, "exact")
    y0 = torch.randn(B, 48, generator=g).to(DEVICE, dtype)
    fused = add_lora_expand_(y0.clone(), u, lora_b, scaling, rank, meta)
    separate = add_batched_lora_(y0.clone(), out.reshape(B, H * D), lora_a, lora_b, scaling, rank, meta)
    torch.testing.assert_close(fused.float(), separate.float(), **TOL[dtype])
    assert torch.equal(fused[~has], y0[~has])
    assert not torch.allclose(fused[has].float(), y0[has].float())  # the delta is really there


def test_attention_shrink_bad_lora_a():
    q, k, v, start, end, _ = _attention_inputs(2, 4, 2, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"lora_a must be \[L, r, H \* D = 64\], got \(1, 4, 32\)"):
        decode_attention_shrink(q, k, v, start, end, 0.25, torch.randn(1, 4, 32, device=DEVICE),
                                torch.zeros(2, dtype=torch.long, device=DEVICE))


@pytest.mark.parametrize("B, H, H_kv, S, D", [(1, 4, 4, 16, 16), (5, 6, 2, 70, 32), (9, 8, 2, 130, 64), (3, 24, 8, 64, 128)])
@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
def test_decode_attention_matches_reference(B, H, H_kv, S, D, dtype):
    g = torch.Generator().manual_seed(B * S)
    q = torch.randn(B, H, D, generator=g).to(DEVICE, dtype)
    k = torch.randn(B, H_kv, S, D, generator=g).to(DEVICE, dtype)
    v = torch.randn(B, H_kv, S, D, generator=g).to(DEVICE, dtype)
    start = torch.randint(0, S // 2, (B,), generator=g)
    end = torch.minimum(start + 1 + torch.randint(0, S, (B,), generator=g), torch.tensor(S))
    start, end = start.to(DEVICE), end.to(DEVICE)
    # Poison keys outside each row's range: they must not leak into the output.
    pos = torch.arange(S, device=DEVICE)
    outside = (pos[None] < start[:, None]) | (pos[None] >= end[:, None])
    k.masked_fill_(outside[:, None, :, None], 1e4)
    out = decode_attention(q, k, v, start, end, D**-0.5)
    ref = decode_attention_reference(q, k, v, start, end, D**-0.5)
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def test_strided_query_like_hf():
    # HF hands attention a transposed view [B, H, 1, D] of [B, 1, H, D].
    q = torch.randn(3, 1, 8, 32, device=DEVICE).transpose(1, 2)[:, :, 0]
    k = torch.randn(3, 2, 40, 32, device=DEVICE)
    v = torch.randn(3, 2, 40, 32, device=DEVICE)
    start = torch.tensor([0, 5, 39], device=DEVICE)
    end = torch.tensor([40, 20, 40], device=DEVICE)
    torch.testing.assert_close(decode_attention(q, k, v, start, end, 0.2),
                               decode_attention_reference(q, k, v, start, end, 0.2), atol=1e-4, rtol=1e-4)


def test_bad_head_dim():
    q = torch.randn(1, 2, 24)
    kv = torch.randn(1, 2, 8, 24)
    with pytest.raises(ValueError, match="D a power of two >= 16, got H=2, H_kv=2, D=24"):
        decode_attention(q, kv, kv, torch.tensor([0]), torch.tensor([8]), 1.0)
