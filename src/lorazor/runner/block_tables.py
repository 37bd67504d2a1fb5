"""The running requests' block tables: the device state each step's attention reads, kept on the
host and uploaded only when a row changed."""

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
        self._free = list(range(max_rows - 1, -1, -1))
        self._dirty = False

    def row_of(self, request) -> int:
        """The request's row, brought up to date with its block table (assigned on first use)."""
        if request.table_row is None:
            request.table_row = self._free.pop()
            request.table_synced = 0
        table = request.block_table
        if request.table_synced != len(table):
            self.host[request.table_row, request.table_synced:len(table)] = table[request.table_synced:]
            request.table_synced = len(table)
            self._dirty = True
        return request.table_row

    def release(self, request) -> None:
        """Free the request's row. Its stale contents stay: only rows of scheduled requests are
        read, and a row is rewritten from block 0 when it is assigned again."""
        if request.table_row is not None:
            self._free.append(request.table_row)
            request.table_row = None

    def upload(self) -> torch.Tensor:
        if self._dirty:
            upload_into(self.device, self.host)
            self._dirty = False
        return self.device
