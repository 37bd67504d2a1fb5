"""AdapterBank: the GPU slots. Stacked LoRA weights per target module, and which adapter holds each slot.

For each target linear module the bank holds PEFT's layouts stacked over slots:
    lora_a [L, r_max, K]   (lora_A.weight of each adapter, zero past its rank)
    lora_b [L, N, r_max]   (lora_B.weight)
    scaling [L]            (alpha / r, or alpha / sqrt(r) with rsLoRA: PEFT's own value)
    rank [L] int32         (0 where the adapter does not target this module: no delta there)
Modules are named as in the Hugging Face model (`model.layers.0.self_attn.q_proj`).

Every module's weights are views into one `[L, slot_numel]` storage, so one slot is one contiguous
row: an adapter packed in that row's layout on the host (a `SlotImage`) goes into its slot in one
copy (plus one for the scalings and one for the ranks), not one per module. The row holds, per
group of modules that share an input and run merged (`lorazor.lora.merged`: q/k/v, gate/up), the
group's A as one `[G * r_max, K]` block and its B as one `[r_max, sum N]` block, so the merged
tensors are views of the storage too (`lay_out`); a module outside a group is a group of one. The
experts of one MoE projection are a stacked block, always (`stacks`: `lora/experts.py` reads them
as `[L, E, r, K]` / `[L, E, N, r]` through `stack`), with each expert's B `[r_max, N]` contiguous. Slots
are written in place, so captured CUDA graphs stay valid; on the GPU the copy runs on a side
stream that the compute stream waits for.
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
    # Slots whose rank is between 0 and r_max, counted as ranks change (a load sets every module's
    # rank: a scan of every slot per module made it ~0.5 ms of host time per load).
    _partial: int = field(default=0, init=False, repr=False)

    def __post_init__(self):
        self.recount()

    def _is_partial(self, rank: int) -> bool:
        return 0 < rank < self.lora_a.shape[1]

    def recount(self) -> None:
        """Count the partial-rank slots again (after `lora_a` changed shape)."""
        self._partial = sum(map(self._is_partial, self.host_rank))
        self._mask_rank = self._partial > 0

    def set_host_rank(self, slot: int, rank: int) -> None:
        self._partial += self._is_partial(rank) - self._is_partial(self.host_rank[slot])
        self.host_rank[slot] = rank
        self._mask_rank = self._partial > 0

    @property
    def mask_rank(self) -> bool:
        """True when some slot's rank is between 0 and the bank's r_max: the kernels then read each
        slot's rank and load only that many rows. Otherwise weights past a slot's rank are zero
        (rank-0 slots: all zero) and the kernels skip the rank load."""
        return self._mask_rank


@dataclass
class SlotImage:
    """One adapter packed in the bank's slot layout, on the host (pinned when a GPU is used).

    Attributes:
        weights: one storage row of the bank (`AdapterBank.lay_out`), zero past each rank.
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
        sizes: module name -> (in_features K, out_features N), in the model's order.
        num_slots: L, the number of slots.
        r_max: the largest rank a slot holds.
        dtype: of the weights.
        device: where the slots live.
        stacks: groups of modules (same sizes) laid out as one stacked block: an MoE projection's
            experts, in expert order.
    """

    def __init__(self, sizes: dict[str, tuple[int, int]], num_slots: int, r_max: int, dtype: torch.dtype,
                 device: torch.device, stacks: tuple[tuple[str, ...], ...] | list = ()):
        if not sizes:
            raise AdapterError("no LoRA target modules: nothing for adapters to apply to")
        self.num_slots, self.r_max, self.dtype, self.device = num_slots, r_max, dtype, torch.device(device)
        self._sizes = dict(sizes)
        none = torch.empty(0, 0, 0, device=self.device)  # every module's tensors come from lay_out
        self.modules = {name: ModuleLoRA(none, none, none, none, [0] * num_slots) for name in sizes}
        self.names: list[str | None] = [None] * num_slots
        self.slot_of: dict[str, int] = {}
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pending: dict[int, torch.cuda.Event] = {}  # slot -> end of its last write
        self._stacks = [tuple(group) for group in stacks]
        self.stacked = {name for group in self._stacks for name in group}  # modules of stacks, not layers
        self._stack_views: dict[str, tuple] = {}  # a stack's first module name -> its views
        self.lay_out([])

    @classmethod
    def empty(cls, layers: dict[str, nn.Linear], num_slots: int, r_max: int,
              dtype: torch.dtype | None = None, experts: dict[str, nn.Module] | None = None) -> "AdapterBank":
        """Empty slots for these base linear layers (module name -> nn.Linear) and the experts of
        these MoE experts modules (name -> fused experts module, `lora/experts.py`), on their device."""
        from .experts import EXPERT_PROJECTIONS, expert_module_names, expert_sizes

        experts = experts or {}
        weights = [base.weight for base in layers.values()] + [m.gate_up_proj for m in experts.values()]
        if not weights:
            raise AdapterError("no LoRA target modules: nothing for adapters to apply to")
        sizes = {name: (base.in_features, base.out_features) for name, base in layers.items()}
        stacks = []
        for prefix, module in experts.items():
            sizes.update(expert_sizes(prefix, module))
            stacks += [expert_module_names(prefix, module.num_experts, p) for p in EXPERT_PROJECTIONS]
        return cls(sizes, num_slots, r_max, dtype or weights[0].dtype, weights[0].device, stacks=stacks)

    def lay_out(self, groups) -> dict[tuple[str, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(Re)allocate the storage with each group of module names (same K, run merged) adjacent:
        the group's A `[L, G * r_max, K]`, B `[L, sum N, r_max]` (a stack's: `[L, G, N, r_max]`) and
        scaling `[G, L]` are views of it, returned per group; every module's tensors become views
        inside them (the `ModuleLoRA` objects the layers hold are updated in place). Only while every
        slot is empty."""
        if any(self.names):
            raise RuntimeError("the bank's layout changes only while its slots are empty")
        groups = [*self._stacks, *groups]
        grouped = {name: tuple(group) for group in groups for name in group}
        blocks, placed = [], set()
        for name in self._sizes:
            if name not in placed:
                block = grouped.get(name, (name,))
                blocks.append(block)
                placed.update(block)
        order = [name for block in blocks for name in block]
        self.modules = {name: self.modules[name] for name in order}
        L, r = self.num_slots, self.r_max
        total = sum(len(b) * r * self._sizes[b[0]][0] + r * sum(self._sizes[n][1] for n in b) for b in blocks)
        self.storage = torch.zeros(L, total, dtype=self.dtype, device=self.device)
        self.scaling = torch.zeros(len(order), L, dtype=torch.float32, device=self.device)
        self.rank = torch.zeros(len(order), L, dtype=torch.int32, device=self.device)
        self._layout = []  # per module, in order: (A offset, K, B offset, N, B row length)
        views, offset, index = {}, 0, 0
        stacked = set(self._stacks)
        for block in blocks:
            K, widths = self._sizes[block[0]][0], [self._sizes[n][1] for n in block]
            if any(self._sizes[n][0] != K for n in block):
                raise ValueError(f"modules {block} differ in input size: they cannot share a merged block")
            a_block = self.storage[:, offset:offset + len(block) * r * K].view(L, len(block) * r, K)
            b_offset = offset + len(block) * r * K
            b_len = r * sum(widths)
            if block in stacked:
                # An MoE projection's experts: each expert's B `[r_max, N]` contiguous, as each token-expert
                # pair reads one expert's B whole (`expert_lora`); a merged group's B rows span its modules
                # instead, as its rows read every module's columns.
                n = widths[0]
                b_block = self.storage[:, b_offset:b_offset + b_len].view(L, len(block), r, n).transpose(2, 3)
                spans = [(b_offset + g * r * n, n) for g in range(len(block))]
            else:
                b_store = self.storage[:, b_offset:b_offset + b_len].view(L, r, sum(widths))
                b_block = b_store.transpose(1, 2)
                starts = [sum(widths[:g]) for g in range(len(block))]
                spans = [(b_offset + lo, sum(widths)) for lo in starts]
            for g, (name, n, (b_start, row)) in enumerate(zip(block, widths, spans)):
                module = self.modules[name]
                module.lora_a = a_block[:, g * r:(g + 1) * r]
                module.lora_b = self.storage.as_strided((L, n, r), (self.storage.stride(0), 1, row), b_start)
                module.scaling, module.rank = self.scaling[index], self.rank[index]
                module.recount()
                self._layout.append((offset + g * r * K, K, b_start, n, row))
                index += 1
            views[block] = (a_block, b_block, self.scaling[index - len(block):index])
            offset = b_offset + b_len
        self._stack_views = {}
        for block in self._stacks:
            a_block, b_block, scaling = views[block]
            self._stack_views[block[0]] = (a_block.unflatten(1, (len(block), r)), b_block, scaling)
        return views

    def stack(self, first: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The views of the stacked group (`stacks`) whose first module is `first`: A `[L, G, r_max, K]`,
        B `[L, G, N, r_max]`, scaling `[G, L]`."""
        return self._stack_views[first]

    @property
    def module_sizes(self) -> dict[str, tuple[int, int]]:
        """Module name -> (in_features, out_features)."""
        return {name: self._sizes[name] for name in self.modules}

    # ---- images ---------------------------------------------------------------------------------
    def pack(self, weights: AdapterWeights, pin: bool | None = None) -> SlotImage:
        """`weights` in this bank's slot layout (host memory; pinned on a GPU machine by default)."""
        pin = self.device.type == "cuda" if pin is None else pin
        flat = torch.zeros(self.storage.shape[1], dtype=self.dtype, pin_memory=pin)
        dst, src = self.copies(flat, weights)
        if dst:
            torch._foreach_copy_(dst, src)  # one call: a host thread's many calls each wait for the GIL
        # Scalings and ranks in two writes each, not one per module (each torch call waits for the GIL).
        index = [i for i, name in enumerate(self.modules) if name in weights.modules]
        targeted = [weights.modules[name] for name in self.modules if name in weights.modules]
        scaling = torch.zeros(len(self.modules), dtype=torch.float32, pin_memory=pin)
        rank = torch.zeros(len(self.modules), dtype=torch.int32, pin_memory=pin)
        if index:
            scaling[index] = torch.tensor([scale for _, _, scale in targeted], dtype=torch.float32)
            rank[index] = torch.tensor([a.shape[0] for a, _, _ in targeted], dtype=torch.int32)
        return SlotImage(flat, scaling, rank)

    def copies(self, flat: torch.Tensor, weights: AdapterWeights) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(destinations, sources): views of the slot row `flat` and `weights`' A and B^T that
        `torch._foreach_copy_(destinations, sources)` copies into the slot layout."""
        dst, src = [], []
        for name, (a_offset, k, b_offset, n, row) in zip(self.modules, self._layout):
            if name in weights.modules:
                a, b, _ = weights.modules[name]
                r = a.shape[0]
                dst += [flat[a_offset:a_offset + r * k].view(r, k), flat.as_strided((r, n), (row, 1), b_offset)]
                src += [a, b.t()]
        return dst, src

    def read(self, slot: int) -> SlotImage:
        """A host copy of what slot `slot` holds (to keep an adapter that has no folder when evicted)."""
        self.wait_ready([slot])
        # A copy even on the CPU (where `.cpu()` would return the slot's row itself, overwritten next).
        return SlotImage(*(t.to("cpu", copy=True) for t in (self.storage[slot], self.scaling[:, slot],
                                                            self.rank[:, slot])))

    # ---- slot writes ----------------------------------------------------------------------------
    def write(self, slot: int, name: str, image: SlotImage) -> None:
        """Put adapter `name` (packed as `image`) into `slot`, in place: one copy of the weights into
        the slot's storage row, one each for the scalings and ranks. On the GPU they run on a side
        stream that starts after the work already queued (which may still read the old contents);
        the compute stream does not wait for them here: `wait_ready` before the first step that reads
        the slot."""
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"slot {slot} out of range [0, {self.num_slots})")
        self._release_name(slot)
        copies = ((self.storage[slot], image.weights), (self.scaling[:, slot], image.scaling),
                  (self.rank[:, slot], image.rank))
        if self._stream is None:
            for dst, src in copies:
                dst.copy_(src)
        else:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                for dst, src in copies:
                    dst.copy_(src, non_blocking=True)
                self._pending[slot] = self._stream.record_event()
        for m, r in zip(self.modules.values(), image.rank.tolist()):
            m.set_host_rank(slot, r)
        self.names[slot] = name
        self.slot_of[name] = slot

    def wait_ready(self, slots) -> None:
        """Make the compute stream wait for pending writes of these slots (no host sync)."""
        for slot in slots:
            event = self._pending.pop(slot, None)
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)

    def clear(self, slot: int) -> None:
        """Empty a slot: zero weights (unmasked kernels rely on zeros past each rank) and rank 0."""
        empty = getattr(self, "_empty_image", None)
        if empty is None or empty.weights.shape[0] != self.storage.shape[1]:
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
