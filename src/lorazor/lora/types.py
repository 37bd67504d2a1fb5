"""The types every adapters module shares: its error and one adapter's weights on the host."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class AdapterError(ValueError):
    """An adapter LoRazor cannot serve as asked; the message names the adapter and the reason."""


@dataclass
class AdapterWeights:
    """One adapter's weights per bank module, on the host: (A `[r, K]`, B `[N, r]`, scale)."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b, _ in self.modules.values())

    def pinned(self) -> "AdapterWeights":
        """A copy in page-locked memory, so host -> GPU copies run asynchronously."""
        return AdapterWeights({m: (a.pin_memory(), b.pin_memory(), s) for m, (a, b, s) in self.modules.items()})
