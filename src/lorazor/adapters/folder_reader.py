"""Adapter folders read into the bank's slot layout with a handful of torch calls.

Why: the engine reads a cold adapter's folder on a host thread (`read_ahead.py`) beside its own busy
loop. Each torch call releases the GIL and must then take it back from the engine's thread, so a
read made of many small calls (a finiteness check per tensor and two copies per module: about 800
for a Llama-3.2-3B q/v adapter) took several times its lone time (CPU: 7 ms alone, 8 to 38 ms beside a
busy thread), and the cold request waited that long.

Adapters trained by one recipe share their safetensors header (tensor names, dtypes, shapes and
offsets) and their config. The first read of a header is the full path (`load_adapter_weights`:
every check), done on tensors that are views of a staging buffer the file's data was read into;
it leaves a plan: that buffer, the views that copy it into a slot image, and the image's scalings
and ranks. A later folder with the same header and config is one `readinto` of its data, one
`aminmax` over all of it (`all_finite`; if it fails, the full path names the tensor), one
`torch._foreach_copy_` and the image's copies. Other files (`.bin`, mixed dtypes, gaps between
tensors) take the full path every time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..lora.bank import AdapterBank, SlotImage
from .files import check_unchanged, open_file
from .loader import SAFE_FILE, AdapterSource, adapter_weights, all_finite, config_bytes, load_adapter_weights

# Plans kept per reading thread (each holds one adapter's file data and one slot image in host memory).
PLANS_PER_THREAD = 2
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


@dataclass
class _Plan:
    staging: torch.Tensor  # uint8: the file's data region
    data: torch.Tensor  # the same bytes in the file's one dtype
    dst: list[torch.Tensor]  # views of `image.weights`
    src: list[torch.Tensor]  # views of `staging`: A and B^T per module
    image: SlotImage  # zero where the adapter has no weights; scalings and ranks set


class FolderReader:
    """`read(source) -> SlotImage` for a bank; safe to call from several threads (plans are per thread)."""

    def __init__(self, bank: AdapterBank):
        self.bank = bank
        self._pin = bank.device.type == "cuda"  # images in pinned memory, as `bank.pack` makes them
        self._local = threading.local()

    def read(self, source: AdapterSource) -> SlotImage:
        """The folder's slot image. What is read is hashed and compared with the digest taken at
        registration (`files.check_unchanged`): a folder rewritten since is refused."""
        path = source.path / SAFE_FILE
        if not os.path.lexists(path):
            return self._full(source)
        config = config_bytes(source.name, source.path, source.root)
        with open_file(source.name, path, source.root) as f:
            head = f.read(8)
            size = os.fstat(f.fileno()).st_size
            header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            if header_len > size - 8:
                return self._full(source)  # not safetensors: the full path says what is wrong
            header = f.read(header_len)
            key = (header, json.dumps(source.config, sort_keys=True, default=str))
            plans = self._plans()
            plan = plans.get(key)
            if plan is None:
                layout = None if key in plans else _layout(header, size - 8 - header_len)
                if layout is None:
                    plans[key] = None  # remembered: such a file always takes the full path
                    self._trim(plans)
                    return self._full(source)
                dtype, entries = layout
                staging = torch.empty(sum(e - s for s, e, _ in entries.values()), dtype=torch.uint8)
            else:
                staging = plan.staging
            if f.readinto(memoryview(staging.numpy())) != staging.numel():
                return self._full(source)
        digest = hashlib.sha256(config)
        for part in (head, header, memoryview(staging.numpy())):
            digest.update(part)
        check_unchanged(source.name, source.path, source.digest, digest.digest())
        if plan is None:  # the first read of this header: every check, on this very data
            plan = plans[key] = self._plan(source, staging, dtype, entries)
            self._trim(plans)
            return _copy(plan.image, self._pin)
        plans.move_to_end(key)
        if not all_finite(plan.data):
            return self._full(source)  # raises, naming the tensor
        torch._foreach_copy_(plan.dst, plan.src)
        return _copy(plan.image, self._pin)

    def _full(self, source: AdapterSource) -> SlotImage:
        return self.bank.pack(load_adapter_weights(source, self.bank.module_sizes))

    def _plans(self) -> OrderedDict:
        if not hasattr(self._local, "plans"):
            self._local.plans = OrderedDict()
        return self._local.plans

    @staticmethod
    def _trim(plans: OrderedDict) -> None:
        while len(plans) > PLANS_PER_THREAD:
            plans.popitem(last=False)

    def _plan(self, source: AdapterSource, staging: torch.Tensor, dtype: torch.dtype, entries: dict) -> _Plan:
        tensors = {key: staging[s:e].view(dtype).view(shape) for key, (s, e, shape) in entries.items()}
        weights = adapter_weights(source, tensors, self.bank.module_sizes)  # every check; raises on a bad file
        image = self.bank.pack(weights)
        dst, src = self.bank.copies(image.weights, weights)
        return _Plan(staging, staging.view(dtype), dst, src, image)


def _layout(header: bytes, data_len: int) -> tuple[torch.dtype, dict] | None:
    """(dtype, {key: (start, end, shape)}) when the file's tensors share one float dtype and tile
    its data region exactly; None otherwise (the full path reads such files)."""
    try:
        entries = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        dtypes = {v["dtype"] for v in entries.values()}
        spans = sorted((*v["data_offsets"], k, tuple(v["shape"])) for k, v in entries.items())
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if len(dtypes) != 1 or next(iter(dtypes)) not in _DTYPES or not spans:
        return None
    dtype = _DTYPES[dtypes.pop()]
    end = 0
    for start, stop, _, shape in spans:
        if start != end or not all(isinstance(d, int) and d >= 0 for d in shape) \
                or math.prod(shape) * dtype.itemsize != stop - start:
            return None
        end = stop
    return (dtype, {k: (s, e, shape) for s, e, k, shape in spans}) if end == data_len else None


def _copy(image: SlotImage, pin: bool) -> SlotImage:
    """A copy of `image` (the plan's is reused by the next read), pinned when `pin`."""
    return SlotImage(*(torch.empty(t.shape, dtype=t.dtype, pin_memory=pin).copy_(t)
                       for t in (image.weights, image.scaling, image.rank)))
