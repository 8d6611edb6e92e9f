"""The replica rule: when the pod count moves, by how much, and when it must not."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from batchpilot_operator.replica_rule import (
    SCALE_IN_UTILISATION,
    SCALE_OUT_UTILISATION,
    Capacity,
    Fleet,
    ReplicaBounds,
    ReplicaCase,
    ReplicaState,
    ScaleChange,
    ScaleDecision,
    decide_replicas,
)
from batchpilot_operator.signals import Signals

BOUNDS = ReplicaBounds(min_replicas=1, max_replicas=8, scale_down_stabilization_s=300.0)
PER_POD_RPS = 10.0  # what the model says one pod carries at the batch limit


def window(pods: int, **fields: float | None) -> Signals:
    """A window of `pods` pods; by default the SLO (0.5 s) broken from queueing."""
    base: dict[str, float | None] = {
        "requests": 540 * pods, "request_rate": 9.0 * pods, "p99_latency_s": 0.9,
        "queue_wait_p99_s": 0.6, "waiting": 40.0,
    }  # fmt: skip
    base.update(fields)
    return replace(Signals(status="ok", window_s=60, **base), pods=pods)  # type: ignore[arg-type]


def capacity(demand: float, per_pod: float = PER_POD_RPS) -> Capacity:
    return Capacity(batch_limit=32, per_pod_rps=per_pod, demand_rps=demand, prediction="line",
                    windows=4)  # fmt: skip


def case(
    signals: Signals,
    *,
    desired: int = 1,
    ready: int | None = None,
    spent: bool = True,
    cap: Capacity | None = None,
    state: ReplicaState | None = None,
    now: float = 10_000.0,
    bounds: ReplicaBounds = BOUNDS,
) -> ReplicaCase:
    if cap is not None and signals.arrival_rate is None:
        # the rule sizes for the arrivals; the capacity's demand adds the knobs' backlog
        signals = replace(signals, arrival_rate=cap.demand_rps)
    return ReplicaCase(
        signals=signals, slo_s=0.5, band=0.2, queue_share=0.5, knobs_spent=spent, capacity=cap,
        fleet=Fleet(desired, desired if ready is None else ready), bounds=bounds,
        state=state or ReplicaState(), now=now,
    )  # fmt: skip


def quiet(pods: int) -> Signals:
    # a request waiting on an idle pod's batch timeout is no queueing
    return window(pods, p99_latency_s=0.2, queue_wait_p99_s=0.0, waiting=1.0)


def test_scale_out_is_sized_from_the_per_pod_throughput_not_one_pod_at_a_time() -> None:
    decision = decide_replicas(case(window(1), cap=capacity(demand=35.0)))
    # 35 req/s over 10 req/s per pod at 80 % busy: ceil(4.375) = 5
    assert (decision.action, decision.replicas) == ("scale_out", 5)
    assert "1 -> 5 replicas" in decision.reason and "batch is spent" in decision.reason
    assert "model at batch 32" in decision.reason
    assert decision.state.last_change == ScaleChange(10_000.0, 1, 5)


def test_the_knobs_go_first_while_the_batch_can_still_grow() -> None:
    # the model's batch limit carries 10 req/s a pod: 8 is the knobs' to serve
    decision = decide_replicas(case(window(1), spent=False, cap=capacity(8.0)))
    assert (decision.action, decision.replicas) == ("hold", 1)
    assert "knobs first" in decision.reason


def test_knobs_and_pods_move_together_when_the_knobs_cannot_carry_the_demand() -> None:
    # the model: 35 req/s over the 10 the batch limit carries
    decision = decide_replicas(case(window(1), spent=False, cap=capacity(35.0)))
    assert (decision.action, decision.replicas) == ("scale_out", 5)
    # without one, however short the pods fall, the knobs go first
    within = decide_replicas(case(window(1, arrival_rate=60.0), spent=False))
    assert within.action == "hold" and "knobs first" in within.reason


def test_without_a_model_a_saturated_pod_measures_the_step() -> None:
    # queueing pods finish what they can: 9 req/s each; demand (arrivals) 30 req/s
    decision = decide_replicas(case(window(2, arrival_rate=30.0), desired=2))
    assert (decision.action, decision.replicas) == ("scale_out", 5)  # ceil(30 / 7.2)
    assert "measured: finished per busy second" in decision.reason


def test_without_a_model_a_pod_busy_part_time_carries_more() -> None:
    # 2 pods finish 9 req/s each while busy 30 % of the window: 30 req/s each when busy
    signals = replace(quiet(2), busy_s_per_token=0.3 / 100.0, tokens_per_s=200.0)
    assert signals.utilisation == pytest.approx(0.3)
    decision = decide_replicas(case(signals, desired=2, bounds=replace(
        BOUNDS, scale_down_stabilization_s=0.0)))  # fmt: skip
    # 18 req/s over 30 per pod at 60 % busy: one pod
    assert (decision.action, decision.replicas) == ("scale_in", 1)


def test_a_predicted_overload_scales_out_before_the_slo_breaks() -> None:
    signals = window(1, p99_latency_s=0.3, queue_wait_p99_s=0.05)
    decision = decide_replicas(case(signals, cap=capacity(demand=15.0)))
    assert (decision.action, decision.replicas) == ("scale_out", 2)
    assert "exceeds what 1 pod(s) carry" in decision.reason


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"ready": 2, "desired": 4}, "2 of 4 pods ready"),
        ({"desired": 8}, "at maxReplicas 8"),
    ],
)
def test_holds_while_pods_start_or_at_the_maximum(kwargs: dict[str, int], words: str) -> None:
    desired = kwargs["desired"]
    decision = decide_replicas(case(window(desired), cap=capacity(200.0), **kwargs))
    assert (decision.action, decision.replicas) == ("hold", desired)
    assert words in decision.reason
    assert decision.settling == (kwargs.get("ready", desired) < desired)


def test_holds_until_the_window_covers_every_pod() -> None:
    decision = decide_replicas(case(window(2), desired=3, cap=capacity(200.0)))
    assert decision.action == "hold" and "covers 2 of 3 pods" in decision.reason
    assert decision.settling  # the loop restarts the window: the next shows all three
    assert not decide_replicas(case(window(3), desired=3, cap=capacity(20.0))).settling


def test_scale_up_stabilization_delays_a_second_step() -> None:
    bounds = replace(BOUNDS, scale_up_stabilization_s=120.0)
    state = ReplicaState(last_change=ScaleChange(9_950.0, 1, 2))
    held = decide_replicas(case(window(2), desired=2, cap=capacity(60.0), state=state,
                                bounds=bounds))  # fmt: skip
    assert held.action == "hold" and "scale-up stabilization" in held.reason
    later = decide_replicas(case(window(2), desired=2, cap=capacity(60.0), state=state,
                                 bounds=bounds, now=10_100.0))  # fmt: skip
    assert later.action == "scale_out"


def run_rounds(
    signals: list[Signals], demands: list[float], desired: int, start: float = 10_000.0
) -> list[ScaleDecision]:
    """Rounds every 30 s with the rule's own state and fleet carried over."""
    state, decisions = ReplicaState(), []
    for i, (signal, demand) in enumerate(zip(signals, demands, strict=True)):
        decision = decide_replicas(case(replace(signal, pods=desired), desired=desired,
                                        cap=capacity(demand), state=state,
                                        now=start + 30.0 * i))  # fmt: skip
        state, desired = decision.state, decision.replicas
        decisions.append(decision)
    return decisions


