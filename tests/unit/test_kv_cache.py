"""Block pool accounting: never leaks, never exceeds the pool."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from batchpilot_server.engine.block_pool import BlockPool, KVAccountingError
from batchpilot_server.engine.kv_cache import KVCache, bytes_per_block
from batchpilot_server.engine.models import get_spec


def test_grow_allocates_whole_blocks_and_release_returns_them() -> None:
    pool = BlockPool(num_blocks=4, block_size=16)
    table: list[int] = []
    assert pool.grow(table, 17) and len(table) == 2
    assert pool.grow(table, 32) and len(table) == 2  # still fits
    assert pool.num_used == 2 and pool.usage_ratio == 0.5
    pool.release(table)
    assert table == [] and pool.num_free == 4 and pool.usage_ratio == 0.0


def test_grow_past_the_pool_fails_without_taking_anything() -> None:
    pool = BlockPool(num_blocks=3, block_size=16)
    first: list[int] = []
    assert pool.grow(first, 32)
    second: list[int] = []
    assert not pool.can_hold(second, 33)
    assert not pool.grow(second, 33)
    assert second == [] and pool.num_free == 1


def test_random_traffic_never_leaks_or_double_allocates() -> None:
    rng = random.Random(3)
    pool = BlockPool(num_blocks=64, block_size=16)
    tables: list[list[int]] = []
    for _ in range(2000):
        if tables and rng.random() < 0.4:
            pool.release(tables.pop(rng.randrange(len(tables))))
        elif tables and rng.random() < 0.5:
            table = rng.choice(tables)
            pool.grow(table, len(table) * 16 + rng.randrange(1, 40))
        else:
            table = []
            if pool.grow(table, rng.randrange(1, 200)):
                tables.append(table)
        owned = [block for table in tables for block in table]
        assert len(owned) == len(set(owned)) == pool.num_used <= pool.num_blocks
    for table in tables:
        pool.release(table)
    assert pool.num_free == 64


def test_releasing_a_block_twice_is_caught() -> None:
    pool = BlockPool(num_blocks=2, block_size=16)
    table: list[int] = []
    pool.grow(table, 1)
    stale = list(table)
    pool.release(table)
    with pytest.raises(KVAccountingError, match="not allocated"):
        pool.release(stale)


def test_cache_is_sized_from_the_memory_budget() -> None:
    spec = get_spec("tiny")
    per_block = bytes_per_block(spec, 16, torch.float32)
    cache = KVCache.sized(spec, 10.5 * per_block, 16, "cpu")
    assert cache.pool.num_blocks == 10
    assert cache.k.numel() * 4 * 2 == 10 * per_block
    with pytest.raises(ValueError, match="smaller than one block"):
        KVCache.sized(spec, per_block / 2, 16, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_block_holds_the_kv_heads_only(dtype: torch.dtype) -> None:
    """Grouped-query attention: the pool stores n_kv_heads per layer, not n_heads,
    and a block's bytes follow 2 x layers x kv_heads x block_size x head_dim x element."""
    # head_dim is its own field: 8 heads of 128 over d_model 768 (as Qwen3 does)
    spec = replace(get_spec("tiny"), n_layers=3, n_heads=8, n_kv_heads=2, head_dim=128, d_model=768)
    element = torch.empty((), dtype=dtype).element_size()
    per_block = bytes_per_block(spec, 16, dtype)
    assert per_block == 2 * 3 * 2 * 16 * 128 * element
    cache = KVCache.sized(spec, 5 * per_block, 16, "cpu", dtype)
    assert cache.k.shape == cache.v.shape == (3, 5, 2, 16, 128)
    assert cache.k.dtype == dtype
    assert (cache.k.numel() + cache.v.numel()) * element == 5 * per_block
