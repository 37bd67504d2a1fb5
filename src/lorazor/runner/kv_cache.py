"""LoRazor's own KV cache: preallocated per layer, written in place at per-row positions.

HF's StaticCache rewrites the whole cache every step and DynamicCache concatenates; this cache writes
exactly one position per row per decode step (`write_pos`, a device tensor, so the step can be
captured in a CUDA graph and replayed for any positions). It plugs into HF attention modules through
the `update(key, value, layer_idx, ...)` call they make; `key_valid` marks which positions hold real
tokens (left padding stays invalid) and drives the attention mask.
"""

from __future__ import annotations

import torch

from .layer_stack import LayerStack

# Keyword argument through which the cache hands decode attention its per-row key ranges.
KV_RANGE_KWARG = "lorazor_kv_range"


class KVCache:
    """Keys and values `[B, H_kv, S, D]` per layer, plus `key_valid [B, S]`.

    Args:
        num_layers, batch_size, num_kv_heads, max_len, head_dim: cache geometry.
        dtype, device: storage dtype and device.
    """

    def __init__(self, num_layers: int, batch_size: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        self.keys = LayerStack(num_layers, shape, dtype, device)
        self.values = LayerStack(num_layers, shape, dtype, device)
        self.key_valid = torch.zeros(batch_size, max_len, dtype=torch.bool, device=device)
        self.write_pos = torch.zeros(batch_size, dtype=torch.long, device=device)
        # Valid keys of row b are exactly [key_start[b], key_end[b]): left padding comes first and
        # decode writes one position per step after the prompt.
        self.key_start = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.key_end = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.batch_size = batch_size
        self.max_len = max_len
        self._rows = torch.arange(batch_size, device=device)
        self._true = torch.ones(batch_size, dtype=torch.bool, device=device)
        self._prefill_len: int | None = None

    def begin_prefill(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """Prepare a prefill of `attention_mask.shape[1]` tokens per row into positions [0, T).

        Returns the `[B, 1, T, T]` bool attention mask: causal, real keys only, and each query may
        always see itself (so padding queries never get an all-masked row and stay finite).
        """
        B, T = attention_mask.shape
        if T > self.max_len:
            raise ValueError(f"prompt length {T} exceeds the KV cache length {self.max_len}")
        self._prefill_len = T
        self.key_valid.zero_()
        self.key_valid[:, :T] = attention_mask.bool()
        self.key_start.copy_(T - attention_mask.long().sum(-1))
        self.key_end.fill_(T)
        causal = torch.ones(T, T, dtype=torch.bool, device=attention_mask.device).tril()
        mask = causal[None] & self.key_valid[:, None, :T]
        mask |= torch.eye(T, dtype=torch.bool, device=attention_mask.device)[None]
        return mask[:, None]

    def begin_decode(self, write_pos: torch.Tensor) -> torch.Tensor:
        """Prepare a one-token decode writing row b at position `write_pos[b]` (device tensor, no sync).

        Returns the `[B, 1, 1, S]` bool attention mask over the whole cache.
        """
        self._prefill_len = None
        self.write_pos.copy_(write_pos)
        torch.add(self.write_pos, 1, out=self.key_end)
        # A tensor value (not a Python True) keeps this a pure device op inside a CUDA graph.
        self.key_valid.index_put_((self._rows, self.write_pos), self._true)
        return self.key_valid[:, None, None, :]

    def attention_kwargs(self, triton_attention: bool) -> dict:
        """Extra arguments of LoRazor's attention function for a decode step: with the Triton kernel,
        each row's valid key range (it then reads only those keys)."""
        return {KV_RANGE_KWARG: (self.key_start, self.key_end)} if triton_attention else {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by HF attention modules: store this step's keys/values, return what to attend over."""
        k_cache, v_cache = self.keys.layer(layer_idx), self.values.layer(layer_idx)
        if self._prefill_len is not None:
            T = self._prefill_len
            k_cache[:, :, :T].copy_(key)
            v_cache[:, :, :T].copy_(value)
            return k_cache[:, :, :T], v_cache[:, :, :T]
        # One new token per row: [B, H_kv, 1, D] -> cache[b, :, write_pos[b]].
        self.keys.put_(layer_idx, self._rows, self.write_pos, key[:, :, 0])
        self.values.put_(layer_idx, self._rows, self.write_pos, value[:, :, 0])
        return k_cache, v_cache

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.max_len
