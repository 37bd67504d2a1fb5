"""The Triton decode attention against its pure-torch reference (per-row key ranges, GQA)."""

import pytest
import torch
from conftest import DEVICE, KERNEL_DTYPES, TOL
from lorazor_kernels import decode_attention, decode_attention_reference


@pytest.mark.parametrize(
    "B, H, H_kv, S, D", [(1, 4, 4, 16, 16), (5, 6, 2, 70, 32), (9, 8, 2, 130, 64), (3, 24, 8, 64, 128)]
)
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
