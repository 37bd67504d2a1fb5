"""The paged KV cache: keys and values of every layer in fixed-size blocks, read through block tables.

A step packs every scheduled request's tokens into one sequence (or, for a decode-only step, one
token per row of a batch). `PagedKVCache.update` (called by the HF attention modules) writes each
token's keys and values at its flat pool position (`slot_mapping`); the attention then reads each
request's keys through its block table (`paged_attention` from lorazor_kernels on the GPU, its
pure-torch reference elsewhere). Everything a step needs is in a `PagedStep` of device tensors, so a
decode-only step is data for a captured CUDA graph.

The pool holds one extra *scratch* block that no request ever owns: padding rows of a graph bucket
write there and read only there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from lorazor_kernels import paged_attention_call, tile_shape

from .layer_stack import LayerStack
from .uploads import to_device

# Keyword argument through which a step's `PagedStep` reaches LoRazor's attention function.
PAGED_KWARG = "lorazor_paged"


@dataclass
class PagedStep:
    """One step's attention metadata (all device tensors).

    Attributes:
        slot_mapping: `[N]` long flat pool position of each token (block * block_size + offset).
        block_tables: `[R, max_blocks]` int32, one row per request of the step.
        decode_tiles: (request row, token index, position, 1) `[T1]` int32 each: tokens attended one
            per tile (decode tokens and one-token chunks).
        prefill_tiles: the same for runs of up to `block_q` consecutive tokens of one request.
        block_q: queries per prefill tile.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    decode_tiles: tuple[torch.Tensor, ...]
    prefill_tiles: tuple[torch.Tensor, ...]
    block_q: int

    zero_fill: bool = False  # tokens outside every tile (graph padding) get zeros, not garbage

    @classmethod
    def build(cls, cache: "PagedKVCache", chunks: list[tuple[int, int, int]], slot_mapping: torch.Tensor,
              block_tables: torch.Tensor, device) -> "PagedStep":
        """From per request (block-table row, first position computed this step, tokens this step),
        packed in this order; `slot_mapping` and `block_tables` are already on the device."""
        decode, prefill = tile_columns(chunks, cache.block_q)
        packed = to_device([v for part in (decode, prefill) for column in part for v in column], device, torch.int32)
        columns = packed.split([len(decode[0])] * 4 + [len(prefill[0])] * 4)
        return cls(slot_mapping, block_tables, tuple(columns[:4]), tuple(columns[4:]), cache.block_q)


def tile_columns(chunks: list[tuple[int, int, int]], block_q: int):
    """(decode tiles, prefill tiles), each four lists (request row, first token, position, count):
    one-token chunks are decode tiles; longer ones are cut into tiles of `block_q` tokens."""
    tiles = ([], [], [], []), ([], [], [], [])
    token = 0
    for row, start, count in chunks:
        target, size = (tiles[0], 1) if count == 1 else (tiles[1], block_q)
        for i in range(0, count, size):
            for column, value in zip(target, (row, token + i, start + i, min(size, count - i))):
                column.append(value)
        token += count
    return tiles


class PagedKVCache:
    """`[(num_blocks + 1) * block_size, H_kv, D]` keys and values per layer (the last block: scratch).

    Args:
        num_layers, num_blocks, block_size, num_kv_heads, head_dim: geometry.
        num_heads: query heads (sets the prefill tile height).
        dtype, device: storage.
        use_kernel: attend with the Triton kernel (else the pure-torch reference).
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 num_heads: int, dtype: torch.dtype, device: torch.device, use_kernel: bool):
        shape = ((num_blocks + 1) * block_size, num_kv_heads, head_dim)
        self.keys = LayerStack(num_layers, shape, dtype, device)
        self.values = LayerStack(num_layers, shape, dtype, device)
        self.block_size = block_size
        self.scratch_block = num_blocks
        self.block_q = tile_shape(num_heads // num_kv_heads, single_query=False)[0]
        self.use_kernel = use_kernel
        self.step: PagedStep | None = None

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    # ---- the interface the runner's decode step uses (shared with the contiguous KVCache) --------
    def begin_decode(self, write_pos: torch.Tensor) -> torch.Tensor:
        """A one-token-per-row step writing row b at flat pool position `write_pos[b]`. The step's
        `PagedStep` must be set; returns the placeholder mask HF passes through untouched."""
        self.step.slot_mapping = write_pos
        # Nothing reads it (the attention reads `step`); built per call, so a compiled step with a
        # dynamic batch has no per-size Python state to guard on.
        return write_pos.new_ones(write_pos.shape[0], 1, 1, 1, dtype=torch.bool)

    def packed_mask(self, num_tokens: int) -> torch.Tensor:
        """The placeholder mask of a packed step (the attention reads the `PagedStep` instead)."""
        return torch.ones(1, 1, num_tokens, 1, dtype=torch.bool, device=self.keys.device)

    def attention_kwargs(self, triton_attention: bool) -> dict:
        """What LoRazor's attention function needs: this cache (its `step` says where to read)."""
        return {PAGED_KWARG: self}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Called by HF attention modules with this step's keys and values, `[1, H_kv, N, D]` (packed)
        or `[B, H_kv, 1, D]` (one token per row)."""
        slots = self.step.slot_mapping
        for pool, new in ((self.keys, key), (self.values, value)):
            rows = new.transpose(1, 2).reshape(-1, *pool.flat.shape[1:])
            pool.index_copy_(layer_idx, slots, rows)
        return key, value

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


def paged_attention_forward(module, query: torch.Tensor, cache: PagedKVCache, scaling):
    """query `[B, H, q, D]` (B = 1 packed, or q = 1 per row) -> `[B, q, H, D]` over the paged pool,
    through one call (the Triton kernel, or its reference off the GPU; an opaque custom op under
    torch.compile)."""
    B, H, q_len, D = query.shape
    flat = query.transpose(1, 2).reshape(B * q_len, H, D)
    layer, step = module.layer_idx, cache.step
    scale = scaling if scaling is not None else D**-0.5
    out = paged_attention_call(flat, cache.keys.layer(layer), cache.values.layer(layer), step.block_tables,
                               *step.decode_tiles, *step.prefill_tiles, scale, cache.block_size, step.block_q,
                               step.zero_fill, cache.use_kernel)
    return out.reshape(B, q_len, H, D)
