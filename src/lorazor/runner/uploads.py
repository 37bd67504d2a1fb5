"""Host -> device copies of a step's inputs that never make the host wait for the GPU.

PyTorch copies ordinary (pageable) host memory to the GPU synchronously: `torch.tensor(..., device=
"cuda")`, `.to("cuda")` and `copy_` from a CPU tensor wait until the stream has run everything
queued before them. The engine prepares step n+1 while the GPU runs step n (`LoRazorEngine`'s
async scheduling), so such a copy would stall the host until step n ends. Here the data goes
through pinned memory from PyTorch's caching host allocator and is copied without blocking; the
allocator keeps each pinned block until the copy that reads it has run, so the host may drop or
reuse its own arrays at once. Off the GPU these are plain tensors.
"""

from __future__ import annotations

import numpy as np
import torch


def _pinned(data, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """`data` (a list, a numpy array or a CPU tensor) as a CPU tensor of `dtype`, in pinned memory
    with `pin` (a copy, so the caller's array may change at once)."""
    host = (torch.from_numpy(data) if isinstance(data, np.ndarray) else torch.as_tensor(data)).to(dtype)
    return host.pin_memory() if pin else host


def to_device(data, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """`data` as a new tensor on `device`, without a host wait."""
    on_gpu = torch.device(device).type == "cuda"
    host = _pinned(data, dtype, on_gpu)
    return host.to(device, non_blocking=True) if on_gpu else host


def upload_into(target: torch.Tensor, data) -> None:
    """Copy host `data` into the device tensor `target` (same shape), without a host wait."""
    on_gpu = target.device.type == "cuda"
    target.copy_(_pinned(data, target.dtype, on_gpu), non_blocking=on_gpu)
