"""AdapterBank: the GPU slots. Stacked LoRA weights per target module, and which adapter holds each slot.

For each target linear module the bank holds PEFT's layouts stacked over slots:
    lora_a [L, r_max, K]   (lora_A.weight of each adapter, zero past its rank)
    lora_b [L, N, r_max]   (lora_B.weight)
    scaling [L]            (alpha / r, or alpha / sqrt(r) with rsLoRA: PEFT's own value)
    rank [L] int32         (0 where the adapter does not target this module: no delta there)
Modules are named as in the Hugging Face model (`model.layers.0.self_attn.q_proj`). A slot is
written in place from a `SlotImage` (one adapter packed in the slots' layout), so captured CUDA
graphs stay valid; on the GPU the copy runs on a side stream that the compute stream waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .types import AdapterError, AdapterWeights

NO_ADAPTER = -1


@dataclass
class ModuleLoRA:
    """Stacked LoRA weights of one target module over all slots.

    `host_rank` mirrors `rank` on the host, so the layers know without a sync whether the kernels
    must mask per-slot ranks (`mask_rank`).
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: torch.Tensor
    rank: torch.Tensor
    host_rank: list[int]
    # `mask_rank`, kept up to date by `set_host_rank`: every layer reads it every step, and a plain
    # bool is one guard for torch.compile (not one per slot's rank, nor a cache state to recompile on).
    _mask_rank: bool = field(default=False, init=False, repr=False)

    def __post_init__(self):
        self._mask_rank = self._partial_ranks()

    def _partial_ranks(self) -> bool:
        r_max = self.lora_a.shape[1]
        return any(0 < r < r_max for r in self.host_rank)

    def set_host_rank(self, slot: int, rank: int) -> None:
        self.host_rank[slot] = rank
        self._mask_rank = self._partial_ranks()

    @property
    def mask_rank(self) -> bool:
        """True when some slot's rank is between 0 and the bank's r_max: the kernels then read each
        slot's rank and load only that many rows. Otherwise weights past a slot's rank are zero
        (rank-0 slots: all zero) and the kernels skip the rank load."""
        return self._mask_rank

    def slot_views(self, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot `slot`'s A `[r_max, K]` and B storage `[r_max, N]` (B is stored N-contiguous)."""
        return self.lora_a[slot], self.lora_b[slot].transpose(0, 1)


@dataclass
class SlotImage:
    """One adapter packed in the bank's slot layout, on the host (pinned when a GPU is used).

    Attributes:
        weights: every module's A `[r_max, K]` then B `[r_max, N]`, flattened, zero past each rank.
        scaling: `[modules]` float32; rank: `[modules]` int32 (0: module not targeted).
    """

    weights: torch.Tensor
    scaling: torch.Tensor
    rank: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.weights.nbytes + self.scaling.nbytes + self.rank.nbytes


class AdapterBank:
    """`max_loras` slots over a model's target modules, and the adapter name -> slot map.

    Args:
        modules: module name -> `ModuleLoRA` (every module's tensors have `num_slots` slots).
        num_slots: L, the number of slots.
    """

    def __init__(self, modules: dict[str, ModuleLoRA], num_slots: int):
        if not modules:
            raise AdapterError("no LoRA target modules: nothing for adapters to apply to")
        self.modules = modules
        self.num_slots = num_slots
        self.names: list[str | None] = [None] * num_slots
        self.slot_of: dict[str, int] = {}
        first = next(iter(modules.values()))
        self.r_max = first.lora_a.shape[1]
        self.dtype, self.device = first.lora_a.dtype, first.lora_a.device
        self._sizes = [(m.lora_a.shape[1] * m.lora_a.shape[2], m.lora_b.shape[2] * m.lora_b.shape[1])
                       for m in modules.values()]
        self._views: dict[int, tuple] = {}
        self._tensors: tuple = ()
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._staging: SlotImage | None = None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> end of its last write

    @classmethod
    def empty(cls, layers: dict[str, nn.Linear], num_slots: int, r_max: int,
              dtype: torch.dtype | None = None) -> "AdapterBank":
        """Empty slots for these base linear layers (module name -> nn.Linear), on their device."""
        modules = {}
        for name, base in layers.items():
            w_dtype, device = dtype or base.weight.dtype, base.weight.device
            lora_a = torch.zeros(num_slots, r_max, base.in_features, dtype=w_dtype, device=device)
            # Stored [L, r, N] (N contiguous) and used through a [L, N, r] view: the expand kernel then
            # loads B along N in full vectors while masking only whole rank rows.
            lora_b = torch.zeros(num_slots, r_max, base.out_features, dtype=w_dtype, device=device).transpose(1, 2)
            scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
            rank = torch.zeros(num_slots, dtype=torch.int32, device=device)
            modules[name] = ModuleLoRA(lora_a, lora_b, scaling, rank, [0] * num_slots)
        return cls(modules, num_slots)

    @property
    def module_sizes(self) -> dict[str, tuple[int, int]]:
        """Module name -> (in_features, out_features)."""
        return {n: (m.lora_a.shape[2], m.lora_b.shape[1]) for n, m in self.modules.items()}

    # ---- images ---------------------------------------------------------------------------------
    def pack(self, weights: AdapterWeights, pin: bool | None = None) -> SlotImage:
        """`weights` in this bank's slot layout (host memory; pinned on a GPU machine by default)."""
        pin = self.device.type == "cuda" if pin is None else pin
        flat = torch.zeros(sum(a + b for a, b in self._sizes), dtype=self.dtype, pin_memory=pin)
        scaling = torch.zeros(len(self.modules), dtype=torch.float32, pin_memory=pin)
        rank = torch.zeros(len(self.modules), dtype=torch.int32, pin_memory=pin)
        views = self._split(flat)
        for i, name in enumerate(self.modules):
            if name in weights.modules:
                a, b, scale = weights.modules[name]
                r = a.shape[0]
                views[2 * i][:r].copy_(a)
                views[2 * i + 1][:r].copy_(b.t())
                scaling[i], rank[i] = scale, r
        return SlotImage(flat, scaling, rank)

    def read(self, slot: int) -> SlotImage:
        """A host copy of what slot `slot` holds (to keep an adapter that has no folder when evicted)."""
        self.wait_ready([slot])
        weights, scaling, rank = self._slot_views(slot)
        return SlotImage(torch.cat([v.reshape(-1) for v in weights]).cpu(), torch.cat(scaling).cpu(),
                         torch.cat(rank).cpu())

    def _split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """A flat image's per-module A `[r_max, K]` and B `[r_max, N]` views."""
        out, offset = [], 0
        for a_size, b_size in self._sizes:
            out.append(flat[offset:offset + a_size].view(self.r_max, -1))
            out.append(flat[offset + a_size:offset + a_size + b_size].view(self.r_max, -1))
            offset += a_size + b_size
        return out

    def _slot_views(self, slot: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """Slot `slot`'s destinations: every module's A and B storage, scaling and rank. Cached per
        slot, and rebuilt when a module's tensors were replaced (merged projections make the
        members' tensors views into the merged ones after the bank is built)."""
        tensors = tuple(t for m in self.modules.values() for t in (m.lora_a, m.lora_b, m.scaling, m.rank))
        if len(tensors) != len(self._tensors) or any(a is not b for a, b in zip(tensors, self._tensors)):
            self._views.clear()
            self._tensors = tensors
        if slot not in self._views:
            weights = [v for m in self.modules.values() for v in m.slot_views(slot)]
            scaling = [m.scaling[slot:slot + 1] for m in self.modules.values()]
            rank = [m.rank[slot:slot + 1] for m in self.modules.values()]
            self._views[slot] = (weights, scaling, rank)
        return self._views[slot]

    # ---- slot writes ----------------------------------------------------------------------------
    def write(self, slot: int, name: str, image: SlotImage) -> None:
        """Put adapter `name` (packed as `image`) into `slot`, in place. On the GPU: one host -> GPU
        copy into a staging buffer, then one batched scatter into the slot, on a side stream that
        starts after the work already queued (which may still read the old contents). The compute
        stream does not wait for it here: `wait_ready` before the first step that reads the slot."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        self._release_name(slot)
        weights, scaling, rank = self._slot_views(slot)
        if self._stream is None:
            self._scatter(weights, scaling, rank, image)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                if self._staging is None:
                    self._staging = SlotImage(torch.empty_like(image.weights, device=self.device),
                                              torch.empty_like(image.scaling, device=self.device),
                                              torch.empty_like(image.rank, device=self.device))
                for dst, src in zip((self._staging.weights, self._staging.scaling, self._staging.rank),
                                    (image.weights, image.scaling, image.rank)):
                    dst.copy_(src, non_blocking=True)
                self._scatter(weights, scaling, rank, self._staging)
                self._pending[slot] = self._stream.record_event()
        host_rank = image.rank.tolist()
        for m, r in zip(self.modules.values(), host_rank):
            m.set_host_rank(slot, r)
        self.names[slot] = name
        self.slot_of[name] = slot

    def wait_ready(self, slots) -> None:
        """Make the compute stream wait for pending writes of these slots (no host sync)."""
        for slot in slots:
            event = self._pending.pop(slot, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def _scatter(self, weights, scaling, rank, image: SlotImage) -> None:
        torch._foreach_copy_(weights, self._split(image.weights))
        torch._foreach_copy_(scaling, list(image.scaling.view(-1, 1).unbind(0)))
        torch._foreach_copy_(rank, list(image.rank.view(-1, 1).unbind(0)))

    def clear(self, slot: int) -> None:
        """Empty a slot: zero weights (unmasked kernels rely on zeros past each rank) and rank 0."""
        empty = getattr(self, "_empty_image", None)
        if empty is None:
            empty = self._empty_image = self.pack(AdapterWeights(), pin=False)
        self.write(slot, "", empty)
        self._release_name(slot)

    def _release_name(self, slot: int) -> None:
        old = self.names[slot]
        if old is not None:
            self.slot_of.pop(old, None)
        self.names[slot] = None

    def free_slots(self) -> list[int]:
        return [s for s, n in enumerate(self.names) if n is None]

    def slots_for(self, adapter_ids, device: torch.device | None = None) -> torch.Tensor:
        """Resident adapter names (None: backbone) -> `[B]` int32 slot tensor; others raise KeyError."""
        slots = []
        for i, a in enumerate(adapter_ids):
            if a is None:
                slots.append(NO_ADAPTER)
            elif a in self.slot_of:
                slots.append(self.slot_of[a])
            else:
                raise KeyError(f"adapter {a!r} at row {i} is not in a GPU slot; resident: "
                               f"{[n for n in self.names if n]}")
        return torch.tensor(slots, dtype=torch.int32, device=device)
