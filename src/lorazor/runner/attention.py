"""Attention over LoRazor's KV cache, registered with transformers' AttentionInterface as "lorazor".

The HF attention module computes q/k/v and RoPE, calls `KVCache.update`, then this function with the
`[B, 1, q, S]` bool mask LoRazor passed as `attention_mask` (a 4-D mask reaches attention untouched).
Decode with GQA folds each KV head's query group into the query-length axis, so SDPA reads every key
and value once and never materializes repeated KV heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lorazor_kernels import decode_attention_op as decode_attention

from .kv_cache import KV_RANGE_KWARG
from .paged_cache import PAGED_KWARG, paged_attention_forward

ATTENTION_NAME = "lorazor"


def lorazor_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query `[B, H, q, D]`, key/value `[B, H_kv, S, D]`, bool mask `[B, 1, q, S]` -> `[B, q, H, D]`.

    With one query token and the `lorazor_kv_range` kwarg (start, end per row), the Triton decode
    kernel reads only each row's valid keys; otherwise SDPA runs over the masked cache.
    """
    paged = kwargs.get(PAGED_KWARG)
    softcap = kwargs.get("softcap")
    if paged is not None:
        if softcap is not None:  # the engine refuses such models up front; this is the backstop
            raise NotImplementedError("the paged attention has no attention-logit softcapping")
        return paged_attention_forward(module, query, paged, scaling), None
    if attention_mask is None or attention_mask.dtype != torch.bool:
        raise RuntimeError("lorazor attention needs the bool mask built by LoRazor's KV cache")
    B, H, q_len, D = query.shape
    h_kv = key.shape[1]
    if softcap is not None:
        return softcapped_attention(query, key, value, attention_mask, scaling if scaling is not None else D**-0.5,
                                    softcap), None
    kv_range = kwargs.get(KV_RANGE_KWARG)
    if q_len == 1 and kv_range is not None:
        scale = scaling if scaling is not None else D**-0.5
        out = decode_attention(query[:, :, 0], key, value, kv_range[0], kv_range[1], scale)
        return out[:, None], None
    if q_len == 1 and H != h_kv:
        q = query.reshape(B, h_kv, H // h_kv, D)
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=attention_mask, scale=scaling)
        out = out.reshape(B, H, 1, D)
    else:
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=H != h_kv
        )
    return out.transpose(1, 2).contiguous(), None


def softcapped_attention(query, key, value, mask, scale: float, softcap: float) -> torch.Tensor:
    """Attention with Gemma 2's logit softcapping, `softcap * tanh(scores / softcap)` before the
    mask and softmax, as HF's eager attention computes it (SDPA has no softcapping)."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    return torch.matmul(probs, value).transpose(1, 2).contiguous()


def register_attention() -> None:
    """Make "lorazor" a valid `attn_implementation` (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, lorazor_attention)
