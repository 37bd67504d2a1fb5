"""Every decoder layer's KV storage in one allocation, indexable by a symbolic layer number.

With `compile=True` torch.compile traces one decoder layer and reuses it for every layer
(`compiled_layers.py`). The layer's number (HF's `self_attn.layer_idx`) must then stay a symbolic
int: indexing a Python list of per-layer tensors with it would make dynamo specialize on it (one
compile per layer), and writing into a view of a stacked tensor makes inductor copy the whole
layer back. So the compiled code writes into the flat tensor at `index + layer * rows` (in place,
through the opaque `lorazor::write_pool` / `write_positions` ops: see there why inductor must not
generate that scatter)
and reads the layer as a narrowed view. Eager code takes the layer's view from a list (no offset
kernel).
"""

from __future__ import annotations

import torch
from lorazor_kernels import write_pool, write_pool_op, write_positions, write_positions_op


class LayerStack:
    """`num_layers` tensors of `shape`, stored as one `[num_layers * shape[0], *shape[1:]]` tensor."""

    def __init__(self, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
        self.rows = shape[0]
        self.flat = torch.zeros(num_layers * self.rows, *shape[1:], dtype=dtype, device=device)
        self.layers = list(self.flat.split(self.rows))  # views, no copies

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def device(self) -> torch.device:
        return self.flat.device

    def layer(self, layer) -> torch.Tensor:
        """Layer `layer`'s tensor (a view)."""
        if torch.compiler.is_compiling():
            return self.flat.narrow(0, layer * self.rows, self.rows)
        return self.layers[layer]

    def index_copy_(self, layer, index: torch.Tensor, source: torch.Tensor) -> None:
        """`self[layer].index_copy_(0, index, source)`."""
        if torch.compiler.is_compiling():
            write_pool_op(self.flat, index + layer * self.rows, source)
        else:
            write_pool(self.layers[layer], index, source)

    def put_(self, layer, rows: torch.Tensor, cols: torch.Tensor, source: torch.Tensor) -> None:
        """`self[layer][rows, :, cols] = source` (one position per row of a `[B, H, S, D]` layer)."""
        if torch.compiler.is_compiling():
            write_positions_op(self.flat, rows + layer * self.rows, cols, source)
        else:
            write_positions(self.layers[layer], rows, cols, source)
