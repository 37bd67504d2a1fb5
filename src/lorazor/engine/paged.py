"""The paged KV cache: keys and values of every layer in fixed-size blocks, read through block tables.

A step packs every scheduled request's tokens into one sequence. `PagedKVCache.update` (called by
the HF attention modules) writes each token's keys and values at its request's block position; the
attention then reads, per request, the positions its block table holds up to the token's own
position (`paged_attention_reference`, the pure-torch path: a loop over requests, for the CPU and
the tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# Keyword argument through which a step's `PagedStep` reaches LoRazor's attention function.
PAGED_KWARG = "lorazor_paged"


@dataclass
class PagedStep:
    """One packed step.

    Attributes:
        cache: the `PagedKVCache`.
        slot_mapping: `[N]` flat pool position of each packed token (block * block_size + offset).
        segments: per request, (first packed token, tokens this step, context length after this
            step, `[context]` flat pool positions of its tokens 0..context-1).
    """

    cache: "PagedKVCache"
    slot_mapping: torch.Tensor
    segments: list[tuple[int, int, int, torch.Tensor]]


class PagedKVCache:
    """`[num_blocks * block_size, H_kv, D]` keys and values per layer.

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: geometry.
        dtype, device: storage.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.step: PagedStep | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.keys + self.values)

    def positions(self, block_table: list[int], length: int, device) -> torch.Tensor:
        """Flat pool positions of a request's tokens 0..length-1."""
        blocks = torch.tensor(block_table, dtype=torch.long, device=device)
        offsets = torch.arange(self.block_size, device=device)
        return (blocks[:, None] * self.block_size + offsets[None]).reshape(-1)[:length]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by HF attention modules with this step's `[1, H_kv, N, D]` keys and values."""
        slots = self.step.slot_mapping
        self.keys[layer_idx].index_copy_(0, slots, key[0].transpose(0, 1).to(self.keys[layer_idx].dtype))
        self.values[layer_idx].index_copy_(0, slots, value[0].transpose(0, 1).to(self.values[layer_idx].dtype))
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def paged_attention_reference(module, query: torch.Tensor, step: PagedStep, scaling) -> torch.Tensor:
    """query `[1, H, N, D]` -> `[1, N, H, D]`: each request's tokens attend to its cached positions up
    to their own (causal), GQA without repeated KV heads."""
    cache, layer = step.cache, module.layer_idx
    H = query.shape[1]
    out = query.new_empty(1, query.shape[2], H, query.shape[3])
    for start, count, context, positions in step.segments:
        k = cache.keys[layer][positions].transpose(0, 1).to(query.dtype)  # [H_kv, context, D]
        v = cache.values[layer][positions].transpose(0, 1).to(query.dtype)
        q = query[0, :, start:start + count]  # [H, count, D]
        own = torch.arange(context - count, context, device=query.device)
        mask = torch.arange(context, device=query.device)[None] <= own[:, None]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=H != k.shape[0])
        out[0, start:start + count] = o.transpose(0, 1)
    return out