def test_scale_in_waits_a_whole_window_and_takes_its_highest_recommendation() -> None:
    # 4 pods; demand falls to 14 req/s (3 pods at 60 %) for the first 5 minutes, then 8 (2)
    demands = [14.0] * 10 + [8.0] * 12
    decisions = run_rounds([quiet(4)] * len(demands), demands, desired=4)
    actions = [d.action for d in decisions]
    first = actions.index("scale_in")
    # nothing moves before a whole 300 s of recommendations below 4
    assert first == 10 and decisions[first].replicas == 3
    assert "for 300 s" in decisions[first].reason
    # the next step waits a window after that change, then goes to the new need
    second = actions.index("scale_in", first + 1)
    assert (second - first) * 30.0 >= 300.0 and decisions[second].replicas == 2
    assert all(d.replicas >= BOUNDS.min_replicas for d in decisions)


def test_a_busy_round_within_the_window_keeps_the_count() -> None:
    demands = [8.0] * 12
    signals = [quiet(4)] * 12
    signals[6] = window(4, p99_latency_s=0.45, queue_wait_p99_s=0.0, waiting=0.0)  # in band
    decisions = run_rounds(signals, demands, desired=4)
    assert all(d.action == "hold" for d in decisions[:11])
    assert "were needed within the last 300 s" in decisions[10].reason


