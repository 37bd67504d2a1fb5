"""The paged KV pool's bookkeeping: fixed-size blocks, a free list, and a block table per request."""

from __future__ import annotations


class BlockPool:
    """`num_blocks` blocks of `block_size` token positions each.

    Args:
        num_blocks: blocks in the pool (every layer's keys and values use the same block ids).
        block_size: token positions per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out the lowest id first

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` in place so it holds `num_tokens` positions. False (table unchanged) if the
        pool has too few free blocks."""
        need = self.blocks_for(num_tokens) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            table.append(self._free.pop())
        return True

    def free(self, table: list[int]) -> None:
        """Return a request's blocks to the pool and empty its table."""
        self._free.extend(reversed(table))
        table.clear()
