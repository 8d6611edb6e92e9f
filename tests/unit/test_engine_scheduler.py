"""The scheduler protocol on its own: no model, no threads, no torch, a virtual clock.

A simulation drives the real schedulers this way: `schedule(now)`, compute what
the plan says (here: nothing; every sampling row draws a fixed token),
`postprocess(plan, tokens, logprobs, now)`, which advances the rows."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace

import pytest
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.scheduler import Output, QueueScheduler
from batchpilot_server.engine.scheduler_continuous import ContinuousScheduler
from batchpilot_server.engine.scheduler_dynamic import DynamicScheduler, StaticScheduler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import (
    DeadlineExceededError,
    EngineStoppedError,
    QueueFullError,
    SamplingParams,
    TokenEvent,
)

from tests.support.scheduler_steps import BLOCK, CONFIG, EOS, run


def request(n: int, arrival: float, max_tokens: int, deadline: float | None = None) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(f"r{n}", [1] * (10 + n), params, arrival, deadline, None)


def dynamic(blocks: int = 64) -> DynamicScheduler:
    return DynamicScheduler(BlockPool(blocks, BLOCK), CONFIG, frozenset({EOS}))


def continuous(blocks: int = 64, budget: int = 2048) -> ContinuousScheduler:
    config = replace(CONFIG, prefill_token_budget=budget)
    return ContinuousScheduler(BlockPool(blocks, BLOCK), config, frozenset({EOS}))


def test_the_schedulers_import_without_torch() -> None:
    code = (
        "import sys, batchpilot_server.engine.scheduler_dynamic, "
        "batchpilot_server.engine.scheduler_continuous;"
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_a_dynamic_batch_fires_at_its_timeout_and_holds_every_response_to_its_end() -> None:
    scheduler = dynamic()
    seqs = [request(n, arrival=0.0, max_tokens=n + 1) for n in range(3)]
    for seq in seqs:
        scheduler.add(seq)
    assert scheduler.schedule(0.005).size == 0  # 3 of 4 wait: the timeout has not passed
    assert scheduler.wake_at() == pytest.approx(0.010)
    outputs: list[Output] = []
    plan, step_outputs = run(scheduler, 0.010)
    assert (plan.batch_size, plan.first_scheduled, plan.chunks) == (3, seqs, None)
    outputs += step_outputs
    for t in (0.020, 0.030):
        outputs += run(scheduler, t)[1]
    finals = [o for o in outputs if o.final]
    # every final event waits for the longest member: all out at the third step
    assert [o.seq for o in finals] == seqs
    assert {o.item.step for o in finals if isinstance(o.item, TokenEvent)} == {3}
    assert [o.held_s for o in finals] == pytest.approx([0.020, 0.010, 0.0])
    assert scheduler.idle and scheduler.pool.num_used == 0 and scheduler.steps == 3


def test_continuous_completes_each_response_at_its_own_step() -> None:
    scheduler = continuous()
    seqs = [request(n, arrival=0.0, max_tokens=n + 1) for n in range(4)]
    for seq in seqs:
        scheduler.add(seq)  # four: max_batch_size, so the first step fires at once
    finished_at = {}
    for step in range(1, 5):
        for output in run(scheduler, step * 0.01)[1]:
            if output.final:
                assert output.held_s is None
                finished_at[output.seq.request_id] = step
    assert finished_at == {"r0": 1, "r1": 2, "r2": 3, "r3": 4}
    assert scheduler.idle and scheduler.pool.num_used == 0


@pytest.mark.parametrize("make", [dynamic, continuous])
def test_queue_limit_deadline_cancellation_and_shutdown(
    make: Callable[[], QueueScheduler],
) -> None:
    scheduler = make()
    scheduler.reconfigure(replace(CONFIG, max_queue_size=3))  # 3 wait: no batch is due
    for n in range(3):
        scheduler.add(request(n, arrival=0.0, max_tokens=4, deadline=0.004 if n == 1 else None))
    with pytest.raises(QueueFullError, match="max_queue_size 3"):
        scheduler.add(request(9, arrival=0.0, max_tokens=4))
    first, late, cancelled = scheduler.waiting
    scheduler.cancel(cancelled)
    assert scheduler.wake_at() == pytest.approx(0.004)  # the deadline comes first
    plan = scheduler.schedule(0.005)  # no batch due: only the deadline and the cancel apply
    assert plan.size == 0 and [o.seq for o in plan.ended] == [late]
    assert isinstance(plan.ended[0].item, DeadlineExceededError)
    assert scheduler.num_waiting == 1 and scheduler.wake_at() == pytest.approx(0.010)
    plan, _ = run(scheduler, 0.010)  # the batch timeout
    assert plan.first_scheduled == [first] and scheduler.num_running == 1
    unscheduled = [request(n, arrival=0.010, max_tokens=4) for n in (3, 4)]
    for seq in unscheduled:
        scheduler.add(seq)
    scheduler.stop(drain=False)
    plan, _ = run(scheduler, 0.011)
    assert [o.seq for o in plan.ended] == unscheduled
    assert all(isinstance(o.item, EngineStoppedError) for o in plan.ended)
    assert plan.decode == [first]  # what was scheduled runs on
    aborted = scheduler.abort(EngineStoppedError("grace over"))
    assert [o.seq for o in aborted] == [first]
    assert scheduler.idle and scheduler.pool.num_used == 0


@pytest.mark.parametrize("make", [dynamic, continuous])
def test_deadlines_expire_in_their_own_order_and_only_while_a_request_waits(
    make: Callable[[], QueueScheduler],
) -> None:
    scheduler = make()
    scheduler.reconfigure(replace(CONFIG, max_batch_size=1, batch_timeout_ms=0))
    # Arrival order is not deadline order; the first request is scheduled at once.
    deadlines = {0: 0.001, 1: 0.030, 2: 0.004, 3: 0.002, 4: 0.020}
    seqs = [request(n, arrival=0.0, max_tokens=8, deadline=d) for n, d in deadlines.items()]
    for seq in seqs:
        scheduler.add(seq)
    running, late, early, cancelled, middle = seqs
    plan, _ = run(scheduler, 0.0)
    assert plan.first_scheduled == [running]  # its deadline no longer applies
    scheduler.cancel(cancelled)  # nor does a cancelled request's
    plan, _ = run(scheduler, 0.005)  # past 0.001, 0.002 and 0.004
    assert [o.seq for o in plan.ended] == [early]
    assert all(isinstance(o.item, DeadlineExceededError) for o in plan.ended)
    assert list(scheduler.waiting) == [late, middle]
    plan, _ = run(scheduler, 0.025)
    assert [o.seq for o in plan.ended] == [middle] and list(scheduler.waiting) == [late]


def test_preemption_under_a_virtual_clock_frees_and_recomputes() -> None:
    # room for four prompts plus their first tokens in one block each, not their growth
    scheduler = continuous(blocks=4)
    seqs = [Sequence(f"r{n}", [1] * 14, SamplingParams(8), 0.0, None, None) for n in range(4)]
    for seq in seqs:
        scheduler.add(seq)
    preempted = 0
    for step in range(1, 100):
        plan, _ = run(scheduler, step * 0.01)
        preempted += len(plan.preempted)
        if scheduler.idle:
            break
    assert preempted > 0 and scheduler.preemptions == preempted
    assert [seq.num_output for seq in seqs] == [8] * 4
    assert scheduler.pool.num_used == 0


def static(max_wait_s: float | None = None, padded: bool = False) -> StaticScheduler:
    return StaticScheduler(BlockPool(64, BLOCK), CONFIG, frozenset({EOS}), padded, max_wait_s)


def test_a_static_batch_waits_for_max_batch_size_whatever_the_timeout() -> None:
    scheduler = static()
    seqs = [request(n, arrival=n * 1.0, max_tokens=2) for n in range(4)]
    for seq in seqs[:3]:
        scheduler.add(seq)
    # three of four wait: long past batch_timeout_ms nothing fires, and nothing will
    assert scheduler.schedule(100.0).size == 0 and scheduler.wake_at() is None
    scheduler.add(seqs[3])
    plan, _ = run(scheduler, 100.0)
    assert (plan.batch_size, plan.first_scheduled) == (4, seqs)


def test_the_static_safety_valve_fires_a_partial_batch() -> None:
    scheduler = static(max_wait_s=0.5)
    seq = request(0, arrival=1.0, max_tokens=2)
    scheduler.add(seq)
    assert scheduler.wake_at() == pytest.approx(1.5)
    assert scheduler.schedule(1.4).size == 0
    assert run(scheduler, 1.5)[0].first_scheduled == [seq]


def test_static_fires_a_partial_batch_on_shutdown() -> None:
    scheduler = static()
    seq = request(0, arrival=0.0, max_tokens=2)
    scheduler.add(seq)
    scheduler.stop(drain=True)
    assert run(scheduler, 0.0)[0].first_scheduled == [seq]


@pytest.mark.parametrize("padded", [False, True])
def test_slot_steps_count_held_and_padded_rows(padded: bool) -> None:
    """Outputs of 1, 2 and 4 tokens and prompts of 10, 11, 12 tokens (request n has
    10 + n): the prefill rectangle is 3 x 12, then the finished rows are held
    (ragged) or decoded again (padded) until the 4-token one ends."""
    scheduler = DynamicScheduler(BlockPool(64, BLOCK), CONFIG, frozenset({EOS}), padded)
    seqs = [request(n, arrival=0.0, max_tokens=m) for n, m in enumerate((1, 2, 4))]
    for seq in seqs:
        scheduler.add(seq)
    plans = []
    for t in (0.010, 0.020, 0.030, 0.040):
        plan = scheduler.schedule(t)
        plans.append((plan.slot_steps(), list(plan.decode), list(plan.pad)))
        rows = plan.sampling()
        scheduler.postprocess(plan, [7] * len(rows), [0.0] * len(rows), t)
    assert scheduler.idle
    prefill = plans[0][0]
    assert (prefill.active, prefill.finished, prefill.padding) == (33, 0, 3)
    finished_per_step = [0, 1, 2, 2]  # after step 1 r0 is done, after step 2 r1 too
    for (slots, decode, pad), done in zip(plans[1:], finished_per_step[1:], strict=True):
        assert slots.active == len(decode) == 3 - done
        assert (slots.finished, slots.padding) == ((0, done) if padded else (done, 0))
        assert [s.finish_reason is not None for s in pad] == [True] * (done if padded else 0)
