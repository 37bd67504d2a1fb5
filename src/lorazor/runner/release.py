"""StepTrim on the device, the same way for `generate()` and the engine.

Both paths take a decode forward's release decision with `decide_release(policy, step, hidden,
state)`: the policy's `keep` on the final hidden state of the forward before, applied one-way to a
`ReleaseState`, giving the forward's row -> slot map. `generate()` decides before each decode step
(inside the step's CUDA graph when the policy is `graph_safe`). The engine decides, at the end of the
step that ran forward d - 1, for forward d of every request that still holds its adapter
(`decide_group`, one call per policy), and reads the decisions back with the step's tokens (its one host sync).
Requests then differ in their decode index, so `step` is a `[B]` tensor there.

Both count decode forwards with `decode_counts`.
"""

from __future__ import annotations

import weakref

import torch

from ..policies.base import NEVER, NEVER_STEP, ReleasePolicy, ReleaseState
from .uploads import to_device


def decide_release(policy: ReleasePolicy | None, step: int | torch.Tensor, hidden: torch.Tensor | None,
                   state: ReleaseState, compiled: bool = False) -> torch.Tensor:
    """One StepTrim decision: ask the policy (if any), apply it one-way; returns the row -> slot map.

    `step`: the decode forward index d (an int, a 0-d device tensor inside a graph, or `[B]` per row).
    `compiled`: apply it through torch.compile (see `ReleaseState.advance`)."""
    keep = policy.keep(step, hidden, state) if policy is not None else None
    return state.advance(step, keep, compiled)


def decode_counts(generated, release_step, has_adapter):
    """(decode forwards, of those the ones run with the adapter) for `generated` tokens: every token
    after the first needs a decode forward, and an adapter row used its adapter in forwards before
    its release step (-1: never released). Ints for one request, or `[B]` tensors for a batch."""
    if isinstance(generated, torch.Tensor):
        decode = (generated - 1).clamp(min=0) * has_adapter
        return decode, torch.where(release_step < 0, decode, torch.minimum(release_step, decode))
    decode = max(generated - 1, 0) if has_adapter else 0
    return decode, decode if release_step < 0 else min(release_step, decode)


class BoundPolicies:
    """Keeps each policy the engine uses bound to the bank's current slots (`ReleasePolicy.bind`
    again whenever the adapters in the slots changed, or someone else, such as a `generate()` call,
    bound the policy since)."""

    def __init__(self, bank, device):
        self.bank = bank
        self.device = device
        # policy -> (the slot names it was bound to, the `bound` dict that bind made); weak, so a
        # policy that is gone leaves no entry another object could be mistaken for.
        self._bound = weakref.WeakKeyDictionary()

    def bound(self, policy: ReleasePolicy) -> ReleasePolicy:
        names = tuple(self.bank.names)
        seen = self._bound.get(policy)
        if seen is None or seen[0] != names or seen[1] is not policy.bound:
            policy.bind(list(names), self.bank.num_slots, self.device)
            self._bound[policy] = (names, policy.bound)
        return policy


def decide_group(policy: ReleasePolicy | None, rows: list[tuple], hidden: torch.Tensor,
                 bound: BoundPolicies) -> torch.Tensor:
    """The engine's decisions, on the device, for the next decode forward of requests that share
    one policy.

    Args:
        policy: their policy (None: their own fixed lengths only).
        rows: per request (row of `hidden`, its slot, its decode index d, its override: None,
            "never" or k).
        hidden: `[n, H]` final hidden states of this step's rows (each request's forward d - 1).
        bound: the engine's `BoundPolicies`.

    Returns `[len(rows)]` long, 1 where the request keeps its adapter for forward d (no host sync).
    """
    index, slots, steps, overrides = zip(*rows)
    # One upload: slot, decode index, fixed length (NEVER_STEP: never), overridden, hidden row.
    slot, step, override_k, use_override, index = to_device(
        [slots, steps, [NEVER_STEP if o in (None, NEVER) else o for o in overrides],
         [o is not None for o in overrides], index], hidden.device)
    state = ReleaseState(slot=slot.int(), active=slot >= 0, release_step=torch.full_like(step, -1),
                         override_k=override_k, use_override=use_override.bool())
    if policy is not None:
        bound.bound(policy)
    return (decide_release(policy, step, hidden.index_select(0, index), state) >= 0).long()
