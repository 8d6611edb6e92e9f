"""Paged KV cache: a fixed pool of blocks, block tables per sequence.

`BlockPool` does the accounting (which block belongs to whom); `KVCache`
holds the tensors, one [num_blocks, kv_heads, block_size, head_dim] pool per
layer for K and for V (grouped-query attention stores only the KV heads). The
engine picks the cache dtype: float32 on the CPU whatever the weights' dtype
(the native kernel is float32), the model's dtype on CUDA; attention casts q/k/v
to it at its boundary. Decode attention reads the blocks where they lie (the C
kernel `csrc/paged_attention.c`, or `model_runner.PagedDecodeAttention` with
torch ops): nothing copies a sequence's cache into a contiguous tensor per step.
"""

from __future__ import annotations

import heapq

import torch
from batchpilot_server.models import ModelSpec


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


def bytes_per_block(spec: ModelSpec, block_size: int, dtype: torch.dtype) -> int:
    element = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.n_layers * spec.n_kv_heads * block_size * spec.head_dim * element


class KVCache:
    def __init__(
        self,
        spec: ModelSpec,
        num_blocks: int,
        block_size: int,
        device: str,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size)
        shape = (spec.n_layers, num_blocks, spec.n_kv_heads, block_size, spec.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)

    @classmethod
    def sized(
        cls,
        spec: ModelSpec,
        budget_bytes: float,
        block_size: int,
        device: str,
        dtype: torch.dtype = torch.float32,
    ) -> KVCache:
        """As many blocks as fit in `budget_bytes`."""
        num_blocks = int(budget_bytes // bytes_per_block(spec, block_size, dtype))
        if num_blocks < 1:
            raise ValueError(
                f"KV budget of {budget_bytes / 2**20:.3g} MiB is smaller than one block "
                f"({bytes_per_block(spec, block_size, dtype) / 2**20:.3g} MiB)"
            )
        return cls(spec, num_blocks, block_size, device, dtype)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    def write(
        self,
        layer: int,
        blocks: torch.Tensor,
        offsets: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> None:
        """Store k, v [tokens, kv_heads, head_dim] at (`blocks`, `offsets`) [tokens]."""
        self.k[layer][blocks, :, offsets] = k
        self.v[layer][blocks, :, offsets] = v

    def gather(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [tokens, kv_heads, head_dim] stored at (`blocks`, `offsets`) [tokens]."""
        return self.k[layer][blocks, :, offsets], self.v[layer][blocks, :, offsets]
