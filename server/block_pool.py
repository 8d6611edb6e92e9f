"""The KV cache's block accounting: which block belongs to which sequence.

Torch-free, so that the schedulers that allocate blocks run without a model
(the simulator drives them under a virtual clock); `kv_cache.KVCache` holds the
tensors these block ids index.
"""

from __future__ import annotations

import heapq


class KVAccountingError(RuntimeError):
    """A block was released twice or never belonged to the pool: an engine bug."""


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # a min-heap: the lowest free id goes first, so the blocks in use stay packed at
        # the start of the pool even after a batch frees blocks all over it; decode
        # attention with torch ops scores every block below the highest in use
        # (model_runner.PagedDecodeAttention)
        self._free = list(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage_ratio(self) -> float:
        return self.num_used / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_hold(self, table: list[int], num_tokens: int) -> bool:
        """Whether `grow(table, num_tokens)` would succeed."""
        return self.blocks_for(num_tokens) - len(table) <= len(self._free)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend `table` in place to hold `num_tokens`; False, table untouched, if it can't."""
        needed = self.blocks_for(num_tokens) - len(table)
        if needed > len(self._free):
            return False
        for _ in range(needed):
            block = heapq.heappop(self._free)
            self._is_free[block] = False
            table.append(block)
        return True

    def release(self, table: list[int]) -> None:
        """Return every block of `table` to the pool and empty it."""
        for block in table:
            if not 0 <= block < self.num_blocks or self._is_free[block]:
                raise KVAccountingError(f"block {block} released but not allocated")
            self._is_free[block] = True
            heapq.heappush(self._free, block)
        table.clear()
