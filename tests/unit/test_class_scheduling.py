"""Scheduling by SLO class in both modes: the waiting queue served by priority (FIFO
within a class), the lowest-priority running sequence preempted first, the prefill
budget spent on the higher class first, and the starvation bound (`class_rank`): a
request that arrived `class_max_wait_s` ago ranks above every class.

The real schedulers (built by `new_scheduler`, as the engine and the simulator build
them) and real sequences, under a virtual clock; no model."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from batchpilot_server.batching_config import Mode
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.scheduler import QueueScheduler
from batchpilot_server.engine.scheduler_policies import PolicyOptions, new_scheduler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.serve_options import UsageError, batching_config, engine_options, parser

from tests.support.scheduler_steps import BLOCK, CONFIG, EOS, run

LOW, MID, HIGH = -5, 0, 10


def scheduler(
    mode: Mode,
    *,
    batch: int = 2,
    blocks: int = 64,
    budget: int = 2048,
    max_wait_s: float = 30.0,
) -> QueueScheduler:
    config = replace(CONFIG, max_batch_size=batch, prefill_token_budget=budget)
    options = PolicyOptions(class_max_wait_s=max_wait_s)
    return new_scheduler(mode, BlockPool(blocks, BLOCK), config, frozenset({EOS}), options)


def request(
    name: str, priority: int, arrival: float, prompt: int = 10, max_tokens: int = 4
) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(name, [1] * prompt, params, arrival, None, None, priority=priority)


def names(seqs: list[Sequence]) -> list[str]:
    return [seq.request_id for seq in seqs]


# (waiting requests as (name, priority, arrival), the time of the first step, the
# two the first batch of two admits, in order)
ORDER_CASES = {
    "one class: arrival order": ([("a", MID, 0), ("b", MID, 1), ("c", MID, 2)], 3, ["a", "b"]),
    "higher class first": ([("a", LOW, 0), ("b", LOW, 1), ("c", HIGH, 2)], 3, ["c", "a"]),
    "fifo within a class": ([("a", HIGH, 0), ("b", LOW, 1), ("c", HIGH, 2)], 3, ["a", "c"]),
    "three classes": ([("a", LOW, 0), ("b", MID, 1), ("c", HIGH, 2)], 3, ["c", "b"]),
    # a arrived 30 s before the step: it ranks above every class, b does not yet
    "aged low before high": ([("b", LOW, 5), ("h", HIGH, 6), ("a", LOW, 0)], 30, ["a", "h"]),
    "aged in arrival order": ([("a", LOW, 0), ("b", MID, 1), ("h", HIGH, 29)], 31, ["a", "b"]),
}


@pytest.mark.parametrize("mode", ["continuous", "dynamic", "static"])
@pytest.mark.parametrize("case", ORDER_CASES)
def test_the_waiting_queue_is_served_by_class(mode: Mode, case: str) -> None:
    waiting, now, admitted = ORDER_CASES[case]
    sched = scheduler(mode)
    for name, priority, arrival in waiting:
        sched.add(request(name, priority, arrival))
    plan, _ = run(sched, now)
    assert names(plan.prefill) == admitted
    assert plan.first_scheduled == plan.prefill


def test_a_lower_class_that_does_not_fit_is_not_passed_by_a_later_one() -> None:
    """Admission stops at the first request that cannot start (as with one class), so
    a small later request of the same or a lower class never overtakes a large one."""
    sched = scheduler("continuous", batch=4, blocks=4)
    for seq in (
        request("big", HIGH, 0, prompt=60),
        request("huge", MID, 1, prompt=70),
        request("small", LOW, 2),
    ):
        sched.add(seq)
    plan, _ = run(sched, 3)
    assert names(plan.prefill) == ["big"] and names(list(sched.waiting)) == ["huge", "small"]


# (the four running sequences' priorities, arriving in this order; who the first step
# short of blocks preempts, in order). Every one needs a block more and none is free:
# the first two to grow take the blocks of the last two, lowest priority first and
# the newest among equals (without classes: the newest).
PREEMPT_CASES = {
    "one class: newest first": ([MID, MID, MID, MID], ["r3", "r2"]),
    "the high one is kept": ([MID, MID, HIGH, MID], ["r3", "r1"]),
    "the old low one goes first": ([LOW, MID, MID, MID], ["r0", "r3"]),
    "lows newest first": ([HIGH, LOW, HIGH, LOW], ["r3", "r1"]),
    "three classes": ([LOW, HIGH, MID, MID], ["r0", "r3"]),
}


@pytest.mark.parametrize("case", PREEMPT_CASES)
def test_under_kv_pressure_the_lowest_class_is_preempted_first(case: str) -> None:
    priorities, victims = PREEMPT_CASES[case]
    # four 15-token prompts with their first token fill one block each; the third step's
    # tokens need a second block each
    sched = scheduler("continuous", batch=4, blocks=4)
    seqs = [request(f"r{n}", p, 0.1 * n, prompt=15, max_tokens=8) for n, p in enumerate(priorities)]
    for seq in seqs:
        sched.add(seq)
    assert [len(run(sched, t)[0].preempted) for t in (1, 2)] == [0, 0]
    plan, _ = run(sched, 3)
    assert names(plan.preempted) == victims
    assert sorted(names(plan.decode)) == sorted(set(names(seqs)) - set(victims))
    # the victims resume as blocks free, the higher class first; all complete
    for step in range(4, 60):
        run(sched, step)
        if sched.idle:
            break
    assert [seq.num_output for seq in seqs] == [8] * 4 and sched.pool.num_used == 0


def test_an_aged_low_sequence_is_still_preempted_first_and_resumes_first() -> None:
    """Preemption ranks by class alone: the higher class keeps its blocks however old the
    lower one is. The aged victim then goes back in front of the higher class's victim."""
    sched = scheduler("continuous", batch=4, blocks=4, max_wait_s=10)
    old = request("old", LOW, 0, prompt=15, max_tokens=8)  # aged from t=10
    seqs = [old, *(request(f"h{n}", HIGH, 9.5, prompt=15, max_tokens=8) for n in range(3))]
    for seq in seqs:
        sched.add(seq)
    run(sched, 10)
    run(sched, 10.01)
    plan, _ = run(sched, 10.02)
    assert names(plan.preempted) == ["old", "h2"]
    resumed: list[str] = []
    for step in range(3, 60):
        resumed += names(run(sched, 10 + 0.01 * step)[0].prefill)
        if sched.idle:
            break
    assert resumed == ["old", "h2"] and [seq.num_output for seq in seqs] == [8] * 4


