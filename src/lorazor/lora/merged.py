"""Merged projections: q/k/v (and gate/up) as one base GEMM plus one LoRA shrink and one expand.

HF calls q_proj, k_proj and v_proj one after another on the same hidden states. With
`LoRazorConfig(merge_projections=True)`, the group's first member computes the merged output
`[..., N_q + N_k + N_v]` (one GEMM over the concatenated weights, one shrink over the stacked A,
one segmented expand) and returns its slice; the other members return their slices of it when they
are called on the same input tensor. That is 4 base GEMMs and 8 LoRA launches per decoder layer
instead of 7 and 14.

Nothing is copied: the members' weights and biases become views into the merged tensors, and the
adapter bank lays each group's slots out as one block whose views both the members and the merged
op read, so `add_adapter` keeps writing where the merged op reads. A member called on another
input, or a bank whose ranks became mixed, takes its own per-module path (still correct).
"""

from __future__ import annotations

import torch
from lorazor_kernels.fp8 import SCALE_BLOCK, block_scaled
from torch import nn

from .layers import BatchedLoRALinear, linear_step_lora

# Modules that read the same input in the supported architectures (llama, mistral, qwen2).
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# The segmented expand needs segment edges on multiples of this.
EDGE_MULTIPLE = 16


class MergedGroup:
    """One group of `BatchedLoRALinear` members sharing an input. Build with `merge_projections`."""

    def __init__(self, members: list, context, adapter_views):
        self.members = members
        self.context = context
        bases = [m.base_layer for m in members]
        widths = [b.out_features for b in bases]
        self.edges = tuple(int(e) for e in torch.tensor(widths).cumsum(0).tolist())
        self.spans = list(zip((0, *self.edges[:-1]), self.edges))
        # Base weights and biases: one tensor, the members' parameters become views of it.
        self.weight = torch.cat([b.weight.data for b in bases])
        self.bias = None
        if any(b.bias is not None for b in bases):
            self.bias = torch.cat([b.bias.data if b.bias is not None else self.weight.new_zeros(w)
                                   for b, w in zip(bases, widths)])
        # fp8 bases (`lorazor.quant`): their scales (per channel, or rows of 128x128 blocks), concatenated.
        scales = [getattr(b, "weight_scale", None) for b in bases]
        self.weight_scale = None if scales[0] is None else torch.cat([s.data for s in scales])
        for base, (lo, hi) in zip(bases, self.spans):
            base.weight.data = self.weight[lo:hi]
            if base.bias is not None:
                base.bias.data = self.bias[lo:hi]
            if self.weight_scale is not None and block_scaled(self.weight_scale):  # block rows (`_can_merge`)
                base.weight_scale.data = self.weight_scale[lo // SCALE_BLOCK: -(-hi // SCALE_BLOCK)]
            elif self.weight_scale is not None:
                base.weight_scale.data = self.weight_scale[lo:hi]
        # Adapters: A stacked [L, G*r, K], B [L, sum N, r], scaling [G, L]: the bank's views of the
        # group's blocks (`AdapterBank.lay_out`), inside which the members' own tensors lie.
        self.lora_a, self.lora_b, self.scaling = adapter_views
        self.rank = members[0].lora.rank
        self._input: torch.Tensor | None = None
        self._output: torch.Tensor | None = None
        self.ran_merged = False  # set once the merged computation has served the members
        for g, member in enumerate(members):
            member.merged = (self, g)

    def forward(self, x: torch.Tensor, index: int) -> torch.Tensor | None:
        """Member `index`'s output from the merged computation, or None to take the per-module path."""
        if index > 0:
            if self._input is not x:
                return None
            lo, hi = self.spans[index]
            out = self._output[..., lo:hi]
            if index == len(self.members) - 1:
                # Every member has its slice: drop the references, so the merged buffers live no
                # longer than the slices (held past a graph capture, they would pin ~14 MB per
                # layer at batch 256 in the graph pool, and as much between eager steps).
                self._input = self._output = None
            return out
        if any(m.lora.mask_rank for m in self.members):
            self._input = self._output = None
            return None
        y = linear_step_lora(x, self.weight, self.bias, self.context, self.lora_a, self.lora_b, self.scaling,
                             self.rank, mask_rank=False, segments=self.edges[:-1], weight_scale=self.weight_scale)
        # Holding x keeps its identity unique until the last member has read its slice.
        self._input, self._output = x, y
        self.ran_merged = True
        return y[..., : self.edges[0]]


def _can_merge(members) -> str | None:
    """Why these members cannot be merged, or None."""
    if not all(isinstance(m, BatchedLoRALinear) for m in members):
        return "not every member has adapters"
    first = members[0]
    for m in members:
        if m.in_features != first.in_features or m.lora.lora_a.shape[1] != first.lora.lora_a.shape[1]:
            return "members differ in input size or rank"
        if m.base_layer.weight.dtype != first.base_layer.weight.dtype:
            return "members differ in dtype"
        if _scale_kind(m) != _scale_kind(first):
            return "members differ in quantization"
        if m.lora.lora_a.shape[0] != first.lora.lora_a.shape[0]:
            return "members differ in slots"
    if any(m.out_features % EDGE_MULTIPLE for m in members[:-1]):
        return f"output sizes are not multiples of {EDGE_MULTIPLE}"
    if _scale_kind(first) == "blocks" and any(m.out_features % SCALE_BLOCK for m in members[:-1]):
        return f"block-scaled output sizes are not multiples of {SCALE_BLOCK}"  # the scale rows would not line up
    return None


def _scale_kind(member) -> str | None:
    """None (not fp8), "channels" or "blocks" (an fp8 checkpoint's 128x128 block scales)."""
    scale = getattr(member.base_layer, "weight_scale", None)
    return None if scale is None else ("blocks" if block_scaled(scale) else "channels")


def merge_projections(root: nn.Module, context, bank) -> list[MergedGroup]:
    """Merge every group of `GROUPS` found under `root` whose members can be merged (the bank lays
    each group's adapter weights out as one block, while its slots are empty); returns the groups."""
    name_of = {id(lora): name for name, lora in bank.modules.items()}
    found = []
    for parent in root.modules():
        for names in GROUPS:
            members = [getattr(parent, n, None) for n in names]
            if any(m is None for m in members) or _can_merge(members) is not None:
                continue
            found.append((members, tuple(name_of[id(m.lora)] for m in members)))
    views = bank.lay_out([names for _, names in found])
    return [MergedGroup(members, context, views[names]) for members, names in found]
