"""Paged KV cache: a fixed pool of blocks, block tables per sequence.

`block_pool.BlockPool` does the accounting (which block belongs to whom); `KVCache`
holds the tensors, one [num_blocks, kv_heads, block_size, head_dim] pool per
layer for K and for V (grouped-query attention stores only the KV heads). The
engine picks the cache dtype: the model's on CUDA and for bfloat16 weights (their
K/V are bfloat16 values, stored exactly), float32 otherwise on the CPU; `write`
casts k/v to it, and attention on the CPU computes in float32 over either. Decode
attention reads the blocks where they lie (the C kernel `csrc/paged_attention.c`,
or `model_runner.PagedDecodeAttention` with torch ops): nothing copies a sequence's
cache into a contiguous tensor per step.
"""

from __future__ import annotations

import torch
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.models import ModelSpec


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
        prefix_caching: bool = False,
    ) -> None:
        self.pool = BlockPool(num_blocks, block_size, prefix_caching)
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
        prefix_caching: bool = False,
    ) -> KVCache:
        """As many blocks as fit in `budget_bytes`."""
        num_blocks = int(budget_bytes // bytes_per_block(spec, block_size, dtype))
        if num_blocks < 1:
            raise ValueError(
                f"KV budget of {budget_bytes / 2**20:.3g} MiB is smaller than one block "
                f"({bytes_per_block(spec, block_size, dtype) / 2**20:.3g} MiB)"
            )
        return cls(spec, num_blocks, block_size, device, dtype, prefix_caching)

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
        """Store k, v [tokens, kv_heads, head_dim] at (`blocks`, `offsets`) [tokens], in
        the cache's dtype."""
        self.k[layer][blocks, :, offsets] = k.to(self.k.dtype)
        self.v[layer][blocks, :, offsets] = v.to(self.v.dtype)

    def gather(
        self, layer: int, blocks: torch.Tensor, offsets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V [tokens, kv_heads, head_dim] stored at (`blocks`, `offsets`) [tokens]."""
        return self.k[layer][blocks, :, offsets], self.v[layer][blocks, :, offsets]
