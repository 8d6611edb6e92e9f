"""The AIMD fallback through the round (no step counters: the fit never forms): a legacy
end-to-end SLO moves as before, TTFT- and TPOT-only SLOs are read by their own p99s."""

from __future__ import annotations

import pytest
from batchpilot_operator.policy.memory import PolicyMemory
from batchpilot_operator.policy.round import decide
from batchpilot_operator.replica_rule import Fleet, ReplicaBounds
from batchpilot_operator.signals import Signals, traffic_status
from batchpilot_operator.slo import Slo
from batchpilot_operator.tuner import Bounds, Goal
from batchpilot_server.batching_config import BatchingConfig

E2E = Goal(Slo(e2e_s=1.0), Bounds(1, 64, 0.0, 200.0))
CURRENT = BatchingConfig(max_batch_size=8, batch_timeout_ms=10.0)


def signals(**values: object) -> Signals:
    base = dict(status="ok", window_s=30.0, requests=600.0, request_rate=20.0,
                kv_usage=0.2, mean_batch_size=8.0, pods=1)  # fmt: skip
    return Signals(**{**base, **values})  # type: ignore[arg-type]


def step(s: Signals, goal: Goal = E2E, current: BatchingConfig = CURRENT, **kw: object):
    return decide(s, current, goal, PolicyMemory(), **kw)  # type: ignore[arg-type]


def test_queueing_past_the_target_grows_the_batch_multiplicatively() -> None:
    d = step(signals(p99_latency_s=3.0, queue_wait_p99_s=2.5))
    assert d.action == "grow_batch" and d.config.max_batch_size == 12
    assert d.reason.startswith("AIMD (no step fit yet")
    assert d.memory.since_change == 0


def test_running_past_the_target_backs_off_and_remembers_a_ceiling() -> None:
    d = step(signals(p99_latency_s=1.5, queue_wait_p99_s=0.0))
    assert d.action == "backoff_batch" and d.config.max_batch_size == 5
    assert d.memory.ceiling == 8
    # the ceiling caps the growth that follows
    again = decide(signals(p99_latency_s=3.0, queue_wait_p99_s=2.5), d.config, E2E, d.memory)
    assert again.config.max_batch_size == 7


@pytest.mark.parametrize(
    ("changes", "cause"),
    [({"kv_usage": 0.95}, "KV usage 0.95 >= watermark"), ({"preemption_rate": 1.0}, "preempt")],
)
def test_kv_pressure_cuts_the_batch_whatever_the_headroom(changes: dict, cause: str) -> None:
    d = step(signals(p99_latency_s=0.1, **changes))
    assert d.action == "kv_guard" and d.config.max_batch_size == 6 and cause in d.reason


def test_headroom_with_requests_queueing_behind_full_batches_grows_additively() -> None:
    d = step(signals(p99_latency_s=0.5, queue_wait_p99_s=0.2))
    assert d.action == "grow_batch" and d.config.max_batch_size == 12


def test_ample_headroom_and_underfilled_batches_grow_the_timeout_without_a_ttft_target() -> None:
    quiet = signals(p99_latency_s=0.2, queue_wait_p99_s=0.0, mean_batch_size=2.0)
    grown = step(quiet)
    assert grown.action == "grow_timeout" and grown.config.batch_timeout_ms == 30.0
    with_ttft = Goal(Slo(ttft_s=1.0, e2e_s=1.0), E2E.bounds)
    assert step(quiet, with_ttft).action == "hold"  # a timeout only costs the first token


def test_windows_without_evidence_hold_and_say_why() -> None:
    thin = Signals(status="too_little_traffic", detail="only 3 requests finished")
    d = step(thin)
    assert d.action == "hold" and "only 3 requests finished" in d.reason
    assert d.memory.since_change == PolicyMemory().since_change  # capped, not moved


def test_a_config_outside_the_bounds_is_clamped_first() -> None:
    d = step(signals(p99_latency_s=0.1), current=BatchingConfig(max_batch_size=500))
    assert d.action == "clamp" and d.config.max_batch_size == 64


def test_a_tpot_only_slo_backs_off_on_its_own_p99() -> None:
    goal = Goal(Slo(tpot_s=0.02), E2E.bounds)
    d = step(signals(p99_latency_s=30.0, tpot_p99_s=0.05, ttft_p99_s=0.1), goal)
    assert (
        d.action == "backoff_batch" and d.reason.startswith("AIMD") and "tpot p99 50 ms" in d.reason
    )


def test_a_ttft_only_slo_grows_the_batch_when_requests_queue() -> None:
    goal = Goal(Slo(ttft_s=0.5), E2E.bounds)
    d = step(signals(p99_latency_s=30.0, ttft_p99_s=2.0, queue_wait_p99_s=1.9), goal)
    assert d.action == "grow_batch" and "ttft p99 2000 ms > target 500 ms" in d.reason


def test_a_queue_as_long_as_what_finished_is_evidence_for_a_slow_model() -> None:
    # SmolLM2 on two cores: 10 requests a window at batch 1, 25 waiting and more coming;
    # the demo's 30-request minimum no longer holds it
    assert traffic_status(10.0, 25.0, 30) == "ok"
    slow = signals(requests=10.0, request_rate=0.33, arrival_rate=1.2, waiting=25.0,
                   p99_latency_s=20.0, queue_wait_p99_s=15.0, mean_batch_size=1.0)  # fmt: skip
    d = step(slow, Goal(Slo(e2e_s=10.0), E2E.bounds), BatchingConfig(max_batch_size=1))
    assert d.action == "grow_batch" and d.config.max_batch_size > 1


def test_a_spent_batch_under_queueing_scales_out_by_measured_throughput() -> None:
    goal = Goal(Slo(e2e_s=1.0), Bounds(1, 8), replicas=ReplicaBounds(1, 4))
    spent = signals(p99_latency_s=3.0, queue_wait_p99_s=2.5, arrival_rate=50.0)
    d = step(spent, goal, fleet=Fleet(1, 1), now=100.0)
    assert d.action == "hold" and d.scale is not None
    assert d.scale.action == "scale_out" and d.scale.replicas == 4
    assert "the batch is spent" in d.scale.reason
