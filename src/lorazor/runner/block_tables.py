"""The running requests' block tables: the device state each step's attention reads, kept on the
host and uploaded only when a row changed. Which request has which row is the engine's (its
`TableRows`); a step hands over only the cells that changed."""

from __future__ import annotations

import numpy as np
import torch

from .uploads import upload_into


class BlockTables:
    """Block tables of the running requests: a host copy and a device copy `[rows + 1, width]`
    (the last row: the scratch block only, for graph padding rows)."""

    def __init__(self, max_rows: int, width: int, scratch_block: int, device):
        self.host = np.full((max_rows + 1, width), scratch_block, dtype=np.int32)
        self.device = torch.from_numpy(self.host).to(device)
        self.scratch_row = max_rows
        self._dirty = False

    def write(self, writes) -> None:
        """Write `(row, first block index, blocks)` cells into the host copy (uploaded by `upload`).
        A row's stale cells past its blocks stay: only a request's own blocks are read."""
        for row, start, blocks in writes:
            self.host[row, start:start + len(blocks)] = blocks
            self._dirty = True

    def upload(self) -> torch.Tensor:
        if self._dirty:
            upload_into(self.device, self.host)
            self._dirty = False
        return self.device
