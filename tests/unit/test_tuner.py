"""The tuner's rule: a table of situations, then properties over a seeded sweep."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from batchpilot_operator.capacity_model import StepSample
from batchpilot_operator.replica_rule import ReplicaBounds
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_operator.spec import parse_spec
from batchpilot_operator.tuner import (
    Bounds,
    Cadence,
    Decision,
    Goal,
    TunerParams,
    TunerState,
    decide,
    signal_window_s,
)
from batchpilot_server.batching_config import BatchingConfig

SLO = Slo(e2e_s=0.5, kv_high_watermark=0.9)
BOUNDS = Bounds(min_batch=1, max_batch=64, min_timeout_ms=0.0, max_timeout_ms=200.0)
P = TunerParams()
GOAL = Goal(SLO, BOUNDS, P)
# The same goal where the replica rule may still add pods.
AUTOSCALED = replace(GOAL, replicas=ReplicaBounds(min_replicas=1, max_replicas=4))
CURRENT = BatchingConfig(max_batch_size=16, batch_timeout_ms=10.0)


def ok(**fields: float | None) -> Signals:
    """A healthy window: enough traffic, full batches, no queueing, no KV pressure."""
    base: dict[str, float | None] = {
        "requests": 600,
        "request_rate": 10.0,
        "p99_latency_s": 0.3,
        "queue_wait_p99_s": 0.0,
        "kv_usage": 0.3,
        "mean_batch_size": 16.0,
    }
    base.update(fields)
    return Signals(status="ok", window_s=60, **base)  # type: ignore[arg-type]


def run(signals: Signals, current: BatchingConfig = CURRENT, **state: int) -> Decision:
    return decide(signals, current, GOAL, TunerState(**state))  # type: ignore[arg-type]


# (situation, signals, expected action, expected batch, expected timeout, words in the reason)
TABLE = [
    ("no data", Signals(status="no_data", detail="prometheus down"), "hold", 16, 10.0,
     "prometheus down"),
    ("no traffic", Signals(status="no_traffic"), "hold", 16, 10.0, "no traffic"),
    ("thin traffic", Signals(status="too_little_traffic", requests=5), "hold", 16, 10.0,
     "too little traffic"),
    ("ok but no p99 series", ok(p99_latency_s=None), "hold", 16, 10.0, "no p99"),
    ("headroom and queueing behind full batches",
     ok(p99_latency_s=0.2, queue_wait_p99_s=0.1), "grow_batch", 16 + P.additive_step, 10.0,
     "queue behind full batches"),
    ("headroom without queueing", ok(p99_latency_s=0.3), "hold", 16, 10.0, "no queueing"),
    ("within the hysteresis band", ok(p99_latency_s=0.45, queue_wait_p99_s=0.1), "hold", 16,
     10.0, "within the band"),
    ("breach while running", ok(p99_latency_s=0.8, queue_wait_p99_s=0.1), "backoff_batch",
     int(16 * P.backoff_factor), 10.0, "while running"),
    ("no model: p99 less a queue wait over half of it is the queue's, capacity is short",
     ok(p99_latency_s=2.0, queue_wait_p99_s=1.2), "grow_batch", round(16 * P.capacity_factor),
     10.0, "running ~800 ms): capacity short"),
    ("breach from queueing with full batches", ok(p99_latency_s=0.9, queue_wait_p99_s=0.6),
     "grow_batch", round(16 * P.capacity_factor), 10.0, "capacity short"),
    ("breach from queueing at bursts (low mean batch)",
     ok(p99_latency_s=0.9, queue_wait_p99_s=0.6, mean_batch_size=3.0), "grow_batch",
     round(16 * P.capacity_factor), 10.0, "capacity short"),
    ("near the SLO from queueing", ok(p99_latency_s=0.45, queue_wait_p99_s=0.3), "grow_batch",
     16 + P.additive_step, 10.0, "nears the SLO"),
    ("ample headroom, underfilled, no queueing",
     ok(p99_latency_s=0.1, mean_batch_size=2.0), "grow_timeout", 16,
     10.0 + P.timeout_step_share * 500, "fuller batches"),
    ("KV over the watermark despite headroom",
     ok(p99_latency_s=0.1, queue_wait_p99_s=0.1, kv_usage=0.95), "kv_guard",
     int(16 * P.kv_cut_factor), 10.0, "KV usage 0.95"),
    ("preemptions despite headroom", ok(p99_latency_s=0.1, preemption_rate=0.5), "kv_guard",
     int(16 * P.kv_cut_factor), 10.0, "preemptions"),
]


@pytest.mark.parametrize(
    ("signals", "action", "batch", "timeout", "words"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_situation_table(
    signals: Signals, action: str, batch: int, timeout: float, words: str
) -> None:
    decision = run(signals)
    assert decision.action == action, decision.reason
    assert decision.config.max_batch_size == batch
    assert decision.config.batch_timeout_ms == pytest.approx(timeout)
    assert words in decision.reason
    assert decision.config.max_queue_size == CURRENT.max_queue_size


def test_breach_the_timeout_explains_halves_the_timeout() -> None:
    patient = BatchingConfig(max_batch_size=16, batch_timeout_ms=50.0)
    signals = ok(p99_latency_s=0.55, queue_wait_p99_s=0.09, mean_batch_size=4.0)
    decision = run(signals, patient)
    assert decision.action == "shrink_timeout", decision.reason
    assert decision.config.batch_timeout_ms == 50.0 * P.timeout_cut_factor
    assert decision.config.max_batch_size == 16
    assert "timeout's doing" in decision.reason


def test_timeout_growth_stops_at_its_share_of_the_slo() -> None:
    slo = Slo(e2e_s=1.09)  # a cap (109 ms) that is not a round float
    config, state, goal = CURRENT, TunerState(), Goal(slo, BOUNDS)
    for _ in range(100):
        decision = decide(ok(p99_latency_s=0.1, mean_batch_size=2.0), config, goal, state)
        if decision.action != "hold":
            assert decision.config != config, decision  # an action always moves a knob
        config, state = decision.config, decision.state
    assert config.batch_timeout_ms == pytest.approx(P.timeout_budget_share * 1090)
    assert decision.action == "hold"


def test_breach_from_queueing_at_the_maximum_batch_holds_and_says_the_load_is_too_high() -> None:
    top = BatchingConfig(max_batch_size=BOUNDS.max_batch)
    decision = run(ok(p99_latency_s=0.9, queue_wait_p99_s=0.6, mean_batch_size=64.0), top)
    assert (decision.action, decision.config) == ("hold", top)
    assert "exceeds what the SLO allows" in decision.reason


def test_a_breach_from_queueing_grows_a_small_batch_at_least_as_far_as_headroom_would() -> None:
    # x1.5 from batch 1 or 2 is one more slot; a queue with headroom already gets +4
    breach = ok(p99_latency_s=0.9, queue_wait_p99_s=0.6, mean_batch_size=1.0)
    for batch, grown in ((1, 1 + P.additive_step), (2, 2 + P.additive_step), (16, 24)):
        decision = run(breach, BatchingConfig(max_batch_size=batch, batch_timeout_ms=10.0))
        assert (decision.action, decision.config.max_batch_size) == ("grow_batch", grown)


def test_breach_at_minimum_batch_and_timeout_holds_and_says_why() -> None:
    floor = BatchingConfig(max_batch_size=1, batch_timeout_ms=0.0)
    decision = run(ok(p99_latency_s=0.9, queue_wait_p99_s=0.0, mean_batch_size=1.0), floor)
    assert (decision.action, decision.config) == ("hold", floor)
    assert "nothing left to cut" in decision.reason


def test_kv_guard_at_minimum_batch_holds() -> None:
    floor = BatchingConfig(max_batch_size=1)
    decision = run(ok(kv_usage=0.99), floor)
    assert (decision.action, decision.config) == ("hold", floor)
    assert "minimum batch" in decision.reason


def test_config_outside_bounds_is_clamped_even_without_data() -> None:
    outside = BatchingConfig(max_batch_size=500, batch_timeout_ms=900)
    decision = run(Signals(status="no_data"), outside)
    assert decision.action == "clamp"
    assert (decision.config.max_batch_size, decision.config.batch_timeout_ms) == (64, 200.0)


def test_backoff_sets_a_ceiling_that_probing_growth_respects_until_it_expires() -> None:
    backoff = run(ok(p99_latency_s=0.8))
    assert backoff.action == "backoff_batch"
    assert backoff.state.ceiling == 16
    state, config = backoff.state, backoff.config
    queueing = ok(p99_latency_s=0.2, queue_wait_p99_s=0.1, mean_batch_size=None)
    sizes = []
    for _ in range(P.ceiling_ttl_intervals + 2):
        decision = decide(queueing, config, GOAL, state)
        state, config = decision.state, decision.config
        sizes.append(config.max_batch_size)
    assert max(sizes[: P.ceiling_ttl_intervals - 1]) == 15  # capped just below the breach
    assert sizes[-1] > 16  # the ceiling expired: probing resumes


def test_cooldown_holds_then_counts_down() -> None:
    goal = replace(GOAL, params=replace(P, cooldown_intervals=2))
    first = decide(ok(p99_latency_s=0.8), CURRENT, goal, TunerState())
    assert first.state.cooldown == 2
    second = decide(ok(p99_latency_s=0.8), first.config, goal, first.state)
    assert second.action == "hold" and "cooldown" in second.reason
    assert second.state.cooldown == 1


def test_window_never_reaches_back_past_a_change() -> None:
    changed = run(ok(p99_latency_s=0.8))
    assert changed.state.since_change == 0
    cadence = Cadence(interval_s=30, window_s=60)
    assert signal_window_s(changed.state, cadence) == 30
    held = decide(ok(p99_latency_s=0.45), changed.config, GOAL, changed.state)
    assert held.state.since_change == 1
    assert signal_window_s(held.state, cadence) == 60


def test_state_round_trips_through_a_dict() -> None:
    state = TunerState(cooldown=1, since_change=3, ceiling=12, ceiling_age=4)
    assert TunerState.from_dict(state.to_dict()) == state
    assert TunerState.from_dict(None) == TunerState()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_batch": 0}, "1 <= min <= max"),
        ({"min_batch": 9, "max_batch": 8}, "1 <= min <= max"),
        ({"min_timeout_ms": 50, "max_timeout_ms": 10}, "0 <= min <= max"),
    ],
)
def test_bad_bounds_are_refused_with_a_clear_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("<=", "<=")):
        Bounds(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"interval_s": 0}, "must be positive"),
        ({"interval_s": 30, "window_s": 10}, "must be at least the interval"),
    ],
)
def test_bad_cadence_is_refused_with_a_clear_message(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Cadence(**kwargs)


def test_a_policy_without_tuning_fields_tunes_with_the_one_set_of_defaults() -> None:
    spec = parse_spec({})
    assert spec.batching.bounds == Bounds()
    assert spec.cadence == Cadence()
    assert spec.goal == Goal(Slo(e2e_s=0.5))  # the CRD's default slo, p99LatencyMs 500
    # the pods start at the server's defaults, judging requests against the policy's SLO
    assert spec.initial_config() == BatchingConfig(slo=spec.slo.targets())


def test_bad_slo_is_refused() -> None:
    with pytest.raises(ValueError, match="must be positive"):
        Slo(e2e_s=0)
    with pytest.raises(ValueError, match="watermark"):
        Slo(e2e_s=1, kv_high_watermark=1.5)


# -- properties over a seeded sweep of random situations ------------------------------------


def random_case(rng: random.Random) -> tuple[Signals, BatchingConfig, Bounds, TunerState]:
    low_b = rng.randint(1, 32)
    bounds = Bounds(
        min_batch=low_b,
        max_batch=rng.randint(low_b, 128),
        min_timeout_ms=(low_t := rng.choice([0.0, 1.0, 5.0])),
        max_timeout_ms=low_t + rng.choice([0.0, 10.0, 200.0]),
    )
    config = bounds.clamp(
        BatchingConfig(max_batch_size=rng.randint(1, 128), batch_timeout_ms=rng.uniform(0, 300))
    )
    status = rng.choice(["ok", "ok", "ok", "no_data", "too_little_traffic", "no_traffic"])
    p99 = rng.choice([None, rng.uniform(0.01, 3.0)])
    signals = Signals(
        status=status,  # type: ignore[arg-type]
        requests=rng.uniform(0, 1000),
        p99_latency_s=p99,
        queue_wait_p99_s=rng.choice([None, rng.uniform(0, 3.0)]),
        kv_usage=rng.choice([None, rng.uniform(0, 1)]),
        preemption_rate=rng.choice([0.0, 0.0, rng.uniform(0, 2)]),
        mean_batch_size=rng.choice([None, rng.uniform(0.5, 128)]),
    )
    state = TunerState(
        cooldown=rng.choice([0, 0, 1]),
        since_change=rng.randint(0, 5),
        ceiling=rng.choice([None, rng.randint(1, 128)]),
        ceiling_age=rng.randint(0, 25),
    )
    return signals, config, bounds, state


CASES = [random_case(random.Random(seed)) for seed in range(3000)]


def test_never_leaves_the_bounds() -> None:
    for signals, config, bounds, state in CASES:
        decision = decide(signals, config, Goal(SLO, bounds), state)
        assert bounds.contains(decision.config), (signals, config, bounds, decision)


def test_never_changes_on_missing_data() -> None:
    for signals, config, bounds, state in CASES:
        if signals.ok:
            # Only the KV guard may act without a p99: its own signal is there.
            signals = replace(signals, p99_latency_s=None, kv_usage=0.1, preemption_rate=0.0)
        decision = decide(signals, config, Goal(SLO, bounds), state)
        assert decision.config == config and decision.action == "hold", decision


def test_kv_guard_wins_over_latency_headroom() -> None:
    for signals, config, bounds, state in CASES:
        if not signals.ok:
            continue
        pressured = replace(signals, kv_usage=0.95, p99_latency_s=0.01, queue_wait_p99_s=0.005)
        decision = decide(pressured, config, Goal(SLO, bounds), state)
        assert decision.config.max_batch_size <= config.max_batch_size, decision
        assert decision.action in ("kv_guard", "hold"), decision


def test_is_deterministic() -> None:
    for signals, config, bounds, state in CASES[:500]:
        goal = Goal(SLO, bounds)
        assert decide(signals, config, goal, state) == decide(signals, config, goal, state)


def test_a_change_moves_one_knob_at_a_time_and_always_explains() -> None:
    for signals, config, bounds, state in CASES:
        decision = decide(signals, config, Goal(SLO, bounds), state)
        assert decision.reason
        assert (decision.action == "hold") == (decision.config == config), decision
        if decision.action in ("grow_batch", "backoff_batch", "kv_guard"):
            assert decision.config.batch_timeout_ms == config.batch_timeout_ms
            assert decision.config.max_batch_size != config.max_batch_size
        if decision.action in ("grow_timeout", "shrink_timeout"):
            assert decision.config.max_batch_size == config.max_batch_size
            assert decision.config.batch_timeout_ms != config.batch_timeout_ms


# -- the capacity model's jumps ---------------------------------------------------------------

FIXED_S, PER_SEQ_S = 0.004, 0.0005  # the iteration line the windows below were measured on
LINE = tuple(StepSample(b, FIXED_S + PER_SEQ_S * b, pods=1) for b in (2.0, 4.0, 8.0))


def measured(batch_seen: float = 8.0, **fields: float | None) -> Signals:
    """A window on the line: 64 tokens a request (38 at p99), iterating at `batch_seen`;
    p99 0.9 s over the 0.5 s SLO, 0.6 s of it queueing."""
    base: dict[str, float | None] = {
        "p99_latency_s": 0.9, "queue_wait_p99_s": 0.6, "mean_batch_size": batch_seen,
        "tokens_per_s": 640.0, "arrival_rate": 15.0, "output_tokens_p99": 38.0,
        "busy_s_per_token": (FIXED_S + PER_SEQ_S * batch_seen) / batch_seen,
    }  # fmt: skip
    base.update(fields)
    return replace(ok(**base), pods=1)


def test_with_headroom_a_batch_running_past_busy_target_grows_before_a_queue_forms() -> None:
    # p99 0.3 s well within the 0.5 s SLO, nothing queues; but 15 req/s on batch 8 is
    # 15 x 64 x (4 + 0.5 x 8) ms = 7.7 busy slots of 8: the model asks for 12
    calm = measured(p99_latency_s=0.3, queue_wait_p99_s=0.0)
    decision = decide(calm, BatchingConfig(8, 10.0), GOAL, TunerState(samples=LINE))
    assert (decision.action, decision.config.max_batch_size) == ("grow_batch", 12)
    assert "batch 8 runs past 80% busy" in decision.reason
    assert "batch 8 -> 12 before a queue forms" in decision.reason
    # at a batch that carries it, headroom holds; without a model, AIMD waits for a queue
    assert decide(calm, BatchingConfig(12, 10.0), GOAL, TunerState(samples=LINE)).action != (
        "grow_batch"
    )
    assert decide(calm, BatchingConfig(8, 10.0), GOAL, TunerState()).action != "grow_batch"


def test_the_model_sizes_the_batch_for_the_demand_in_one_jump() -> None:
    decision = decide(measured(), BatchingConfig(8, 10.0), GOAL, TunerState(samples=LINE))
    # 15 req/s x 64 tokens at 80 % busy: b >= 1200 x (4 ms + 0.5 ms b)  ->  b = 12
    assert (decision.action, decision.config.max_batch_size) == ("grow_batch", 12)
    assert "model (iteration 4.00 ms + 0.500 ms per sequence" in decision.reason
    assert "needs batch 12 at 80% busy" in decision.reason
    assert decision.capacity is not None and not decision.spent
    # 38 iterations within the band's 0.4 s: iterations up to 10.5 ms, b <= 13
    assert decision.capacity.batch_limit == 13
    assert decision.capacity.demand_rps == pytest.approx(15.0)


def test_a_batch_that_carries_the_demand_holds_while_the_backlog_drains() -> None:
    # The window after the jump still breaks the SLO from the queue built before it.
    state = TunerState(samples=LINE, since_change=0)
    decision = decide(measured(12.0), BatchingConfig(12, 10.0), GOAL, state)
    assert decision.action == "hold" and decision.config.max_batch_size == 12
    assert "carries it, the queue drains" in decision.reason
    assert not decision.spent
    # a second window: the pods finished more than arrived and the queue is down to a
    # batch: the breach is the backlog's tail
    later = {"arrival_rate": 14.0, "requests": 900.0}  # 15 req/s finished
    drained = decide(measured(12.0, waiting=12.0, **later), BatchingConfig(12, 10.0), GOAL,
                     decision.state)  # fmt: skip
    assert drained.action == "hold" and "the queue drains" in drained.reason
    # ... still 40 waiting, or a short queue but fewer finished than arrived (13 of 14
    # req/s): the pods deliver less than the model says, AIMD steps on
    for window in ({"waiting": 40.0}, {"waiting": 4.0, "requests": 780.0}):
        again = decide(measured(12.0, **{**later, **window}), BatchingConfig(12, 10.0), GOAL,
                       decision.state)  # fmt: skip
        assert (again.action, again.config.max_batch_size) == ("grow_batch", 18), window
        assert "capacity short" in again.reason


def test_demand_beyond_any_batch_goes_to_the_limit_and_spends_the_knobs() -> None:
    # pods can still be added: the knobs stop at the running-time limit, the pods go on
    signals = measured(arrival_rate=24.0)
    decision = decide(signals, BatchingConfig(8, 10.0), AUTOSCALED, TunerState(samples=LINE))
    assert (decision.action, decision.config.max_batch_size) == ("grow_batch", 13)
    assert "needs batch 192 at 80% busy, capped at the limit 13" in decision.reason
    assert decision.spent and decision.capacity is not None
    assert decision.capacity.per_pod_rps == pytest.approx(13 / (64 * (FIXED_S + PER_SEQ_S * 13)))
    signals = measured(13.0, arrival_rate=24.0)
    at_limit = decide(signals, BatchingConfig(13, 10.0), AUTOSCALED, TunerState(samples=LINE))
    assert at_limit.action == "hold" and at_limit.spent
    assert "batch 13 is at its limit 13" in at_limit.reason
    beyond = decide(measured(arrival_rate=40.0), BatchingConfig(8, 10.0), AUTOSCALED,
                    TunerState(samples=LINE))  # fmt: skip
    assert "more than any batch carries" in beyond.reason and beyond.config.max_batch_size == 13


def test_a_fleet_that_cannot_grow_serves_the_demand_past_the_running_time_limit() -> None:
    # No pod can be added (a fixed fleet, or the replica rule at its maximum): a queue
    # that never drains times every request out, a batch past the limit runs the
    # longest ones a little over. 24 req/s needs batch 192 at 80 % busy.
    at_max = replace(AUTOSCALED, replicas=ReplicaBounds(min_replicas=1, max_replicas=1))
    for goal in (GOAL, at_max):
        decision = decide(measured(arrival_rate=24.0), BatchingConfig(8, 10.0), goal,
                          TunerState(samples=LINE))  # fmt: skip
        assert (decision.action, decision.config.max_batch_size) == ("grow_batch", 64)
        assert "past the running-time limit 13: the fleet cannot grow" in decision.reason
    # 20 req/s needs batch 32 at 80% busy: one jump there, not to the bound
    decision = decide(measured(arrival_rate=20.0), BatchingConfig(8, 10.0), GOAL,
                      TunerState(samples=LINE))  # fmt: skip
    assert decision.config.max_batch_size == 32, decision.reason
    # where no batch carries it, AIMD steps towards the bound
    beyond = decide(measured(arrival_rate=40.0), BatchingConfig(8, 10.0), GOAL,
                    TunerState(samples=LINE))  # fmt: skip
    assert (beyond.action, beyond.config.max_batch_size) == ("grow_batch", 12)
    assert "more than any batch carries at 80% busy, and the fleet cannot grow" in beyond.reason
    # a back-off's ceiling (learnt at another load, running too slow: the price accepted
    # here) does not hold the batch below the demand: 9 grows past 14 ...
    backed_off = TunerState(samples=LINE, ceiling=14)
    past = decide(measured(arrival_rate=40.0), BatchingConfig(9, 10.0), GOAL, backed_off)
    assert (past.action, past.config.max_batch_size) == ("grow_batch", 14), past.reason
    past = decide(measured(arrival_rate=20.0), BatchingConfig(9, 10.0), GOAL, backed_off)
    assert (past.action, past.config.max_batch_size) == ("grow_batch", 32), past.reason
    # ... and stops at the bound
    top = decide(measured(arrival_rate=40.0), BatchingConfig(64, 10.0), GOAL, backed_off)
    assert top.action == "hold" and "batch 64 is at the maximum" in top.reason


@pytest.mark.parametrize(
    ("arrivals", "action", "batch", "why"),
    [
        (10.0, "backoff_batch", 14, "while running"),  # batch 4 carries 10 req/s: cut x0.7
        (20.0, "backoff_batch", 15, "the cut stops at batch 15"),  # 14 would not carry it
        (25.0, "hold", 20, "batch 32 is the least that carries"),
        (40.0, "hold", 20, "no batch carries"),
    ],
)
def test_where_the_fleet_cannot_grow_a_back_off_stops_at_the_batch_that_carries_the_demand(
    arrivals: float, action: str, batch: int, why: str
) -> None:
    # batch 20 runs the longest requests (38 tokens x 14 ms) 0.53 s, over the 0.5 s SLO
    running_over = measured(20.0, queue_wait_p99_s=0.2, arrival_rate=arrivals)
    state = TunerState(samples=LINE)
    decision = decide(running_over, BatchingConfig(20, 10.0), GOAL, state)
    assert (decision.action, decision.config.max_batch_size) == (action, batch), decision.reason
    assert why in decision.reason
    # where pods may be added, the back-off cuts as always: the replica rule adds capacity
    grows = decide(running_over, BatchingConfig(20, 10.0), AUTOSCALED, state)
    assert (grows.action, grows.config.max_batch_size) == ("backoff_batch", 14), grows.reason


@pytest.mark.parametrize(
    ("queue_wait_s", "limit"),
    [(0.2, 13), (0.6, BOUNDS.max_batch)],  # running 0.3 s at batch 8 may grow to 0.4 s
)
def test_without_lengths_the_running_time_seen_limits_the_batch(
    queue_wait_s: float, limit: int
) -> None:
    # p99 0.5 s just over the SLO; with queueing at half the p99 or more, p99 less queue
    # wait says too little about running to limit anything
    signals = measured(p99_latency_s=queue_wait_s + 0.3, queue_wait_p99_s=queue_wait_s,
                       output_tokens_p99=None)  # fmt: skip
    decision = decide(signals, BatchingConfig(8, 10.0), GOAL, TunerState(samples=LINE))
    assert decision.capacity is not None and decision.capacity.batch_limit == limit


def test_the_backlog_counts_as_demand_to_drain_within_a_window() -> None:
    # 300 queued over a 60 s window add 5 req/s: 20 req/s needs batch 38 (limit 13)
    signals = measured(waiting=300.0)
    decision = decide(signals, BatchingConfig(8, 10.0), AUTOSCALED, TunerState(samples=LINE))
    assert decision.capacity is not None
    assert decision.capacity.demand_rps == pytest.approx(20.0)
    assert decision.config.max_batch_size == 13


def test_without_a_model_growth_steps_by_aimd_and_samples_accumulate() -> None:
    first = decide(measured(), BatchingConfig(8, 10.0), GOAL, TunerState())
    # one sample (batch 8) is no line: the multiplicative step
    assert (first.action, first.config.max_batch_size) == ("grow_batch", 12)
    assert "capacity short" in first.reason and first.capacity is None
    assert [s.batch for s in first.state.samples] == [8.0]
    second = decide(measured(12.0), first.config, GOAL, first.state)
    assert [s.batch for s in second.state.samples] == [8.0, 12.0]
    assert second.capacity is not None  # 8 and 12 span enough for a line


def test_a_kv_cut_keeps_the_samples_and_spends_the_knobs() -> None:
    decision = decide(measured(kv_usage=0.95), BatchingConfig(8, 10.0), GOAL,
                      TunerState(samples=LINE))  # fmt: skip
    assert decision.action == "kv_guard" and decision.spent
    assert len(decision.state.samples) == 3 and decision.state.ceiling == 8  # 8 refreshed


def test_tuner_state_round_trips_its_samples() -> None:
    state = TunerState(ceiling=12, samples=LINE)
    assert TunerState.from_dict(state.to_dict()) == state


def test_under_deep_overload_the_model_says_the_running_time() -> None:
    # p99 and queue wait both in the (30, 60] s bucket: their difference reads 9 s of
    # running, which would hold as "overloaded"; 38 tokens of 8 ms iterations run 0.3 s
    signals = measured(p99_latency_s=39.0, queue_wait_p99_s=30.0)
    decision = decide(signals, BatchingConfig(8, 10.0), GOAL, TunerState(samples=LINE))
    assert (decision.action, decision.config.max_batch_size) == ("grow_batch", 12)
    without_model = decide(signals, BatchingConfig(8, 10.0), GOAL, TunerState())
    assert without_model.action == "grow_batch" and "capacity short" in without_model.reason


def test_a_running_budget_no_batch_meets_limits_nothing() -> None:
    # 120 tokens of even batch 1's 4.5 ms iterations run 0.54 s, past the band's 0.4 s:
    # the running time cannot meet the SLO, so the queue is what to cut
    signals = measured(output_tokens_p99=120.0)
    decision = decide(signals, BatchingConfig(8, 10.0), GOAL, TunerState(samples=LINE))
    assert decision.capacity is not None and decision.capacity.batch_limit == BOUNDS.max_batch


def test_the_model_says_overloaded_when_both_halves_break_the_slo() -> None:
    # 200 tokens of 8 ms iterations run 1.6 s, over the 0.5 s SLO, and requests queue:
    # no batch size fixes it, only pods do
    signals = measured(output_tokens_p99=200.0)
    decision = decide(signals, BatchingConfig(8, 10.0), GOAL, TunerState(samples=LINE))
    assert decision.action == "hold" and "overloaded" in decision.reason
    assert "running ~1600 ms" in decision.reason and decision.spent
