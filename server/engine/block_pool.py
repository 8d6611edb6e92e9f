"""The KV cache's block accounting: which blocks each sequence holds, and the prefix cache.

Torch-free, so that the schedulers that allocate blocks run without a model
(the simulator drives them under a virtual clock); `kv_cache.KVCache` holds the
tensors these block ids index.

Automatic prefix caching (vLLM's scheme): a full block is named by a hash of its
tokens chained with the hash of every block before it (`extend_block_hashes`), so
equal names mean equal tokens at equal positions, hence equal K/V. Once a block's
K/V are computed the scheduler publishes it under its name; a later sequence
whose tokens start the same shares those blocks (a reference count per block;
nothing is copied) and computes only the rest. A block nobody holds any more
keeps its K/V and its name, and stays a hit, until the pool needs the space.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import Counter, OrderedDict

BlockHash = bytes


class KVAccountingError(RuntimeError):
    """A block was released twice or never belonged to the pool: an engine bug."""


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: list[int], block_size: int, num_tokens: int
) -> None:
    """Append to `hashes` the names of the full blocks among the first `num_tokens`
    of `token_ids` that it lacks. SHA-256 rather than Python's hash: a collision
    would hand one prompt another's K/V, and crafting one must stay out of reach."""
    parent = hashes[-1] if hashes else b""
    for start in range(len(hashes) * block_size, num_tokens - block_size + 1, block_size):
        tokens = array("q", token_ids[start : start + block_size]).tobytes()
        parent = hashlib.sha256(parent + tokens).digest()
        hashes.append(parent)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # off: `publish` keeps nothing and `cached_prefix` finds nothing (set it before
        # the first block is allocated)
        self.prefix_caching = prefix_caching
        self._refs = [0] * num_blocks  # sequences holding each block
        self._name: list[BlockHash | None] = [None] * num_blocks  # published blocks' names
        self._by_name: dict[BlockHash, int] = {}
        # Free blocks come in two kinds. Empty ones (no name) sit in a min-heap: the
        # lowest id goes first, so the blocks in use stay packed at the start of the
        # pool even after a batch frees blocks all over it; decode attention with
        # torch ops scores every block below the highest in use
        # (model_runner.PagedDecodeAttention). Named ones (cached K/V nobody holds)
        # are taken only once no empty block is left, least recently freed first.
        # Evicting the lowest named id instead would keep the pool packed, but the
        # lowest ids are the oldest blocks, the long-lived shared prefixes (a system
        # prompt) that every new request hits; and by the time no empty block is left
        # the blocks in use span most of the pool anyway, so LRU costs no packing
        # the pool still had.
        self._empty = list(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()

    @property
    def num_free(self) -> int:
        """Blocks no sequence holds, cached ones included: the pool may take them back."""
        return len(self._empty) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks whose K/V are published, held or not."""
        return len(self._by_name)

    @property
    def usage_ratio(self) -> float:
        """Held blocks over all: a cached block nobody holds counts as free."""
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, table: list[int], num_tokens: int) -> bool:
        """Whether `grow(table, num_tokens)` would succeed."""
        return self.blocks_for(num_tokens) - len(table) <= self.num_free

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` in place to hold `num_tokens`; False, table untouched, if it can't."""
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > self.num_free:
            return False
        for _ in range(needed):
            table.append(self._take_free())
        return True

    def cached_prefix(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks published under the longest prefix of `hashes`; holds nothing."""
        blocks: list[int] = []
        if not self.prefix_caching:
            return blocks
        for name in hashes:
            block = self._by_name.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def grow_sharing(self, table: list[int], cached: list[int], num_tokens: int) -> bool:
        """Fill the empty `table` with the `cached` blocks (shared: each gains a
        holder) and fresh ones up to `num_tokens`; False, nothing taken, if the pool
        cannot hold the rest (a cached block nobody holds is not free for it)."""
        if table:
            raise KVAccountingError("a sequence shares cached blocks only into an empty table")
        idle = sum(1 for block in cached if self._refs[block] == 0)
        if self.blocks_for(num_tokens) - len(cached) > self.num_free - idle:
            return False
        for block in cached:
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            table.append(block)
        return self.grow(table, num_tokens)

    def publish(self, block: int, name: BlockHash) -> None:
        """`block` now holds the K/V its `name` says: later sequences may share it. A
        block computed twice (two sequences admitted before either published) keeps
        the first copy's name; the second stays private and is freed as empty."""
        if not self.prefix_caching or self._name[block] is not None or name in self._by_name:
            return
        if self._refs[block] == 0:
            raise KVAccountingError(f"block {block} published but not allocated")
        self._name[block] = name
        self._by_name[name] = block

    def release(self, table: list[int]) -> None:
        """Give up every block of `table` and empty it. A block no one holds any more
        is free; a published one stays cached until it is taken back. The table's
        tail goes first in the LRU order: a prefix is more likely shared than the
        blocks after it."""
        for block, count in Counter(table).items():
            if not 0 <= block < self.num_blocks or self._refs[block] < count:
                raise KVAccountingError(f"block {block} released but not allocated")
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            if self._name[block] is None:
                heapq.heappush(self._empty, block)
            else:
                self._evictable[block] = None
        table.clear()

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Give back the blocks of `table` past those `num_tokens` need: what a
        speculative verification took for draft tokens it rejected (their K/V are
        garbage). Such blocks were never published: a sequence publishes only blocks
        its accepted tokens fill."""
        tail = table[self.blocks_for(num_tokens) :]
        if any(self._name[block] is not None for block in tail):
            raise KVAccountingError("a published block was rolled back")
        del table[len(table) - len(tail) :]
        self.release(tail)

    def refs(self, block: int) -> int:
        """How many sequences hold `block`."""
        return self._refs[block]

    def _take_free(self) -> int:
        if self._empty:
            block = heapq.heappop(self._empty)
        else:
            block, _ = self._evictable.popitem(last=False)
            name = self._name[block]
            assert name is not None
            del self._by_name[name]
            self._name[block] = None
        self._refs[block] = 1
        return block
