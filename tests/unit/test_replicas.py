"""When the fleet moves to the pods needed: bounds, settling, scale-up and scale-down
stabilization, and the rule's memory read back from a policy's status."""

from __future__ import annotations

from dataclasses import replace

from batchpilot_operator.policy.replicas import Need, observe, stabilize
from batchpilot_operator.policy.types import Fleet, ReplicaBounds, ReplicaState, ScaleChange
from batchpilot_operator.signals import Signals

OK = Signals(status="ok", pods=2, arrival_rate=10.0)
BOUNDS = ReplicaBounds(1, 5, scale_up_stabilization_s=0.0, scale_down_stabilization_s=300.0)
WATCHED = ReplicaState(since=0.0)


def test_a_count_outside_the_bounds_is_brought_inside_at_once() -> None:
    d = stabilize(Need(2, "x"), OK, Fleet(7, 7), BOUNDS, WATCHED, 10.0)
    assert (d.action, d.replicas) == ("scale_in", 5)
    assert "outside autoscale's 1..5" in d.reason


def test_a_fleet_still_moving_holds_and_settles() -> None:
    starting = stabilize(Need(4, "x"), OK, Fleet(3, 2), BOUNDS, WATCHED, 10.0)
    assert starting.action == "hold" and starting.settling
    assert "2 of 3 pods ready" in starting.reason
    partial = stabilize(Need(4, "x"), OK, Fleet(3, 3), BOUNDS, WATCHED, 10.0)
    assert partial.settling and "covers 2 of 3 pods" in partial.reason


def test_more_pods_scale_out_at_once_unless_stabilizing_or_at_the_maximum() -> None:
    out = stabilize(Need(4, "needs 4"), OK, Fleet(2, 2), BOUNDS, WATCHED, 10.0)
    assert (out.action, out.replicas) == ("scale_out", 4)
    assert out.reason == "2 -> 4 replicas: needs 4"
    assert out.state.last_change == ScaleChange(10.0, 2, 4)
    patient = ReplicaBounds(1, 5, scale_up_stabilization_s=60.0)
    held = stabilize(Need(5, "needs 5"), OK, Fleet(2, 2), patient, out.state, 30.0)
    assert held.action == "hold" and "scale-up stabilization" in held.reason
    at_max = stabilize(Need(9, "needs 9"), replace(OK, pods=5), Fleet(5, 5), BOUNDS, WATCHED, 10.0)
    assert at_max.action == "hold" and "held at 5 (maxReplicas 5" in at_max.reason


def test_scale_in_waits_the_window_and_takes_its_highest_recommendation() -> None:
    state, four = ReplicaState(since=0.0), replace(OK, pods=4)
    reasons = []
    for at, needed in [(100.0, 4), (200.0, 2), (350.0, 1)]:
        d = stabilize(Need(needed, f"needs {needed}"), four, Fleet(4, 4), BOUNDS, state, at)
        state = d.state
        reasons.append(d.reason)
        assert d.action == "hold"
    assert "this fleet watched for 200 s" in reasons[1]
    assert "held at 4 (4 were needed within the last 300 s" in reasons[2]
    d = stabilize(Need(1, "with headroom"), four, Fleet(4, 4), BOUNDS, state, 450.0)
    assert (d.action, d.replicas) == ("scale_in", 2)  # 2 was needed at 200 s, inside 300 s
    assert d.state.recommendations == ()  # they described another fleet


def test_no_judgement_holds() -> None:
    thin = Signals(status="too_little_traffic", pods=2)
    d = stabilize(None, thin, Fleet(2, 2), BOUNDS, WATCHED, 10.0)
    assert d.action == "hold" and "no judgement" in d.reason


def test_observing_records_arrivals_and_a_scale_outs_startup() -> None:
    state = ReplicaState(last_change=ScaleChange(100.0, 1, 2))
    seen = observe(state, OK, Fleet(2, 2), 160.0)
    assert seen.arrivals == ((160.0, 10.0),) and seen.startup_s == 60.0
    assert seen.since == 160.0
    assert ReplicaState.from_dict(seen.to_dict()) == seen