def test_the_prefill_budget_goes_to_a_higher_class_ahead_of_a_chunked_lower_one() -> None:
    sched = scheduler("continuous", batch=4, budget=16)
    low = request("low", LOW, 0, prompt=100)
    sched.add(low)
    plan, _ = run(sched, 1)
    assert plan.chunks == [16] and low.num_computed == 16  # the long prompt, chunked
    high = request("high", HIGH, 1.5, prompt=10)
    same = request("same", LOW, 1.5, prompt=10)
    sched.add(same)
    sched.add(high)
    plan, _ = run(sched, 2)
    # the newcomer of the higher class first, then the running low prompt's chunk; a
    # newcomer of the low class waits behind the running one it would have followed
    assert list(zip(names(plan.prefill), plan.chunks, strict=True)) == [("high", 10), ("low", 6)]
    assert names(list(sched.waiting)) == ["same"]


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
@pytest.mark.parametrize(("max_wait_s", "served_by"), [(1.0, 1.1), (math.inf, None)])
def test_a_low_class_is_served_once_it_waited_class_max_wait_s(
    mode: Mode, max_wait_s: float, served_by: float | None
) -> None:
    """The guarantee: a request that arrived `max_wait_s` ago ranks above every class,
    so a steady stream of higher-class work (a new request every step, one slot) holds
    a low request back at most that long; no request that arrived more than
    `max_wait_s` after it is served before it. Without the bound it would starve."""
    sched = scheduler(mode, batch=1, max_wait_s=max_wait_s)
    low = request("low", LOW, 0.0, max_tokens=1)
    sched.add(low)
    highs = []
    for step in range(30):
        now = 0.1 * step
        highs.append(request(f"h{step}", HIGH, now, max_tokens=1))
        sched.add(highs[-1])
        run(sched, now + 0.05)
    if served_by is None:
        assert low.first_scheduled is None  # starved: the stream never lets up
        return
    assert low.first_scheduled is not None and max_wait_s <= low.first_scheduled <= served_by
    before = [h for h in highs if h.first_scheduled and h.first_scheduled < low.first_scheduled]
    assert before and all(h.arrival < low.arrival + max_wait_s for h in before)


@pytest.mark.parametrize(("flag", "expected"), [([], 20.0), (["2.5"], 2.5), (["inf"], math.inf)])
def test_class_max_wait_s_reaches_the_engine_options(flag: list[str], expected: float) -> None:
    args = parser().parse_args(["--class-max-wait-s", *flag] if flag else [])
    assert engine_options(args, batching_config(args)).class_max_wait_s == expected


@pytest.mark.parametrize("value", ["-1", "nan"])
def test_a_negative_or_nan_class_max_wait_s_is_a_usage_error(value: str) -> None:
    args = parser().parse_args(["--class-max-wait-s", value])
    with pytest.raises(UsageError, match="--class-max-wait-s must be >= 0"):
        engine_options(args, batching_config(args))


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
def test_the_first_in_line_and_when_the_order_next_changes(mode: Mode) -> None:
    """What the simulator's fast-forward asks: the request a plan tries first (its
    ranking, not the queue's head) and when an age changes the ranking."""
    s = scheduler(mode, max_wait_s=30.0)
    assert s.first_in_line(0.0) is None and s.rank_changes_at(0.0) is None
    for seq in (request("a", LOW, 0.0), request("b", LOW, 1.0)):
        s.add(seq)
    assert names([s.first_in_line(2.0)]) == ["a"]  # type: ignore[list-item]
    assert s.rank_changes_at(2.0) is None  # one class: the order never changes
    s.add(request("h", HIGH, 2.0))
    assert names([s.first_in_line(2.0)]) == ["h"]  # type: ignore[list-item]
    assert s.rank_changes_at(2.0) == 30.0  # when a reaches the max wait
    assert names([s.first_in_line(30.0)]) == ["a"]  # type: ignore[list-item]
    assert s.rank_changes_at(30.0) == 31.0
