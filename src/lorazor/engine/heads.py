"""The learned StepTrim heads of the engine's requests, as one device table.

A request under a `LearnedRelease` policy keeps its adapter while w_a . h + b_a >= tau_a on the
final hidden state of its previous forward. The engine evaluates every such row of a step in one
batched gather + dot (`keep`), as `LearnedRelease.keep` does for a static batch.
"""

from __future__ import annotations

import torch

from ..policies.learned import risk_scores


class HeadTable:
    """Rows of (w `[H]`, b, tau), one per adapter whose head a request has used.

    Args:
        hidden_size: H.
        device: where the table lives.
    """

    def __init__(self, hidden_size: int, device):
        self.hidden_size = hidden_size
        self.device = device
        self.rows: dict[str, int] = {}
        self._heads: dict[str, tuple] = {}
        self.w = torch.zeros(0, hidden_size, dtype=torch.float32, device=device)
        self.b = torch.zeros(0, dtype=torch.float32, device=device)
        self.tau = torch.zeros(0, dtype=torch.float32, device=device)

    def row_of(self, adapter: str, head: tuple[torch.Tensor, float, float]) -> int:
        """The row of `adapter`'s head (added, or rewritten when the policy's head changed)."""
        w, b, tau = head
        row = self.rows.get(adapter)
        if row is None:
            row = self.rows[adapter] = len(self.rows)
            grow = lambda t, fill: torch.cat([t, t.new_full((1, *t.shape[1:]), fill)])  # noqa: E731
            self.w, self.b, self.tau = grow(self.w, 0.0), grow(self.b, 0.0), grow(self.tau, 0.0)
        if self._heads.get(adapter) is not head:
            self.w[row] = w.float().to(self.device)
            self.b[row] = float(b)
            self.tau[row] = float(tau)
            self._heads[adapter] = head
        return row

    def keep(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """`[n]` bool: whether each hidden state `[n, H]` keeps its adapter under head `rows[i]`."""
        index = torch.tensor(rows, device=hidden.device)
        return risk_scores(hidden, self.w, self.b, index) >= self.tau[index]
