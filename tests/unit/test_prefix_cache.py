"""Prefix caching without a model: the block pool's names, reference counts and LRU, and
the schedulers sharing cached blocks under a virtual clock."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from batchpilot_server.engine.block_pool import (
    BlockHash,
    BlockPool,
    KVAccountingError,
    extend_block_hashes,
)
from batchpilot_server.engine.scheduler import QueueScheduler
from batchpilot_server.engine.scheduler_continuous import ContinuousScheduler
from batchpilot_server.engine.scheduler_dynamic import DynamicScheduler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import SamplingParams
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from tests.support.scheduler_steps import BLOCK, CONFIG, EOS, run

SIZE = 4  # block size of the pool tests: short token lists span several blocks


def names(tokens: list[int], size: int = SIZE) -> list[BlockHash]:
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, tokens, size, len(tokens))
    return hashes


def cached_pool(num_blocks: int) -> BlockPool:
    return BlockPool(num_blocks, SIZE, prefix_caching=True)


def computed(pool: BlockPool, tokens: list[int]) -> list[int]:
    """A sequence of `tokens` that computed them all and published its full blocks."""
    table: list[int] = []
    assert pool.grow(table, len(tokens))
    for block, name in zip(table, names(tokens), strict=False):
        pool.publish(block, name)
    return table


def test_a_block_is_named_by_its_tokens_and_every_block_before_it() -> None:
    first = names([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(first) == 2  # the ninth token's block is not full: no name
    assert names([1, 2, 3, 4, 5, 6, 7, 8]) == first
    # the same second block after another first block is another block
    other = names([0, 2, 3, 4, 5, 6, 7, 8])
    assert other[0] != first[0] and other[1] != first[1]
    # extending goes on from the names already there
    hashes = first[:1]
    extend_block_hashes(hashes, [1, 2, 3, 4, 5, 6, 7, 8], SIZE, 8)
    assert hashes == first


def test_a_new_sequence_shares_the_longest_cached_prefix() -> None:
    pool = cached_pool(8)
    first = computed(pool, list(range(12)))
    hits = pool.cached_prefix(names([0, 1, 2, 3, 4, 5, 6, 7, 99, 99, 99, 99]))
    assert hits == first[:2]
    second: list[int] = []
    assert pool.grow_sharing(second, hits, 12)
    assert second[:2] == first[:2] and second[2] not in first
    assert [pool.refs(b) for b in first] == [2, 2, 1]
    assert pool.num_used == 4
    pool.release(list(first))
    assert [pool.refs(b) for b in second] == [1, 1, 1]


def test_a_freed_cached_block_counts_as_free_and_stays_a_hit() -> None:
    pool = cached_pool(4)
    table = computed(pool, list(range(8)))
    pool.release(table)
    assert pool.num_free == 4 and pool.usage_ratio == 0.0 and pool.num_cached == 2
    assert pool.cached_prefix(names(list(range(8)))) == [0, 1]


def test_empty_blocks_go_before_cached_ones_then_the_least_recently_freed() -> None:
    pool = cached_pool(4)
    old = computed(pool, [1] * 4)
    new = computed(pool, [2] * 4)
    pool.release(list(old))
    pool.release(list(new))
    taken: list[int] = []
    assert pool.grow(taken, 2 * SIZE)
    assert taken == [2, 3]  # the empty blocks, lowest first; both cached blocks survive
    assert pool.num_cached == 2
    assert pool.grow(taken, 3 * SIZE)
    assert taken[2] == old[0]  # freed first: evicted first
    assert pool.cached_prefix(names([1] * 4)) == []
    assert pool.cached_prefix(names([2] * 4)) == new


def test_a_sequence_s_tail_is_evicted_before_its_prefix() -> None:
    pool = cached_pool(3)
    table = computed(pool, list(range(12)))
    pool.release(list(table))
    taken: list[int] = []
    assert pool.grow(taken, SIZE)
    assert taken == [table[2]]
    assert pool.cached_prefix(names(list(range(12)))) == table[:2]


def test_sharing_counts_an_idle_cached_block_as_taken_not_free() -> None:
    pool = cached_pool(3)
    pool.release(computed(pool, list(range(8))))
    hits = pool.cached_prefix(names(list(range(8))))
    table: list[int] = []
    # 3 blocks: the 2 hits plus 1 fresh, and the pool has exactly 3
    assert pool.grow_sharing(table, hits, 9)
    assert pool.num_free == 0
    pool.release(table)
    hits = pool.cached_prefix(names(list(range(8))))
    # 4 blocks would need a fourth: refused, nothing taken
    assert not pool.grow_sharing(table, hits, 13)
    assert table == [] and pool.num_free == 3 and pool.num_cached == 2


def test_a_block_computed_twice_keeps_the_first_copy_s_name() -> None:
    pool = cached_pool(4)
    first = computed(pool, list(range(4)))
    second = computed(pool, list(range(4)))
    assert first != second and pool.num_cached == 1
    pool.release(second)
    assert pool.num_cached == 1 and pool.cached_prefix(names(list(range(4)))) == first


def test_publishing_and_releasing_a_block_nobody_holds_is_caught() -> None:
    pool = cached_pool(2)
    table = computed(pool, list(range(4)))
    stale = list(table)
    pool.release(table)
    with pytest.raises(KVAccountingError, match="not allocated"):
        pool.release(stale)
    spare: list[int] = []
    pool.grow(spare, 1)
    pool.release(list(spare))
    with pytest.raises(KVAccountingError, match="not allocated"):
        pool.publish(spare[0], names([5, 5, 5, 5])[0])


def test_without_prefix_caching_nothing_is_cached() -> None:
    pool = BlockPool(4, SIZE)
    table = computed(pool, list(range(8)))
    assert pool.num_cached == 0
    pool.release(table)
    assert pool.cached_prefix(names(list(range(8)))) == []


class PoolMachine(RuleBasedStateMachine):
    """Sequences of tokens from a two-letter alphabet (so prefixes collide) take blocks
    sharing their cached prefix, compute and publish them, and free them, in any order.
    A model of what each block holds checks every hit."""

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.pool = cached_pool(12)
        self.tables: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, table)
        self.content: dict[int, BlockHash] = {}  # block -> the name its K/V stand for
        self.ids = 0

    @rule(target=seqs, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=20))
    def admit(self, tokens: list[int]) -> int:
        hashes = names(tokens)[: (len(tokens) - 1) // SIZE]
        hits = self.pool.cached_prefix(hashes)
        for block, name in zip(hits, hashes, strict=False):
            assert self.content[block] == name, "a hit holds another prefix's K/V"
        table: list[int] = []
        free_before = self.pool.num_free
        if not self.pool.grow_sharing(table, hits, len(tokens)):
            assert table == [] and self.pool.num_free == free_before
            return -1
        for block in table[len(hits) :]:
            self.content.pop(block, None)  # fresh: whatever it held is overwritten
        self.ids += 1
        self.tables[self.ids] = (tokens, table)
        return self.ids

    @rule(seq=seqs)
    def compute(self, seq: int) -> None:
        if seq not in self.tables:
            return
        tokens, table = self.tables[seq]
        for block, name in zip(table, names(tokens), strict=False):
            self.content.setdefault(block, name)
            self.pool.publish(block, name)

    @rule(seq=consumes(seqs))
    def free(self, seq: int) -> None:
        if seq in self.tables:
            self.pool.release(self.tables.pop(seq)[1])

    @invariant()
    def refs_are_the_holders(self) -> None:
        held = Counter(block for _, table in self.tables.values() for block in table)
        assert all(self.pool.refs(b) == held[b] for b in range(self.pool.num_blocks))
        assert self.pool.num_used == len(held)
        assert all(len(set(table)) == len(table) for _, table in self.tables.values())


PoolMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=30, deadline=None)
test_pool_state_machine = PoolMachine.TestCase


# ---- the schedulers ------------------------------------------------------------

PROMPT = list(range(40))  # two full blocks of 16 and 8 tokens more


def seq(n: int, prompt: list[int], max_tokens: int = 3, arrival: float = 0.0) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(f"r{n}", list(prompt), params, arrival, None, None)


def cached_continuous(blocks: int = 64, budget: int = 2048) -> ContinuousScheduler:
    config = replace(CONFIG, prefill_token_budget=budget)
    return ContinuousScheduler(BlockPool(blocks, BLOCK, True), config, frozenset({EOS}))


def serve(scheduler: QueueScheduler, *seqs: Sequence, now: float = 1.0) -> float:
    """Admit `seqs` and step until the scheduler is idle; the virtual time then."""
    for s in seqs:
        scheduler.add(s)
    while not scheduler.idle:
        run(scheduler, now)
        now += 0.01
    return now


def test_a_later_request_computes_only_past_the_cached_prefix() -> None:
    scheduler = cached_continuous()
    now = serve(scheduler, seq(0, PROMPT))
    later = seq(1, PROMPT[:32] + [7] * 20)
    scheduler.add(later)
    plan, _ = run(scheduler, now)
    assert plan.prefill == [later] and plan.chunks == [52 - 32]
    assert (plan.cache_queried, plan.cache_hit) == (52, 32)
    assert later.block_table[:2] == [0, 1]  # the first request's blocks, shared


def test_a_request_for_prompt_logprobs_computes_its_whole_prompt() -> None:
    scheduler = cached_continuous()
    now = serve(scheduler, seq(0, PROMPT))
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    scheduler.add(Sequence("r1", list(PROMPT), params, 0.0, None, None))
    plan, _ = run(scheduler, now)
    assert plan.chunks == [40] and (plan.cache_queried, plan.cache_hit) == (0, 0)


def test_a_prompt_all_cached_still_computes_its_last_block() -> None:
    scheduler = cached_continuous()
    now = serve(scheduler, seq(0, PROMPT))
    again = seq(1, PROMPT[:32])
    scheduler.add(again)
    plan, _ = run(scheduler, now)
    # its last token is computed for the logits, into a block of its own
    assert plan.chunks == [16] and plan.cache_hit == 16
    assert again.block_table[0] == 0 and again.block_table[1] != 1


def test_blocks_are_published_once_computed_not_before() -> None:
    scheduler = cached_continuous(budget=16)
    first = seq(0, PROMPT)
    scheduler.add(first)
    run(scheduler, 1.0)  # the first chunk of 16
    assert scheduler.pool.num_cached == 0  # published at the next step's planning
    second = seq(1, PROMPT)
    scheduler.add(second)
    plan, _ = run(scheduler, 1.01)
    assert scheduler.pool.num_cached == 1
    # the budget went to the first's next chunk: the second waits
    assert second.num_computed == 0 and plan.chunks == [16]


def test_a_request_waits_for_the_prefix_another_is_computing_then_shares_it() -> None:
    scheduler = cached_continuous()
    first, second = seq(0, PROMPT), seq(1, PROMPT[:32] + [5] * 4)
    scheduler.add(first)
    scheduler.add(second)
    plan, _ = run(scheduler, 1.0)
    assert plan.prefill == [first]  # the second's first block is in flight
    plan, _ = run(scheduler, 1.01)
    assert plan.prefill == [second] and plan.chunks == [4] and plan.cache_hit == 32
    # without the cache both compute their prompt at once
    scheduler = ContinuousScheduler(BlockPool(64, BLOCK), CONFIG, frozenset({EOS}))
    scheduler.add(seq(0, PROMPT))
    scheduler.add(seq(1, PROMPT[:32] + [5] * 4))
    assert len(run(scheduler, 1.0)[0].prefill) == 2


def test_a_preempted_sequence_is_recomputed_from_its_cached_prefix() -> None:
    # 6 blocks: both hold 3 at 48 tokens; the older's 4th block preempts the younger,
    # whose tail block the older then takes, its first two staying cached
    scheduler = cached_continuous(blocks=6)
    old = seq(0, PROMPT[:30], max_tokens=22)
    young = seq(1, [9] * 30, max_tokens=22, arrival=0.001)
    scheduler.add(old)
    scheduler.add(young)
    now, plans = 1.0, []
    while not scheduler.idle:
        plans.append(run(scheduler, now)[0])
        now += 0.01
    preempted_at = next(n for n, plan in enumerate(plans) if plan.preempted)
    assert plans[preempted_at].preempted == [young]
    readmitted = next(p for p in plans[preempted_at + 1 :] if young in p.prefill)
    assert readmitted.cache_hit == 2 * BLOCK
    assert sum(plan.cache_hit for plan in plans) == 2 * BLOCK  # no other hit
    assert young.num_output == old.num_output == 22
    assert scheduler.pool.num_used == 0


def test_a_dynamic_batch_hits_what_an_earlier_batch_computed() -> None:
    scheduler = DynamicScheduler(BlockPool(64, BLOCK, True), CONFIG, frozenset({EOS}))
    now = serve(scheduler, seq(0, PROMPT))
    batch = [seq(n, PROMPT[:32] + [n] * 5, arrival=now) for n in (1, 2)]
    for s in batch:
        scheduler.add(s)
    plan, _ = run(scheduler, now + 1.0)
    assert plan.prefill == batch
    assert (plan.cache_queried, plan.cache_hit) == (74, 64)
    assert batch[0].block_table[:2] == batch[1].block_table[:2] == [0, 1]
    serve(scheduler, now=now + 2.0)
    assert scheduler.pool.num_used == 0


def test_without_prefix_caching_the_plan_queries_nothing() -> None:
    scheduler = ContinuousScheduler(BlockPool(64, BLOCK), CONFIG, frozenset({EOS}))
    now = serve(scheduler, seq(0, PROMPT))
    scheduler.add(seq(1, PROMPT))
    plan, _ = run(scheduler, now)
    assert (plan.cache_queried, plan.cache_hit) == (0, 0) and plan.chunks == [40]
