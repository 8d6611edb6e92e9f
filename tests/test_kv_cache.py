"""Block pool accounting: never leaks, never exceeds the pool."""

from __future__ import annotations

import random

import pytest
import torch
from batchpilot_server.kv_cache import BlockPool, KVAccountingError, KVCache, bytes_per_block
from batchpilot_server.models import get_spec


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
