"""Release-policy interface and the one-way per-row release state (StepTrim, paper 3.2).

A policy is called once per decode step, in the spirit of a `LogitsProcessor`, with the decode
step index d (a `[B]` tensor in the engine, where each request is at its own step), the final
hidden state of each row (before the LM head) from the forward that just ran, and the per-row
state. It returns which rows may keep their adapter for decode forward d.
Everything stays on the device: no host sync.

Built-in policies are `graph_safe`: `keep` is torch ops on its arguments and on the per-slot tensors
that `bind` puts in `self.bound`, and the step index may be a 0-d device tensor. The CUDA-graph
runner then captures the decision inside `generate()`'s decode-step graph, reading static copies of
`bound`. The engine calls the same `keep` for every policy (`runner/release.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache

import torch

from ..config import int_in_range

NEVER = "never"
# The longest fixed release length a request may name (int32 on the device; longer is "never" in
# practice).
MAX_RELEASE = 2**31 - 1
# A release step no generation reaches: "keep the adapter to the end".
NEVER_STEP = 2**62


def is_release_step(value) -> bool:
    """The release rule, in one place: a release step is an int in [0, MAX_RELEASE]."""
    return int_in_range(value, 0, MAX_RELEASE)


@dataclass
class ReleaseState:
    """Per-row adapter state of one `generate` call (all `[B]`, on the model's device).

    Attributes:
        slot: the row's adapter slot (-1: backbone row).
        active: whether the row still holds its adapter. Release is one-way.
        release_step: the decode step at which the row released (-1: not released).
        override_k: per-request fixed release length (NEVER_STEP: never), used where `use_override`.
        use_override: rows whose `release=` request overrides the policy.
    """

    slot: torch.Tensor
    active: torch.Tensor
    release_step: torch.Tensor
    override_k: torch.Tensor
    use_override: torch.Tensor

    @classmethod
    def create(cls, slot: torch.Tensor, overrides=None) -> "ReleaseState":
        """`overrides`: None, or one entry per row: None (policy), "never", or an int k >= 0."""
        B, device = slot.shape[0], slot.device
        override_k = torch.full((B,), NEVER_STEP, dtype=torch.long)
        use_override = torch.zeros(B, dtype=torch.bool)
        if overrides is not None:
            if len(overrides) != B:
                raise ValueError(f"release has {len(overrides)} entries but the batch has {B} rows")
            for i, o in enumerate(overrides):
                if o is None:
                    continue
                if o == NEVER:
                    use_override[i] = True
                elif is_release_step(o):
                    use_override[i], override_k[i] = True, o
                else:
                    raise ValueError(f"release[{i}] must be None, 'never' or an int in [0, {MAX_RELEASE}], got {o!r}")
        return cls(
            slot=slot,
            active=slot >= 0,
            release_step=torch.full((B,), -1, dtype=torch.long, device=device),
            override_k=override_k.to(device),
            use_override=use_override.to(device),
        )

    def clone(self) -> "ReleaseState":
        return ReleaseState(**{f.name: getattr(self, f.name).clone() for f in fields(self)})

    def copy_(self, other: "ReleaseState") -> "ReleaseState":
        """Overwrite this state's tensors in place with `other`'s (same batch size)."""
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))
        return self

    def advance(
        self, step: int | torch.Tensor, policy_keep: torch.Tensor | None, compiled: bool = False
    ) -> torch.Tensor:
        """Apply the decision for decode step `step` (int or 0-d device tensor); returns the step's
        row -> slot map `[B]`. `compiled`: through torch.compile, one fused kernel instead of about
        eight small ones (the model's `compile=True` decode step)."""
        advance = _compiled_advance() if compiled else _advance_rows
        return advance(step, policy_keep, self.override_k, self.use_override, self.active, self.release_step,
                       self.slot)


def _advance_rows(step, policy_keep, override_k, use_override, active, release_step, slot) -> torch.Tensor:
    """`ReleaseState.advance` on its tensors: updates `active` and `release_step` in place."""
    forced = step < override_k
    keep = forced if policy_keep is None else torch.where(use_override, forced, policy_keep)
    released = active & ~keep
    # torch.where, not masked_fill_: a tensor fill value is read on the host (a sync, and an
    # error inside graph capture).
    release_step.copy_(torch.where(released, step, release_step))
    active &= keep
    return torch.where(active, slot, -1)


@lru_cache(maxsize=None)
def _compiled_advance():
    # Dynamic shapes: one compile serves every batch bucket.
    return torch.compile(_advance_rows, dynamic=True)


class ReleasePolicy:
    """Base class. Subclasses implement `keep`; `bind` resolves adapter names to slots once per call.

    Attributes:
        bound: name -> per-slot tensor built by `bind` and read by `keep`.
        graph_safe: True when `keep` only runs torch ops on its arguments and `bound` (no host work,
            a tensor step index allowed): then it runs inside the captured decode graph. A subclass
            that does anything else leaves it False and is called eagerly before each replay.
    """

    graph_safe = False
    # Whether `keep` reads the hidden states: the graph runner copies them in only for such policies.
    reads_hidden = True

    def __init__(self):
        self.bound: dict[str, torch.Tensor] = {}

    def bind(self, adapter_names: list[str | None], num_slots: int, device: torch.device) -> None:
        """Called once per `generate`, and by the engine whenever the adapters in the slots change,
        with the adapter in each slot (None: a free slot); build per-slot tensors here. Adapters
        not in a slot are not in this batch."""

    def adapter_names(self) -> list[str]:
        """The adapters this policy has settings for (checked against the registered ones)."""
        return []

    def check_hidden_size(self, hidden_size: int) -> None:
        """Raise ValueError if the policy cannot read hidden states of this size (default: any)."""

    def keep(self, step: int | torch.Tensor, hidden: torch.Tensor, state: ReleaseState) -> torch.Tensor:
        """Rows `[B]` bool that keep their adapter for decode forward `step`.

        Args:
            step: decode forward index d (0 is the first forward after prefill): an int, a 0-d
                device tensor inside a captured graph, or a `[B]` tensor of each row's own index
                (the engine's requests are at different steps). Write `keep` so it broadcasts.
            hidden: `[B, H]` final hidden state (before the LM head) of the forward that just ran.
            state: the per-row `ReleaseState` (read-only here).
        """
        raise NotImplementedError


def check_policy(policy, hidden_size: int, registered: list[str]) -> None:
    """Raise a clear error when `policy` is not a release policy this model can run: not a policy,
    settings for adapters that are not registered, or heads for another hidden size."""
    if not isinstance(policy, ReleasePolicy):
        raise TypeError(f"release_policy must be a ReleasePolicy such as ProfiledRelease({{name: k}}) or "
                        f"LearnedRelease(...), got {type(policy).__name__}")
    unknown = sorted(set(policy.adapter_names()) - set(registered))
    if unknown:
        raise KeyError(f"{type(policy).__name__} has settings for unknown adapters {unknown}; registered: {registered}")
    policy.check_hidden_size(hidden_size)

