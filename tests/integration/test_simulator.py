"""Simulator sanity: conservation, determinism, the engine semantics it claims, the tuning
loop, fast-forward changing nothing (test_simulator_replay.py checks it against the
engine itself), and the fleet: routing, startup, drains, replica-seconds, autoscaling."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pytest
from batchpilot_operator.policy.round import Decision
from batchpilot_operator.policy.types import Fleet, Goal, ReplicaBounds, ReplicaState, ScaleDecision
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.scheduler_continuous import ContinuousScheduler
from batchpilot_tools.simulator import (
    Scenario,
    SimOptions,
    SimResult,
    SimulatedFleet,
    StepCurve,
    Workload,
    make_workload,
    simulate,
    simulate_workload,
    static,
)

CURVE = StepCurve.from_points({1: 0.002, 64: 0.02}, "test")
SLO = Slo(e2e_s=2.0)
SHORT = Scenario("steady", 600.0, 10.0, output_tokens=32, prompt_tokens=(8, 32))


def options(mode: str, **changes: object) -> SimOptions:
    base = SimOptions(mode=mode, config=BatchingConfig(), goal=Goal(SLO))  # type: ignore[arg-type]
    return replace(base, **changes)  # type: ignore[arg-type]


DRAIN_S = 300.0  # time after the last arrival for every queued request to finish


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_every_admitted_request_completes(mode: str) -> None:
    work = make_workload(SHORT, seed=3)
    result = simulate(SHORT, static(options(mode), BatchingConfig()), CURVE, 3, DRAIN_S)
    assert result.rejected == 0
    assert result.completed == result.arrived == len(work.arrivals) > 0


def test_preempted_sequences_still_complete() -> None:
    # A KV pool far too small for 64 long sequences: continuous mode must preempt.
    tight = options("continuous", kv_blocks=60)
    scenario = replace(SHORT, base_rate=20.0, output_tokens=96)
    config = BatchingConfig(max_batch_size=64)
    result = simulate(scenario, static(tight, config), CURVE, 1, DRAIN_S)
    assert sum(iv.preemptions for iv in result.intervals) > 0
    assert result.completed == result.arrived - result.rejected > 0


def test_queue_overflow_is_rejected_not_lost() -> None:
    flood = replace(SHORT, base_rate=200.0)
    small = BatchingConfig(max_batch_size=1, max_queue_size=16)
    result = simulate(flood, static(options("continuous"), small), CURVE, 2, DRAIN_S)
    assert result.rejected > 0
    assert result.completed + result.rejected == result.arrived


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
def test_deterministic_with_a_seed(mode: str) -> None:
    first = simulate(SHORT, options(mode), CURVE, seed=7)
    again = simulate(SHORT, options(mode), CURVE, seed=7)
    other = simulate(SHORT, options(mode), CURVE, seed=8)
    trace = [(iv.p99_s, iv.config, iv.decision) for iv in first.intervals]
    assert trace == [(iv.p99_s, iv.config, iv.decision) for iv in again.intervals]
    assert first.good == again.good
    assert [iv.p99_s for iv in other.intervals] != [iv.p99_s for iv in first.intervals]


def _judged(decision: Decision | None) -> tuple[object, ...] | None:
    return None if decision is None else (decision.config, decision.action, decision.reason)


def two_requests(outputs: tuple[int, int]) -> Workload:
    return Workload(np.array([0.0, 0.001]), np.array([8, 8]), np.array(outputs))


def test_dynamic_batches_hold_every_member_until_the_longest_ends() -> None:
    """A 10-token and a 100-token request in one batch finish together (the hostage effect)."""
    config = BatchingConfig(max_batch_size=2, batch_timeout_ms=50.0)
    result = simulate_workload(
        two_requests((10, 100)), static(options("dynamic"), config), CURVE, 60.0
    )
    first, second = result.intervals[0].latencies
    assert first == pytest.approx(second + 0.001)


def test_continuous_batching_lets_the_short_request_leave_first() -> None:
    config = BatchingConfig(max_batch_size=2, batch_timeout_ms=50.0)
    result = simulate_workload(
        two_requests((10, 100)), static(options("continuous"), config), CURVE, 60.0
    )
    short, long = result.intervals[0].latencies
    assert short < long / 5


def test_the_tuning_loop_runs_every_interval_and_acts_on_overload() -> None:
    overload = replace(SHORT, base_rate=60.0)
    start = BatchingConfig(max_batch_size=1, batch_timeout_ms=0.0)
    result = simulate(overload, options("continuous", config=start), CURVE, seed=4)
    decisions = [iv.decision for iv in result.intervals]
    assert all(d is not None for d in decisions)
    assert len(decisions) == int(SHORT.duration_s // 30.0)
    assert max(iv.config.max_batch_size for iv in result.intervals if iv.config) > 1


def test_dynamic_throughput_grows_with_the_batch_under_overload() -> None:
    overload = replace(SHORT, base_rate=80.0)
    small = simulate(overload, static(options("dynamic"), BatchingConfig(2)), CURVE, seed=5)
    large = simulate(overload, static(options("dynamic"), BatchingConfig(32)), CURVE, seed=5)
    assert large.completed > small.completed


def test_step_curve_prefers_the_measured_file(tmp_path: Path) -> None:
    path = tmp_path / "step_times.json"
    assert StepCurve.load(path).source.startswith("fallback")
    path.write_text(json.dumps({"model": "tiny", "step_seconds": {"1": 0.001, "8": 0.002}}))
    curve = StepCurve.load(path)
    assert curve.source == "measured: step_times.json"
    assert curve.step_s(4) == pytest.approx(0.001 + 3 * (0.001 / 7))
    assert curve.step_s(16) == pytest.approx(0.002 + 8 * (0.001 / 7))  # extrapolated
    path.write_text(json.dumps({"model": "tiny"}))
    with pytest.raises(ValueError, match="no \\{batch size: seconds\\} mapping"):
        StepCurve.load(path)


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
@pytest.mark.parametrize(
    "kv_blocks", [pytest.param(4096, id="ample-kv"), pytest.param(90, id="tight-kv")]
)
def test_fast_forward_changes_no_completion(mode: str, kv_blocks: int) -> None:
    """Steps applied together complete every request at the same time and step as steps
    planned one by one, with the same batch sizes, preemptions and rejections."""
    bursts = Scenario("bursts", 120.0, 25.0, output_tokens=64, prompt_tokens=(8, 32))
    traced = options(mode, kv_blocks=kv_blocks, trace=True, config=BatchingConfig(24, 10.0))
    fast = simulate(bursts, traced, CURVE, seed=2, drain_s=DRAIN_S)
    slow = simulate(bursts, replace(traced, fast_forward=False), CURVE, seed=2, drain_s=DRAIN_S)
    # Steps summed one by one and multiplied together round differently in the last bit.
    assert [(c.request, c.step) for c in fast.completions] == [
        (c.request, c.step) for c in slow.completions
    ]
    assert [c.at_s for c in fast.completions] == pytest.approx([c.at_s for c in slow.completions])
    assert len(fast.completions) > 1000
    assert fast.batch_sizes == slow.batch_sizes
    assert fast.rejected == slow.rejected
    assert [iv.preemptions for iv in fast.intervals] == [iv.preemptions for iv in slow.intervals]
    # The same decisions; the capacity model's samples (busy seconds summed step by step or
    # multiplied) differ in the last bit only.
    assert [_judged(iv.decision) for iv in fast.intervals] == [
        _judged(iv.decision) for iv in slow.intervals
    ]
    if kv_blocks == 90 and mode == "continuous":
        assert sum(iv.preemptions for iv in fast.intervals) > 0


# -- the fleet: several servers behind a balancer ------------------------------------------


def spaced(outputs: list[int], gap_s: float) -> Workload:
    n = len(outputs)
    return Workload(np.arange(n) * gap_s, np.full(n, 8), np.array(outputs))


def test_round_robin_alternates_between_the_servers() -> None:
    fleet = options("continuous", replicas=2, balancer="round_robin", trace=True, tune=False)
    result = simulate_workload(spaced([2000] + [4] * 5, 0.5), fleet, CURVE, 60.0)
    assert result.routes == [0, 1, 0, 1, 0, 1]
    assert result.completed == 6


def test_least_outstanding_avoids_the_busy_server() -> None:
    """A long request holds server 0; every short one after it goes to the idle server 1."""
    fleet = options("continuous", replicas=2, balancer="least_outstanding", trace=True, tune=False)
    result = simulate_workload(spaced([2000] + [4] * 5, 0.5), fleet, CURVE, 60.0)
    assert result.routes == [0, 1, 1, 1, 1, 1]
    assert result.completed == 6


@dataclass(frozen=True)
class ScaleAt:
    """A replica controller that asks for `replicas` at the round at `at_s`, then holds."""

    at_s: float
    replicas: int

    def decide(
        self, signals: Signals, fleet: Fleet, state: ReplicaState, now: float
    ) -> ScaleDecision:
        if now == self.at_s:
            return ScaleDecision(self.replicas, "scale_out", "the test asks", state)
        return ScaleDecision(fleet.desired, "hold", "the test holds", state)


STARTUP_S = 40.0


def test_a_new_server_serves_after_the_startup_delay() -> None:
    work = make_workload(replace(SHORT, duration_s=180.0), seed=5)
    fleet = options(
        "continuous", trace=True, tune=False, startup_s=STARTUP_S, controller=ScaleAt(30.0, 2)
    )
    result = simulate_workload(work, fleet, CURVE, 180.0)
    ready_at = 30.0 + STARTUP_S
    routed = [(float(at), server) for at, server in zip(work.arrivals, result.routes, strict=True)]
    assert all(server == 0 for at, server in routed if at < ready_at)
    assert {server for at, server in routed if at >= ready_at} == {0, 1}
    assert [(iv.replicas, iv.ready) for iv in result.intervals[:3]] == [(2, 1), (2, 1), (2, 2)]
    # Replica-seconds add up: server 0 for the whole run, server 1 from its decision on.
    assert result.replica_seconds == pytest.approx(180.0 + (180.0 - 30.0))


def test_scale_in_drains_without_losing_a_request() -> None:
    busy = replace(SHORT, duration_s=120.0, base_rate=15.0, output_tokens=64)
    fleet = options("continuous", replicas=3, tune=False, controller=ScaleAt(30.0, 1))
    result = simulate(busy, fleet, CURVE, seed=6, drain_s=DRAIN_S)
    assert result.rejected == 0
    assert result.completed + result.rejected == result.arrived > 0
    assert [(iv.pods, iv.ready) for iv in result.intervals[:2]] == [(3, 1), (1, 1)]
    # The two drained servers ran from 0 past the scale-in (their last requests), not to the end.
    run_s = busy.duration_s + DRAIN_S
    longest_s = max(max(iv.latencies) for iv in result.intervals if iv.latencies)
    assert run_s + 2 * 30.0 < result.replica_seconds <= run_s + 2 * (30.0 + longest_s)


SURGE = Scenario(
    "step", 900.0, 20.0, output_tokens=32, prompt_tokens=(8, 32), step_at_s=120.0, peak=6.0,
    back_at_s=420.0,
)  # fmt: skip
AUTOSCALE = ReplicaBounds(1, 6, scale_down_stabilization_s=120.0)


@pytest.fixture(scope="module")
def surge() -> SimResult:
    return simulate(SURGE, options("continuous", goal=Goal(SLO, replicas=AUTOSCALE)), CURVE, 7)


def test_the_loop_grows_the_batch_then_scales_out_beyond_one_server(surge: SimResult) -> None:
    replicas = [iv.replicas for iv in surge.intervals]
    assert replicas[0] == 1 and max(replicas) > 1
    first_out = next(
        iv for iv in surge.intervals if iv.scale is not None and iv.scale.action == "scale_out"
    )
    # Knobs first: the round that scaled out had the batch grown (before it or with it).
    assert first_out.decision is not None
    assert first_out.decision.config.max_batch_size > BatchingConfig().max_batch_size
    assert surge.completed + surge.rejected <= surge.arrived


def test_the_loop_scales_back_in_after_the_load_falls(surge: SimResult) -> None:
    replicas = [iv.replicas for iv in surge.intervals]
    assert replicas[-1] < max(replicas)


# -- the LLM SLO: TTFT, TPOT, the per-request judgement, the prefill budget ----------------

# A flat 10 ms step plus 1 ms per KV token attended: a prefill of P tokens takes 10 + P ms,
# the decode step at context T takes 10 + T ms, so a request's TTFT and TPOT are exact.
FLAT = replace(StepCurve.from_points({1: 0.01, 64: 0.01}, "test"), kv_token_s=0.001)
LLM_SLO = Slo(ttft_s=0.030, tpot_s=0.040)
# (prompt, output) -> TTFT = 10 + P ms; TPOT = 10 + P + O/2 ms (contexts P+1 .. P+O-1)
JUDGED = [(5, 5), (25, 2), (5, 61), (25, 41), (5, 1)]


def judged_run(requests: list[tuple[int, int]]) -> SimResult:
    """One request at a time (each arrives 5 s after the last, when it is done), batch 1."""
    work = Workload(
        arrivals=np.arange(len(requests), dtype=float) * 5.0,
        prompts=np.array([p for p, _ in requests]),
        outputs=np.array([o for _, o in requests]),
    )
    config = BatchingConfig(max_batch_size=1, slo=LLM_SLO.targets())
    opts = SimOptions(mode="continuous", config=config, goal=Goal(LLM_SLO), tune=False)
    return simulate_workload(work, opts, FLAT, run_s=60.0)


def test_each_request_is_judged_exactly_on_ttft_and_tpot() -> None:
    result = judged_run(JUDGED)
    ivs = result.intervals
    ttfts = sorted(x for iv in ivs for x in iv.ttfts)
    tpots = sorted(x for iv in ivs for x in iv.tpots)
    assert ttfts == pytest.approx(sorted(0.010 + 0.001 * p for p, _ in JUDGED))
    # the one-token answer has no TPOT
    assert tpots == pytest.approx(sorted(0.010 + 0.001 * (p + o / 2) for p, o in JUDGED if o > 1))
    # (5,5) and (5,1) meet both; (25,2) misses TTFT; (5,61) TPOT; (25,41) both
    assert sum(iv.slo_judged for iv in ivs) == 5
    assert sum(iv.slo_met for iv in ivs) == 2 == result.good
    missed = {name: sum(iv.slo_missed.get(name, 0) for iv in ivs) for name in ("ttft", "tpot")}
    assert missed == {"ttft": 2, "tpot": 2}
    assert sum(iv.slo_missed.get("all", 0) for iv in ivs) == 3


def test_the_window_signals_carry_the_slo_and_the_step_counters() -> None:
    result = judged_run(JUDGED)
    first = result.intervals[0]
    assert first.attainment == pytest.approx(2 / 5)
    # steps: one prefill per request, then output - 1 decode steps each
    assert first.steps == sum(o for _, o in JUDGED)
    assert first.step_prefill_tokens == sum(p for p, _ in JUDGED)
    assert first.step_decode_rows == sum(o - 1 for _, o in JUDGED)
    # prefills attend to their prompt, decode steps to contexts P+1 .. P+O-1
    kv = sum(p + sum(range(p + 1, p + o)) for p, o in JUDGED)
    assert first.step_kv_tokens == kv
    assert first.step_seconds == pytest.approx(0.010 * first.steps + 0.001 * kv)


def test_a_refused_request_misses_every_stated_target() -> None:
    flood = Workload(np.zeros(4), np.full(4, 5), np.full(4, 5))
    config = BatchingConfig(max_batch_size=1, max_queue_size=2, slo=LLM_SLO.targets())
    opts = SimOptions(mode="continuous", config=config, goal=Goal(LLM_SLO), tune=False)
    result = simulate_workload(flood, opts, FLAT, run_s=60.0)
    ivs = result.intervals
    assert result.rejected == 2
    assert sum(iv.slo_judged for iv in ivs) == 4
    assert sum(iv.slo_missed.get("ttft", 0) for iv in ivs) >= 2
    assert sum(iv.slo_missed.get("tpot", 0) for iv in ivs) >= 2


CHAT = Scenario(
    "steady", 300.0, 4.0, output_tokens=120, prompt_tokens=(200, 2000), output_range=(20, 220)
)
CHAT_CURVE = StepCurve.from_points({1: 0.002, 64: 0.02}, "test").with_kv_cost(2e-7)


def chat_p99s(budget: int) -> tuple[float, float]:
    config = BatchingConfig(max_batch_size=32, prefill_token_budget=budget)
    result = simulate(CHAT, static(options("continuous"), config), CHAT_CURVE, seed=4)
    ttft = np.percentile([x for iv in result.intervals for x in iv.ttfts], 99)
    tpot = np.percentile([x for iv in result.intervals for x in iv.tpots], 99)
    return float(ttft), float(tpot)


def test_a_smaller_prefill_budget_trades_ttft_for_tpot() -> None:
    small_ttft, small_tpot = chat_p99s(128)
    large_ttft, large_tpot = chat_p99s(4096)
    assert small_ttft > large_ttft, (small_ttft, large_ttft)
    assert small_tpot < large_tpot, (small_tpot, large_tpot)


def test_the_prefill_budget_is_live() -> None:
    work = spaced([8, 8], gap_s=1.0)
    fleet = SimulatedFleet(work, options("continuous", tune=False), CURVE)
    asyncio.run(fleet.apply(BatchingConfig(prefill_token_budget=64)))
    scheduler = fleet.servers[0].scheduler
    assert isinstance(scheduler, ContinuousScheduler)
    assert scheduler.config.prefill_token_budget == 64


def test_fast_forward_with_attention_cost_changes_no_completion() -> None:
    bursts = Scenario("bursts", 120.0, 25.0, output_tokens=64, prompt_tokens=(8, 32))
    traced = options("continuous", trace=True, tune=False, config=BatchingConfig(24, 10.0))
    curve = CURVE.with_kv_cost(1e-5)
    fast = simulate(bursts, traced, curve, seed=2, drain_s=DRAIN_S)
    slow = simulate(bursts, replace(traced, fast_forward=False), curve, seed=2, drain_s=DRAIN_S)
    assert [(c.request, c.step) for c in fast.completions] == [
        (c.request, c.step) for c in slow.completions
    ]
    assert [c.at_s for c in fast.completions] == pytest.approx([c.at_s for c in slow.completions])
    for name in ("steps", "step_decode_rows", "step_kv_tokens"):
        assert [getattr(iv, name) for iv in fast.intervals] == [
            getattr(iv, name) for iv in slow.intervals
        ], name


def test_the_window_signals_count_what_runs_as_evidence() -> None:
    """Eight long answers fill a batch of ten and two short ones finish beside them: the
    window carries the eight still running and is judged on them (two finished and none
    waiting alone are too little)."""
    requests = [(8, 20_000)] * 8 + [(8, 8)] * 2
    work = Workload(
        arrivals=np.zeros(len(requests)),
        prompts=np.array([p for p, _ in requests]),
        outputs=np.array([o for _, o in requests]),
    )
    config = BatchingConfig(max_batch_size=10, batch_timeout_ms=0.0)
    fleet = SimulatedFleet(work, static(options("continuous", kv_blocks=16_384), config), CURVE)
    asyncio.run(fleet.run(30.0))
    signals = asyncio.run(fleet.read(30.0))
    assert (signals.requests, signals.waiting, signals.running) == (2, 0, 8)
    assert signals.status == "ok" and signals.p99_latency_s is not None


def test_a_prompt_beside_decode_rows_is_one_forward() -> None:
    # The engine computes a step's prompt tokens and decode rows in one forward (one read
    # of the weights), so the fixed cost of a step is paid once: A's decode step that
    # takes in B's prompt costs a step of 1 + 10 rows, not one of 1 and one of 10.
    sloped = StepCurve.from_points({1: 0.010, 101: 0.020}, "test")
    work = Workload(
        arrivals=np.array([0.0, 0.015]),  # B arrives during A's first decode step
        prompts=np.array([4, 10]),
        outputs=np.array([3, 1]),
    )
    config = BatchingConfig(max_batch_size=4, batch_timeout_ms=0.0)
    opts = SimOptions(mode="continuous", config=config, goal=Goal(SLO), tune=False)
    first = simulate_workload(work, opts, sloped, run_s=30.0).intervals[0]
    # A's prefill; A's first decode step; A's last decode row with B's prompt
    assert (first.steps, first.step_decode_rows, first.step_prefill_tokens) == (3, 2, 14)
    assert first.step_seconds == pytest.approx(
        sloped.step_s(4) + sloped.step_s(1) + sloped.step_s(1 + 10)
    )