def test_never_below_min_replicas() -> None:
    bounds = replace(BOUNDS, min_replicas=2, scale_down_stabilization_s=0.0)
    decision = decide_replicas(case(quiet(3), desired=3, cap=capacity(0.5), bounds=bounds))
    assert (decision.action, decision.replicas) == ("scale_in", 2)
    floor = decide_replicas(case(quiet(2), desired=2, cap=capacity(0.5), bounds=bounds))
    assert floor.action == "hold"


def test_a_count_outside_the_bounds_is_brought_inside() -> None:
    decision = decide_replicas(case(quiet(12), desired=12, cap=capacity(1.0)))
    assert (decision.action, decision.replicas) == ("scale_in", 8)
    assert "outside autoscale's 1..8" in decision.reason


@pytest.mark.parametrize("seed", range(4))
def test_a_steady_load_never_reverses_the_count(seed: int) -> None:
    """Demand steady within +-10 %: whatever count the rule settles on, it never goes back."""
    rng = random.Random(seed)
    level = rng.uniform(5.0, 70.0)
    desired, state, directions = 1, ReplicaState(), []
    for i in range(200):
        demand = level * rng.uniform(0.9, 1.1)
        # p99 over the SLO exactly when the pods run past 80 % of what they carry
        busy = demand / (desired * PER_POD_RPS)
        signals = quiet(desired) if busy <= SCALE_OUT_UTILISATION else window(desired)
        decision = decide_replicas(case(signals, desired=desired, cap=capacity(demand),
                                        state=state, now=30.0 * i))  # fmt: skip
        if decision.action != "hold":
            directions.append(decision.action)
        state, desired = decision.state, decision.replicas
    assert directions in ([], ["scale_out"]), directions
    assert desired * PER_POD_RPS * SCALE_OUT_UTILISATION >= level * 0.9 or desired == 8


def climbing(rates: list[float], every_s: float = 30.0) -> ReplicaState:
    """A rule that saw these arrivals, one round each, ending `every_s` before 10 000 s."""
    start = 10_000.0 - every_s * len(rates)
    return ReplicaState(arrivals=tuple((start + i * every_s, r) for i, r in enumerate(rates)))


def test_a_steady_climb_scales_out_for_the_arrivals_a_new_pod_will_meet() -> None:
    # 16 req/s now on 2 pods that carry 10 each: no breach, no overload yet, but it
    # climbs 3 req/s a round; a pod started now serves in a round and shows in the next
    state = climbing([7.0, 10.0, 13.0])
    decision = decide_replicas(case(quiet(2), desired=2, cap=capacity(16.0), state=state))
    # 16 + 3/30 s x 60 s = 22 req/s: over 2 pods' 20 at 100 %, 3 pods at 80 %
    assert (decision.action, decision.replicas) == ("scale_out", 3)
    assert "rising to 22.00 req/s in 60 s" in decision.reason
    # the same arrivals without the climb: no scale-out
    flat = decide_replicas(case(quiet(2), desired=2, cap=capacity(16.0),
                                state=climbing([16.0, 16.0, 16.0])))  # fmt: skip
    assert flat.action == "hold"


def test_one_jump_is_no_trend() -> None:
    # a step (or a flash crowd's front) is sized for what arrives, not extrapolated
    state = climbing([10.0, 10.0, 10.0])
    decision = decide_replicas(case(window(1), cap=capacity(35.0), state=state))
    assert (decision.action, decision.replicas) == ("scale_out", 5)
    assert "rising" not in decision.reason


