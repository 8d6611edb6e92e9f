"""The simulator's SLO classes: each request judged against its class's targets and
served in the real schedulers' class order, its fast-forward predicting admission by
that order; short simulated runs on a fixed trace."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from batchpilot_operator.policy.types import Goal
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import (
    SimOptions,
    SimulatedFleet,
    StepCurve,
    Workload,
    merge_workloads,
    simulate_workload,
)

CURVE = StepCurve.from_points({1: 0.002, 64: 0.02}, "test")
# "fast" misses whatever happens (a TTFT no step meets); "slow" meets whatever happens
FAST = SloClass("fast", priority=10, ttft_s=1e-6, attainment=0.9)
SLOW = SloClass("slow", priority=0, e2e_s=1000.0, attainment=0.9)
SLO = Slo(e2e_s=1000.0, classes=(FAST, SLOW))


def work(trace: list[tuple[float, int, int, str]]) -> Workload:
    """(arrival, prompt, output, class) per request."""
    return Workload(
        arrivals=np.array([t for t, *_ in trace]),
        prompts=np.array([p for _, p, _, _ in trace]),
        outputs=np.array([o for _, _, o, _ in trace]),
        classes=tuple(c for *_, c in trace),
    )


def options(**changes: object) -> SimOptions:
    base = SimOptions(
        mode="continuous", config=BatchingConfig(max_batch_size=1, batch_timeout_ms=0.0),
        goal=Goal(SLO), tune=False, trace=True,
    )  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def test_merged_workloads_keep_arrival_order_and_name_each_class() -> None:
    a = Workload(np.array([0.0, 2.0]), np.array([1, 2]), np.array([3, 4]))
    b = Workload(np.array([1.0, 2.0]), np.array([5, 6]), np.array([7, 8]))
    merged = merge_workloads({"fast": a, "slow": b})
    assert merged.arrivals.tolist() == [0.0, 1.0, 2.0, 2.0]
    assert merged.prompts.tolist() == [1, 5, 2, 6]  # a tie: in the parts' order
    assert merged.classes == ("fast", "slow", "fast", "slow")


def test_each_request_is_judged_against_its_own_class() -> None:
    trace = [(i * 0.5, 8, 4, "fast" if i % 2 else "slow") for i in range(10)]
    result = simulate_workload(work(trace), options(), CURVE, run_s=30.0)
    (iv,) = result.intervals
    fast, slow = iv.classes["fast"], iv.classes["slow"]
    assert (fast.slo_judged, fast.slo_met, fast.attainment) == (5, 0, 0.0)
    assert fast.slo_missed == {"ttft": 5, "all": 5}
    assert (slow.slo_judged, slow.slo_met, slow.attainment) == (5, 5, 1.0)
    assert (fast.good, slow.good) == (0, 5)  # the policy's class targets
    assert (iv.slo_judged, iv.slo_met, iv.good) == (10, 5, 5)  # the totals: both classes
    totals = result.classes
    assert totals["fast"].arrived == totals["fast"].completed == 5
    assert totals["slow"].good == 5 and totals["slow"].lost == 0
    assert totals["slow"].unfinished == totals["slow"].rejected == 0


def test_the_signals_carry_each_class_as_the_pods_label_it() -> None:
    trace = [(i * 0.5, 8 if i % 2 else 900, 4 if i % 2 else 60, "fast" if i % 2 else "slow")
             for i in range(10)]  # fmt: skip
    fleet = SimulatedFleet(work(trace), options(), CURVE)
    asyncio.run(fleet.run(30.0))
    signals = asyncio.run(fleet.read(30.0))
    assert set(signals.classes) == {"fast", "slow"}
    assert signals.classes["fast"].attainment == 0.0
    assert signals.classes["slow"].attainment == 1.0
    assert signals.classes["slow"].p99_latency_s is not None
    fast, slow = signals.classes["fast"], signals.classes["slow"]
    # each class's lengths in the generation-token buckets, as the pods' histograms
    assert fast.prompt_tokens_p99 is not None and fast.prompt_tokens_p99 <= 8
    assert slow.prompt_tokens_p10 is not None and slow.prompt_tokens_p10 > 512
    assert fast.output_tokens_p99 is not None and fast.output_tokens_p99 <= 4
    assert slow.output_tokens_p50 is not None and slow.output_tokens_p50 > 32
    assert (signals.slo_judged, signals.slo_met) == (10, 5)


def test_without_classes_nothing_is_kept_by_class() -> None:
    plain = Workload(np.array([0.0, 0.1]), np.array([8, 8]), np.array([4, 4]))
    result = simulate_workload(plain, options(goal=Goal(Slo(e2e_s=10.0))), CURVE, run_s=30.0)
    assert result.completed == 2 and result.classes == {}
    assert all(iv.classes == {} for iv in result.intervals)


def test_a_class_the_policy_lacks_is_refused() -> None:
    with pytest.raises(ValueError, match="nightly"):
        simulate_workload(work([(0.0, 8, 4, "nightly")]), options(), CURVE, run_s=10.0)


def completion_order(**changes: object) -> list[int]:
    # One slot; everything queued at once, the high class last in arrival order.
    trace = [(0.0, 8, 4, "slow"), (0.0, 8, 4, "slow"), (0.0, 8, 4, "fast"),
             (0.0, 8, 4, "fast")]  # fmt: skip
    result = simulate_workload(work(trace), options(**changes), CURVE, run_s=30.0)
    return [c.request for c in result.completions]


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
def test_the_real_schedulers_serve_the_higher_class_first(mode: str) -> None:
    assert completion_order(mode=mode) == [2, 3, 0, 1]


def test_the_age_bound_comes_from_the_options() -> None:
    assert completion_order(class_max_wait_s=0.0) == [0, 1, 2, 3]  # arrival order


def run(
    trace: list[tuple[float, int, int, str]], fast_forward: bool, kv_blocks: int, **changes: object
) -> list[tuple[int, float, int]]:
    """(request, when, step) per completion; blocks of 16 tokens."""
    opts = options(
        config=BatchingConfig(max_batch_size=4, batch_timeout_ms=0.0),
        kv_blocks=kv_blocks, block_size=16, fast_forward=fast_forward, **changes,
    )  # fmt: skip
    result = simulate_workload(work(trace), opts, CURVE, run_s=60.0)
    assert result.completed == len(trace)
    return [(c.request, round(c.at_s, 9), c.step) for c in result.completions]


def test_fast_forward_admits_the_top_ranked_request_not_the_queue_head() -> None:
    """A long low-class prompt heads the queue and cannot fit; a short high-class one
    behind it can and is admitted at once: fast-forward must not run past it."""
    # 24 blocks: the first request holds 2 to 14, the long prompt needs 23
    trace = [(0.0, 16, 200, "slow"), (0.001, 360, 10, "slow"), (0.002, 8, 5, "fast")]
    steps = run(trace, fast_forward=True, kv_blocks=24)
    assert steps == run(trace, fast_forward=False, kv_blocks=24)
    order = [request for request, *_ in steps]
    assert order.index(2) < order.index(0)  # the high class is served beside the first


def test_fast_forward_stops_where_a_low_class_ages_to_the_top() -> None:
    """A high-class long prompt waits for blocks at the top, a short low-class request
    ahead of it in the queue behind it; that one ranks first once it has waited the age
    bound, and fits: fast-forward must stop there."""
    # 30 blocks: the first request holds 2 to 26, the long prompt needs 29
    trace = [(0.0, 16, 400, "slow"), (0.001, 8, 5, "slow"), (0.002, 460, 10, "fast")]
    steps = run(trace, fast_forward=True, kv_blocks=30, class_max_wait_s=0.1)
    assert steps == run(trace, fast_forward=False, kv_blocks=30, class_max_wait_s=0.1)
    order = [request for request, *_ in steps]
    assert order.index(1) < order.index(0)
