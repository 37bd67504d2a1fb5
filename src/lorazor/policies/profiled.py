"""ProfiledRelease: a fixed release length k per adapter (paper 3.2.1)."""

from __future__ import annotations

import torch

from .base import MAX_RELEASE, NEVER_STEP, ReleasePolicy, ReleaseState, is_release_step


class ProfiledRelease(ReleasePolicy):
    """Keep the adapter for prefill and the first k decode forwards, then release it for good.

    Args:
        lengths: adapter name -> k (0: prefill only; None: never release). Adapters not listed never
            release.

    Example:
        `ProfiledRelease({"math": 3, "sql": 0})`: math rows use LoRA in prefill and decode forwards
        0, 1, 2; sql rows only in prefill.
    """

    kind = "profiled"
    graph_safe = True
    reads_hidden = False

    def __init__(self, lengths: dict[str, int | None]):
        super().__init__()
        if not isinstance(lengths, dict):
            raise TypeError(
                f"lengths must be a dict adapter name -> k (e.g. {{'math': 8}}), got {type(lengths).__name__}"
            )
        for name, k in lengths.items():
            if k is not None and not is_release_step(k):
                raise ValueError(f"release length for adapter {name!r} must be None or an int in [0, {MAX_RELEASE}], "
                                 f"got {k!r}")
        self.lengths = dict(lengths)

    def adapter_names(self) -> list[str]:
        return list(self.lengths)

    def bind(self, adapter_names, num_slots, device) -> None:
        k = torch.full((num_slots + 1,), NEVER_STEP, dtype=torch.long)
        for slot, name in enumerate(adapter_names):
            if self.lengths.get(name) is not None:
                k[slot] = self.lengths[name]
        self.bound = {"k": k.to(device)}

    def keep(self, step, hidden: torch.Tensor, state: ReleaseState) -> torch.Tensor:
        # slot -1 (backbone rows) reads the last entry, which never releases (they hold nothing).
        return step < self.bound["k"][state.slot.long()]