def test_the_lead_time_is_the_last_scale_outs_start_up() -> None:
    started = ReplicaState(ScaleChange(9_900.0, 1, 2), since=9_900.0)
    waiting = decide_replicas(case(quiet(2), desired=2, ready=1, state=started, now=9_930.0))
    assert waiting.state.startup_s is None
    ready = decide_replicas(case(quiet(2), desired=2, state=waiting.state, now=9_960.0))
    assert ready.state.startup_s == 60.0 and ready.state.last_change.ready_at == 9_960.0
    # a climb of 3 req/s a round then looks 30 s (a round) + 60 s (a start-up) ahead
    state = replace(climbing([7.0, 10.0, 13.0]), startup_s=60.0)
    decision = decide_replicas(case(quiet(2), desired=2, cap=capacity(16.0), state=state))
    assert "rising to 25.00 req/s in 90 s" in decision.reason


def test_state_round_trips_and_survives_garbage() -> None:
    state = ReplicaState(
        ScaleChange(12.5, 1, 3, ready_at=42.5), ((1.0, 3), (31.0, 2)), since=12.5,
        arrivals=((1.0, 4.5), (31.0, 6.0)), startup_s=30.0,
    )  # fmt: skip
    assert ReplicaState.from_dict(state.to_dict()) == state
    assert ReplicaState.from_dict(None) == ReplicaState()
    broken = {"lastChange": {"at": "x"}, "recommendations": [[1, 2], "bad", [None, None]]}
    assert ReplicaState.from_dict(broken) == ReplicaState(None, ((1.0, 2),))


def test_a_restarted_rule_resumes_mid_scaling_without_a_second_step() -> None:
    saved = ReplicaState(ScaleChange(9_990.0, 1, 3)).to_dict()
    decision = decide_replicas(case(window(1), desired=3, ready=1, cap=capacity(100.0),
                                    state=ReplicaState.from_dict(saved)))  # fmt: skip
    assert (decision.action, decision.replicas) == ("hold", 3)


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError, match="1 <= min <= max"):
        ReplicaBounds(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="1 <= min <= max"):
        ReplicaBounds(min_replicas=0)
    with pytest.raises(ValueError, match="negative"):
        ReplicaBounds(scale_down_stabilization_s=-1)
    assert SCALE_IN_UTILISATION < SCALE_OUT_UTILISATION  # the band that stops flapping


def test_pods_are_sized_for_the_arrivals_not_the_backlog() -> None:
    # the knobs' demand adds a queue to drain (35 req/s); 8 arrive: the model's pod carries it
    signals = window(1, arrival_rate=8.0, p99_latency_s=0.3, queue_wait_p99_s=0.05)
    decision = decide_replicas(case(signals, spent=False, cap=capacity(demand=35.0)))
    assert decision.action == "hold"


def test_a_young_model_does_not_scale_in_on_its_own_word() -> None:
    bounds = replace(BOUNDS, scale_down_stabilization_s=0.0)
    young = replace(capacity(8.0, per_pod=100.0), windows=2)
    # measured: 2 pods finish 9 req/s each, busy all along (no busy-time series: saturated)
    signals = replace(quiet(2), queue_wait_p99_s=0.15)
    held = decide_replicas(case(signals, desired=2, cap=young, bounds=bounds))
    assert held.action == "hold"  # 18 req/s over 9 a pod at 60 %: both pods stay
    grown = decide_replicas(case(signals, desired=2, cap=replace(young, windows=3),
                                 bounds=bounds))  # fmt: skip
    assert (grown.action, grown.replicas) == ("scale_in", 1)
    assert "model at batch 32" in grown.reason


def test_a_line_through_two_windows_moves_no_pods() -> None:
    # two windows' line says no batch carries 35 req/s; the pods are measured instead
    young = replace(capacity(35.0), windows=2)
    signals = window(1, arrival_rate=35.0, p99_latency_s=0.3, queue_wait_p99_s=0.05)
    assert decide_replicas(case(signals, spent=False, cap=young)).action == "hold"
