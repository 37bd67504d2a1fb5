"""The paged KV pool's bookkeeping: fixed-size blocks, reference counts, and the prefix cache.

The prefix cache's rule (what a block's identity is): a full block is reusable only by a request
whose tokens up to and including the block are the same AND whose KV for them would be computed by
the same weights. A block's hash is therefore
    sha256(hash of the block before | identity | the block's token ids)
where the identity is the backbone (`BACKBONE`) or one adapter by name plus a digest of its weights
and config (`adapter_identity`): re-registering a name with other weights never reuses the old
blocks. A request's `cache_salt` is mixed into its identity (`salted`): different salts never share
a block. StepTrim's released tokens were computed by the backbone inside an adapter's sequence: a
block holding any of them is never cached (its KV is what no later prompt would compute), so a
request's chain of cacheable blocks ends where its release begins.

Blocks are counted by reference: a running request holds its blocks; blocks shared by several
requests are read, never written (a request writes only past its cached prefix). A block nobody
holds goes back to the free list but keeps its hash, so a later request can take it back as a
cache hit; allocation takes free blocks least recently freed first, evicting their hashes. The free
count therefore includes the cached blocks that can be evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

# The identity of KV computed by the backbone alone.
BACKBONE = b"backbone"


def adapter_identity(name: str, digest: bytes) -> bytes:
    """The identity of KV computed with adapter `name` whose weights and config hash to `digest`."""
    return b"lora\0" + name.encode() + b"\0" + digest


# The longest cache salt accepted (vLLM takes any string; a bound keeps a hash input small).
MAX_CACHE_SALT_CHARS = 1024


def check_cache_salt(salt):
    """`salt` if it is None or a non-empty string of at most `MAX_CACHE_SALT_CHARS` characters."""
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise ValueError(f"cache_salt must be None or a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                         f"characters, got {salt if not isinstance(salt, str) else repr(salt[:40])!r}")
    return salt


def salted(identity: bytes, salt: str | None) -> bytes:
    """`identity` with a request's cache salt mixed in (None: unchanged, so unsalted requests keep
    sharing blocks)."""
    if salt is None:
        return identity
    return identity + b"\0salt\0" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()


def block_hashes(hashes: list[bytes], tokens: list[int], block_size: int, identity: bytes, upto: int) -> list[bytes]:
    """Extend `hashes` (the chain of a sequence's first full blocks) in place to `upto` blocks of
    `tokens`; returns it."""
    for i in range(len(hashes), upto):
        parent = hashes[-1] if hashes else b""
        chunk = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        hashes.append(hashlib.sha256(parent + identity + chunk).digest())
    return hashes


class BlockPool:
    """`num_blocks` blocks of `block_size` token positions each, with prefix caching.

    Args:
        num_blocks: blocks in the pool (every layer's keys and values use the same block ids).
        block_size: token positions per block.
        enable_caching: keep freed full blocks by hash for later requests (`lookup`, `cache`).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.refs = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        # Blocks nobody holds, the next to hand out first (lowest id first at the start).
        self._free: OrderedDict[int, None] = OrderedDict((block, None) for block in range(num_blocks))
        # Prompt tokens looked up and found in the cache at admission (vLLM's counters).
        self.queries = 0
        self.hits = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now: unused ones and cached ones nobody holds."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` (a chain from the first block)."""
        if not self.enable_caching:
            return []
        found = []
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def allocate(self, table: list[int], hits: list[int], num_tokens: int) -> bool:
        """Extend `table` in place with the cached blocks `hits` (shared: their counts go up), then
        fresh blocks, so it holds `num_tokens` positions. False, with nothing changed, if the pool
        has too few free blocks."""
        need = self.blocks_for(num_tokens) - len(table) - len(hits)
        # Hit blocks nobody holds are on the free list: taking them back leaves fewer to hand out.
        reclaimed = sum(1 for block in hits if self.refs[block] == 0)
        if need > len(self._free) - reclaimed:
            return False
        for block in hits:
            if self.refs[block] == 0:
                del self._free[block]
            self.refs[block] += 1
            table.append(block)
        for _ in range(max(need, 0)):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.refs[block] = 1
            table.append(block)
        return True

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` in place so it holds `num_tokens` positions. False (table unchanged) if the
        pool has too few free blocks."""
        return self.allocate(table, [], num_tokens)

    def free(self, table: list[int]) -> None:
        """Release a request's blocks and empty its table. A block nobody holds any more goes to the
        free list: a cached one at the end (kept longest), the sequence's last block first (the
        least likely to be shared); one without a hash at the front (reused first)."""
        for block in reversed(table):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self._free[block] = None
                if self.hash_of[block] is None:
                    self._free.move_to_end(block, last=False)
        table.clear()

    def cache(self, block: int, block_hash: bytes) -> None:
        """Remember that `block` holds the full block `block_hash` (its KV written or queued). A
        second block with the same contents is not cached: the first serves later requests."""
        if not self.enable_caching or self.hash_of[block] is not None or block_hash in self.cached:
            return
        self.cached[block_hash] = block
        self.hash_of[block] = block_hash

    def _evict(self, block: int) -> None:
        block_hash = self.hash_of[block]
        if block_hash is not None:
            self.hash_of[block] = None
            if self.cached.get(block_hash) == block:
                del self.cached[block_hash]

    def reset_cache(self) -> int:
        """Forget every cached block nobody holds (their KV stays until overwritten); returns how
        many. Blocks running requests hold keep their hashes."""
        dropped = [block for block in self._free if self.hash_of[block] is not None]
        for block in dropped:
            self._evict(block)
            self._free.move_to_end(block, last=False)
        return len(dropped)
