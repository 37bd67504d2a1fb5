"""LearnedRelease: a linear risk head per adapter on the final hidden state (paper 3.2.2).

s = w_a . h + b_a for each row's adapter a; the row releases when s < tau_a. All heads of a batch are
evaluated in one batched op: each row gathers its adapter's (w, b, tau) by slot.
"""

from __future__ import annotations

import math

import torch

from .base import ReleasePolicy, ReleaseState


def risk_scores(hidden: torch.Tensor, w: torch.Tensor, b: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`[B]` scores w[index[i]] . hidden[i] + b[index[i]]: every row's head in one gather + dot
    (`LearnedRelease` indexes its heads by slot, the engine by request)."""
    return (hidden.float() * w[index]).sum(-1) + b[index]


def _check_head(name, head) -> None:
    if not isinstance(head, (tuple, list)) or len(head) != 3:
        raise TypeError(f"the release head of adapter {name!r} must be (weight [H], bias, tau), got {head!r}")
    w, b, tau = head
    if not isinstance(w, torch.Tensor) or w.dim() != 1 or not w.is_floating_point():
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"the release head of adapter {name!r} needs a 1-D float weight [H], got {shape}")
    for label, value in (("bias", b), ("tau", tau)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
            raise ValueError(f"the release head of adapter {name!r} has {label}={value!r}: it must be a real number "
                             "(tau may be -inf: never release, or +inf: release after prefill)")
    if math.isinf(b):
        raise ValueError(f"the release head of adapter {name!r} has bias={b!r}: it must be finite")


class LearnedRelease(ReleasePolicy):
    """Release a row once its adapter's risk score falls below the adapter's threshold.

    Args:
        heads: adapter name -> (weight `[H]`, bias float, tau float). Adapters without a head never
            release. tau = -inf never releases; tau = +inf releases right after prefill.
    """

    kind = "learned"
    graph_safe = True

    def __init__(self, heads: dict[str, tuple[torch.Tensor, float, float]]):
        super().__init__()
        if not isinstance(heads, dict):
            raise TypeError(f"heads must be a dict adapter name -> (weight, bias, tau), got {type(heads).__name__}")
        for name, head in heads.items():
            _check_head(name, head)
        self.heads = dict(heads)

    def check_hidden_size(self, hidden_size: int) -> None:
        for name, (w, _, _) in self.heads.items():
            if w.shape[0] != hidden_size:
                raise ValueError(f"the release head of adapter {name!r} has weight size {w.shape[0]} but the model's "
                                 f"hidden size is {hidden_size}: it was trained for another model")

    def adapter_names(self) -> list[str]:
        return list(self.heads)

    def bind(self, adapter_names, num_slots, device) -> None:
        sizes = {tuple(w.shape) for w, _, _ in self.heads.values()}
        if len(sizes) > 1:
            raise ValueError(f"all heads must have the same hidden size, got shapes {sorted(sizes)}")
        hidden = sizes.pop()[0] if sizes else 1
        # Row L (slot -1, backbone rows) and adapters without heads: w = 0, b = 0, tau = -inf (keep).
        w = torch.zeros(num_slots + 1, hidden, dtype=torch.float32)
        b = torch.zeros(num_slots + 1, dtype=torch.float32)
        tau = torch.full((num_slots + 1,), float("-inf"), dtype=torch.float32)
        for slot, name in enumerate(adapter_names):
            if name in self.heads:
                hw, hb, ht = self.heads[name]
                w[slot], b[slot], tau[slot] = hw.float(), float(hb), float(ht)
        self.bound = {"w": w.to(device), "b": b.to(device), "tau": tau.to(device)}

    def scores(self, hidden: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """`[B]` risk scores w_a . h + b_a, one batched gather + dot for all rows."""
        return risk_scores(hidden, self.bound["w"], self.bound["b"], slot.long())

    def keep(self, step, hidden: torch.Tensor, state: ReleaseState) -> torch.Tensor:
        return self.scores(hidden, state.slot) >= self.bound["tau"][state.slot.long()]
