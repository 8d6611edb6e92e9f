"""The fallback table through the round (no step counters: the fit never forms), as a
decision table: each row a window (a few numbers) and the row, knobs and pods it must
give; then the gates before it (no evidence, bounds) and the windows that count as
evidence however few requests finished."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
from batchpilot_operator.policy.fallback import HOLD, TABLE, Symptoms
from batchpilot_operator.policy.memory import PolicyMemory
from batchpilot_operator.policy.round import decide
from batchpilot_operator.policy.speculation import accepted_share
from batchpilot_operator.policy.step_model import StepPoint
from batchpilot_operator.policy.types import Bounds, Fleet, Goal, ReplicaBounds, ReplicaState
from batchpilot_operator.policy.window import Window
from batchpilot_operator.signals import (
    ClassSignals,
    Signals,
    misses_are_evidence,
    status_detail,
    traffic_status,
)
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_server.batching_config import BatchingConfig

E2E = Slo(e2e_s=1.0)
TPOT = Slo(tpot_s=0.02)
WIDE = Bounds(1, 64, 0.0, 200.0, min_prefill_budget=256, max_prefill_budget=4096)
NARROW = Bounds(8, 8, 0.0, 200.0, min_prefill_budget=256, max_prefill_budget=4096)
FLEET = ReplicaBounds(1, 4, scale_down_stabilization_s=0.0)
CURRENT = BatchingConfig(max_batch_size=8, batch_timeout_ms=10.0, prefill_token_budget=2048)
AT_FLOOR = replace(CURRENT, prefill_token_budget=256)
# bench/slo_classes.py's shape: chat (TTFT 1 s, TPOT 20 ms) beside long prompts judged
# end to end; the top-level targets are the interactive class's.
INTERACTIVE = SloClass("interactive", 10, ttft_s=1.0, tpot_s=0.02)
BATCH = SloClass("batch", 0, e2e_s=300.0)
CLASSES = Slo(ttft_s=1.0, tpot_s=0.02, classes=(INTERACTIVE, BATCH))


def seen(name: str, judged: float, met: float, **values: float) -> ClassSignals:
    """A class's signals: its judgement, and p99s and waiting requests by field name."""
    return ClassSignals(name, slo_judged=judged, slo_met=met, **values)  # type: ignore[arg-type]


# The interactive class within its targets (TPOT 16 ms: at 80 % of 20, no room to grow),
# the batch one well within 300 s, while the batch prompts' prefill puts the totals'
# TTFT p99 at 5 s: five times the interactive target no class misses.
CHAT_OK = seen("interactive", 580, 580, ttft_p99_s=0.7, tpot_p99_s=0.016)
BATCH_OK = seen("batch", 20, 20, p99_latency_s=40.0)
INFLATED = {"ttft_p99_s": 5.0, "tpot_p99_s": 0.016, "p99_latency_s": 40.0}
# 40 requests wait at the window's end, arrivals over what finished, and the wait is
# most of the totals' TTFT: a queue by every measure of the totals.
CLASS_QUEUE = {**INFLATED, "queue_wait_p99_s": 3.0, "waiting": 40.0, "arrival_rate": 30.0}
SLOW_CHAT = {"ttft_p99_s": 0.7, "tpot_p99_s": 0.03}


def signals(**values: object) -> Signals:
    base = dict(status="ok", window_s=30.0, requests=600.0, request_rate=20.0,
                kv_usage=0.2, mean_batch_size=8.0, pods=1)  # fmt: skip
    return Signals(**{**base, **values})  # type: ignore[arg-type]


@dataclass(frozen=True)
class Case:
    name: str
    window: dict[str, object]
    row: str  # the table row that must match
    batch: int
    timeout: float = 10.0
    budget: int = 2048
    pods: int = 1  # the pods the row names (the fleet is 1, or `window["pods"]`)
    slo: Slo = E2E
    bounds: Bounds = WIDE
    current: BatchingConfig = CURRENT
    extra: dict[str, object] = field(default_factory=dict)
    says: str = ""  # what the reason must say (the binding class's miss)


# Why each row gives what it gives: the batch 8 in force moves by the row's factor
# (0.75 at the KV watermark: 6; 1.5 when queueing: 12; 0.7 running: 5), the budget by
# a quarter (2048: 512); where the row's knob is spent, a pod more; a TPOT missed (50 ms
# against 20) scales one pod by 2.5: three.
CASES = [
    Case("KV at the watermark cuts the batch", {"kv_usage": 0.95, "p99_latency_s": 0.1}, "kv", 6),
    Case("preemptions cut the batch", {"preemption_rate": 1.0, "p99_latency_s": 0.1}, "kv", 6),
    Case(
        "KV full at the batch's minimum: a pod more",
        {"kv_usage": 0.95, "p99_latency_s": 0.1},
        "kv",
        8,
        pods=2,
        bounds=NARROW,
    ),
    Case(
        "queueing past the target grows the batch, no timeout",
        {"p99_latency_s": 3.0, "queue_wait_p99_s": 2.5},
        "queueing",
        12,
        timeout=0.0,
    ),
    Case(
        "queueing at the batch's maximum: a pod more",
        {"p99_latency_s": 3.0, "queue_wait_p99_s": 2.5},
        "queueing",
        8,
        timeout=0.0,
        pods=2,
        bounds=NARROW,
    ),
    Case(
        # 30 req/s arrive and 40 wait where one pod served 20: even at a batch 1.5x
        # larger, one pod at 80 % busy carries 24, so two
        "a growing queue is queueing though the wait is short",
        {"p99_latency_s": 3.0, "queue_wait_p99_s": 0.1, "waiting": 40.0, "arrival_rate": 30.0},
        "queueing",
        12,
        timeout=0.0,
        pods=2,
    ),
    Case(
        "TPOT missed while requests queue: the knobs hold, the pods TPOT-scaled",
        {"tpot_p99_s": 0.05, "p99_latency_s": 3.0, "queue_wait_p99_s": 2.5},
        "overloaded",
        8,
        pods=3,
        slo=TPOT,
    ),
    Case(
        "TPOT missed while running cuts the prefill budget first, the pods TPOT-scaled",
        {"tpot_p99_s": 0.05, "ttft_p99_s": 0.1},
        "running",
        8,
        budget=512,
        pods=3,
        slo=TPOT,
    ),
    Case(
        "TPOT missed at the budget's floor backs the batch off, the pods TPOT-scaled",
        {"tpot_p99_s": 0.05, "ttft_p99_s": 0.1},
        "running",
        5,
        budget=256,
        pods=3,
        slo=TPOT,
        current=AT_FLOOR,
    ),
    Case(
        "TPOT missed with both knobs spent: the pods TPOT-scaled",
        {"tpot_p99_s": 0.05, "ttft_p99_s": 0.1},
        "running",
        8,
        budget=256,
        slo=TPOT,
        current=AT_FLOOR,
        bounds=NARROW,
        pods=3,
    ),
    # four pods stepping 2 rows of 8: two pods would run 4, within 60 % of the batch
    Case(
        "headroom and steps of few rows: fewer pods",
        {"p99_latency_s": 0.2, "mean_batch_size": 2.0, "pods": 4},
        "headroom",
        8,
        pods=2,
    ),
    # two pods at batch 1 stepping a fifth of the window: 0.4 rows in flight, one pod
    Case(
        "headroom with idle pods: fewer pods",
        {
            "p99_latency_s": 0.2,
            "mean_batch_size": 1.0,
            "pods": 2,
            "tokens_per_s": 40.0,
            "busy_s_per_token": 0.01,
        },  # busy 40 x 0.01 / 2 = 0.2
        "headroom",
        1,
        pods=1,
        current=replace(CURRENT, max_batch_size=1),
    ),
    # every step runs the batch's 8 rows and no TPOT is stated: an answer's time grows
    # at most as its steps do, so end to end's room bounds the batch: 0.8 x 1 / 0.2 = 4x
    # (the same window at 2 rows a step, above, leaves the batch: it does not bind)
    Case(
        "headroom with full steps and no TPOT grows the batch into end to end's room",
        {"p99_latency_s": 0.2, "mean_batch_size": 8.0, "pods": 2},
        "headroom",
        32,
        pods=2,
    ),
    Case(
        "end to end missed while running cuts the budget, the pods stay",
        {"p99_latency_s": 3.0},
        "running",
        8,
        budget=512,
    ),
    Case(
        "requests queue near the target: a larger batch ahead of the miss, the pods stay",
        {"p99_latency_s": 0.9, "queue_wait_p99_s": 0.5},
        "filling",
        12,
        timeout=0.0,
    ),
    Case(
        "requests queue with headroom: a larger batch serves them sooner",
        {"p99_latency_s": 0.2, "queue_wait_p99_s": 0.15},
        "filling",
        12,
        timeout=0.0,
    ),
    # 40 arrive where one pod finished 20, and 40 wait, the batch's rows full: the batch
    # grows into end to end's room (0.8 x 1 / 0.5 = 1.6x: 13) and then carries at most
    # 0.8 x 20 x 13 / 8 = 26 of (40 + 40 / 60 s): two pods beside the larger batch
    Case(
        "a queue within the SLO past what the grown batch carries: the pods that carry it",
        {"p99_latency_s": 0.5, "queue_wait_p99_s": 0.3, "waiting": 40.0, "arrival_rate": 40.0},
        "filling",
        13,
        timeout=0.0,
        pods=2,
    ),
    Case("inside the band holds", {"p99_latency_s": 0.9}, "hold", 8),
    # TPOT 18 ms against 20: past 80 %, so no growth credit; 30 arrive, 40 wait, one pod
    # served 20: (30 + 40 / 60 s) / (0.8 x 20) -> two pods, beside the larger batch
    Case(
        "a queue within the SLO with TPOT tight: a larger batch and the pods that carry it",
        {
            "tpot_p99_s": 0.018,
            "ttft_p99_s": 0.1,
            "queue_wait_p99_s": 0.1,
            "waiting": 40.0,
            "arrival_rate": 30.0,
        },
        "queueing",
        12,
        timeout=0.0,
        pods=2,
        slo=TPOT,
    ),
    # TPOT 5 ms against 20: a step may grow 0.8 x 20 / 5 = 3.2x before it passes 80 %
    # of its target; the rows hold no queue, so the cap costs nothing at this load and
    # carries a surge's first window: 8 -> 26
    Case(
        "headroom with TPOT to spare grows the batch into its room",
        {"tpot_p99_s": 0.005, "ttft_p99_s": 0.1, "mean_batch_size": 2.0},
        "headroom",
        26,
        slo=TPOT,
    ),
    # 40 wait beside the 8 rows in flight: 6x the batch holds them, TPOT's room (4 ms
    # against 20: 0.8 x 20 / 4 = 4x) allows 4x: 32, one pod carries the load at it
    Case(
        "queueing with TPOT to spare grows the batch to the queue, within TPOT's room",
        {"ttft_p99_s": 2.0, "queue_wait_p99_s": 1.8, "tpot_p99_s": 0.004, "waiting": 40.0},
        "queueing",
        32,
        timeout=0.0,
        slo=Slo(ttft_s=0.5, tpot_s=0.02),
    ),
    Case(
        "headroom without rows to size by holds the pods",
        {"p99_latency_s": 0.2, "mean_batch_size": None, "pods": 2},
        "hold",
        8,
        pods=2,
    ),
    Case(
        "a p99 past its target with the attainment met holds",
        {"tpot_p99_s": 0.05, "slo_judged": 600.0, "slo_met": 580.0},
        "hold",
        8,
        slo=Slo(tpot_s=0.02, attainment=0.95),
    ),
    # SLO classes: each class's p99s against its own targets, the highest ratio binding.
    Case(
        "the batch class inflates the totals' TTFT, no class misses: hold",
        {**INFLATED, "classes": {"interactive": CHAT_OK, "batch": BATCH_OK}},
        "hold",
        8,
        slo=CLASSES,
    ),
    Case(
        "without classes stated the totals' TTFT is the miss, as before",
        {**INFLATED, "classes": {"interactive": CHAT_OK, "batch": BATCH_OK}},
        "running",
        8,
        budget=512,
        slo=Slo(ttft_s=1.0, tpot_s=0.02),
        says="[running] ttft p99 5000 ms > target 1000 ms",
    ),
    Case(
        "classes stated but none in the window: the totals, as before",
        INFLATED,
        "running",
        8,
        budget=512,
        slo=CLASSES,
        says="[running] ttft p99 5000 ms > target 1000 ms",
    ),
    Case(
        "the interactive class misses TTFT while requests queue: queueing names it",
        {**INFLATED, "queue_wait_p99_s": 3.0, "classes": {
            "interactive": seen("interactive", 580, 500, ttft_p99_s=1.4, tpot_p99_s=0.012),
            "batch": BATCH_OK}},
        "queueing",
        12,
        timeout=0.0,
        slo=CLASSES,
        says="[queueing] class interactive: ttft p99 1400 ms > target 1000 ms",
    ),
    Case(
        "a class past its p99 with its own attainment met holds",
        {**INFLATED, "classes": {
            "interactive": seen("interactive", 580, 578, ttft_p99_s=1.3, tpot_p99_s=0.016),
            "batch": BATCH_OK}},
        "hold",
        8,
        slo=CLASSES,
    ),
    # The totals' p99s are within the top-level targets (which state no end to end):
    # only the batch class's own e2e shows its miss.
    Case(
        "the batch class misses its end to end while the totals hold: running names it",
        {"ttft_p99_s": 0.7, "tpot_p99_s": 0.012, "p99_latency_s": 400.0, "classes": {
            "interactive": seen("interactive", 580, 580, ttft_p99_s=0.7, tpot_p99_s=0.012),
            "batch": seen("batch", 20, 10, p99_latency_s=400.0)}},
        "running",
        8,
        budget=512,
        slo=CLASSES,
        says="class batch: e2e p99 400000 ms > target 300000 ms",
    ),
    # interactive TPOT 1.5x its target, batch e2e 2x: the batch class binds, so the row
    # cuts the budget and adds no TPOT-scaled pods (interactive binding would give 2)
    Case(
        "two classes missing: the furthest past its target binds",
        {**INFLATED, "classes": {
            "interactive": seen("interactive", 580, 400, ttft_p99_s=0.7, tpot_p99_s=0.03),
            "batch": seen("batch", 20, 10, p99_latency_s=600.0)}},
        "running",
        8,
        budget=512,
        slo=CLASSES,
        says="class batch: e2e p99 600000 ms",
    ),
    # The interactive class's TPOT (18 ms) past 80 % of its 20 ms while the totals' (10
    # ms) has room: the steps may not lengthen, so the queue takes pods as well as the
    # batch (no growth credit: 20 finished, 0.8 x 20 a pod -> two), not `filling`'s one
    Case(
        "a queue with the interactive class's TPOT tight though the totals' has room",
        {**INFLATED, "tpot_p99_s": 0.010, "queue_wait_p99_s": 3.0, "classes": {
            "interactive": seen("interactive", 580, 580, ttft_p99_s=0.7, tpot_p99_s=0.018),
            "batch": BATCH_OK}},
        "queueing",
        12,
        timeout=0.0,
        pods=2,
        slo=CLASSES,
        says="class interactive: tpot p99 18 ms past 80% of its target 20 ms",
    ),
    # The interactive class (priority 10) misses TPOT (30 ms against 20: 1.5x, so two
    # pods TPOT-scaled) while 40 requests wait and the wait is most of the totals' TTFT.
    # The schedulers serve the higher class first: where the 40 are all the batch
    # class's, the interactive class has no queue, and the smaller batch that shortens
    # its steps only lengthens the batch class's wait (the budget at its floor: 8 -> 5).
    Case(
        "the interactive class misses TPOT, only the batch class waits: a smaller batch",
        {**CLASS_QUEUE, "classes": {
            "interactive": seen("interactive", 580, 400, waiting=0.0, **SLOW_CHAT),
            "batch": seen("batch", 20, 20, waiting=40.0, p99_latency_s=40.0)}},
        "running",
        5,
        budget=256,
        pods=2,
        slo=CLASSES,
        current=AT_FLOOR,
        says="[running] class interactive: tpot p99 30 ms > target 20 ms",
    ),
    Case(
        "the interactive class misses TPOT and its own requests wait: overloaded",
        {**CLASS_QUEUE, "classes": {
            "interactive": seen("interactive", 580, 400, waiting=40.0, **SLOW_CHAT),
            "batch": seen("batch", 20, 20, waiting=0.0, p99_latency_s=40.0)}},
        "overloaded",
        8,
        budget=256,
        pods=2,
        slo=CLASSES,
        current=AT_FLOOR,
        says="[overloaded] class interactive: tpot p99 30 ms > target 20 ms",
    ),
    Case(
        "pods that export no waiting by class: the whole queue counts, overloaded",
        {**CLASS_QUEUE, "classes": {
            "interactive": seen("interactive", 580, 400, **SLOW_CHAT),
            "batch": seen("batch", 20, 20, p99_latency_s=40.0)}},
        "overloaded",
        8,
        budget=256,
        pods=2,
        slo=CLASSES,
        current=AT_FLOOR,
    ),
    Case(
        "the default class's requests judged against the top-level targets",
        {**INFLATED, "classes": {
            "default": seen("default", 100, 50, ttft_p99_s=2.0, tpot_p99_s=0.012),
            "interactive": CHAT_OK, "batch": BATCH_OK}},
        "running",
        8,
        budget=512,
        slo=CLASSES,
        says="class default: ttft p99 2000 ms > target 1000 ms",
    ),
]  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_fallback_table(case: Case) -> None:
    pods = int(case.window.get("pods", 1))  # type: ignore[call-overload]
    goal = Goal(case.slo, case.bounds, replicas=FLEET)
    d = decide(signals(**case.window), case.current, goal, PolicyMemory(),
               fleet=Fleet(pods, pods), now=1e4)  # fmt: skip
    assert d.reason.startswith("fallback (") and f"[{case.row}]" in d.reason
    got = (d.config.max_batch_size, d.config.batch_timeout_ms, d.config.prefill_token_budget)
    assert got == (case.batch, case.timeout, case.budget), d.reason
    assert case.says in d.reason, d.reason
    assert d.scale is not None and f", {case.pods} pod(s)" in d.reason
    assert d.scale.replicas == case.pods, d.scale.reason


@pytest.mark.parametrize(
    ("history", "batch"),
    [((10.0, 12.0, 14.0), 32), ((16.0, 16.0, 16.0), 8)],
    ids=["rising: grows into end to end's room", "flat: holds"],
)
def test_the_batch_binds_at_the_forecast_rows(history: tuple[float, ...], batch: int) -> None:
    # 6 rows in flight of the batch's 8: short of the 80 % at which it binds. Where the
    # arrivals rose 10 -> 16 req/s over the last rounds, the forecast a round and a
    # start-up ahead (60 s) is 20 req/s, and a request's rows stay in flight as long, so
    # 6 x 20 / 16 = 7.5 rows then: the batch binds and grows into end to end's room
    # (0.8 x 1 / 0.2 = 4x). At a flat 16 req/s it does not bind and holds.
    now = 1e4
    arrivals = tuple((now - 30.0 * (len(history) - i), rps) for i, rps in enumerate(history))
    memory = PolicyMemory(replicas=ReplicaState(arrivals=arrivals))
    window = signals(p99_latency_s=0.2, mean_batch_size=6.0, arrival_rate=16.0)
    d = decide(window, CURRENT, Goal(E2E, WIDE, replicas=FLEET), memory, fleet=Fleet(1, 1), now=now)
    assert "[headroom]" in d.reason
    assert d.config.max_batch_size == batch, d.reason
    assert d.scale is not None and d.scale.replicas == 1, d.scale.reason


def test_without_a_fleet_the_reason_names_no_pods() -> None:
    # a single server's round (the fleet not the round's): a spent batch asks no pod
    window = {"p99_latency_s": 3.0, "queue_wait_p99_s": 2.0, "waiting": 40.0}
    goal = Goal(E2E, NARROW)
    d = decide(signals(**window), CURRENT, goal, PolicyMemory(), now=1e4)
    assert "[queueing]" in d.reason and d.scale is None
    assert "pod" not in d.reason and "spent" not in d.reason, d.reason


def test_the_table_is_small_and_hold_is_what_no_row_matches() -> None:
    assert len(TABLE) <= 6
    nothing = Symptoms(kv=None, missed=None, tpot_missed=False, tpot_tight=None, queueing=False,
                       headroom=False)  # fmt: skip
    assert not any(r.when(nothing) for r in TABLE) and HOLD.when(nothing)


def test_windows_without_evidence_hold_and_say_why() -> None:
    thin = Signals(status="too_little_traffic", detail="only 3 requests finished")
    d = decide(thin, CURRENT, Goal(E2E, WIDE), PolicyMemory())
    assert d.action == "hold" and "only 3 requests finished" in d.reason
    assert d.memory.since_change == PolicyMemory().since_change  # capped, not moved


def test_a_config_outside_the_bounds_is_clamped_first() -> None:
    d = decide(signals(p99_latency_s=0.1), BatchingConfig(max_batch_size=500), Goal(E2E, WIDE),
               PolicyMemory())  # fmt: skip
    assert d.action == "clamp" and d.config.max_batch_size == 64


def test_a_thin_window_whose_pods_judged_many_misses_is_evidence() -> None:
    goal = Goal(Slo(ttft_s=0.5, attainment=0.95), WIDE)
    # 40 requests, too few for a p99 by count; 12 missed where 5 % allow 2: no chance
    thin = signals(status="too_little_traffic", requests=40.0, ttft_p99_s=2.0,
                   queue_wait_p99_s=1.9, slo_judged=40.0, slo_met=28.0,
                   slo_missed={"all": 12.0, "ttft": 12.0})  # fmt: skip
    assert misses_are_evidence(40, 12, goal.slo.allowed_miss_share)
    assert decide(thin, CURRENT, goal, PolicyMemory()).action == "grow_batch"
    # 3 of 40 is within chance at 5 %: the thin window holds
    chance = replace(thin, slo_met=37.0, slo_missed={"all": 3.0, "ttft": 3.0})
    assert not misses_are_evidence(40, 3, goal.slo.allowed_miss_share)
    assert decide(chance, CURRENT, goal, PolicyMemory()).action == "hold"


@pytest.mark.parametrize("window_s", [30.0, 60.0])
def test_the_backlog_is_drained_within_a_minute_whatever_the_window_read(
    window_s: float,
) -> None:
    # A cold start's first round reads one interval (30 s), as every round after a change
    # does. One pod served 20 req/s, 20 arrive and 900 wait: at a batch 1.5x larger a pod
    # carries 0.8 x 20 x 1.5 = 24, and (20 + 900 / 60) / 24 -> two pods from either
    # window; the backlog over the 30 s read asked three, which the scale-down
    # stabilization then kept
    backlog = signals(window_s=window_s, requests=20.0 * window_s, arrival_rate=20.0,
                      waiting=900.0, p99_latency_s=3.0, queue_wait_p99_s=2.5)  # fmt: skip
    d = decide(backlog, CURRENT, Goal(E2E, WIDE, replicas=FLEET), PolicyMemory(),
               fleet=Fleet(1, 1), now=1e4)  # fmt: skip
    assert "[queueing]" in d.reason and d.config.max_batch_size == 12, d.reason
    assert d.scale is not None and d.scale.replicas == 2, d.reason


def test_a_queue_as_long_as_what_finished_is_evidence_for_a_slow_model() -> None:
    # SmolLM2 on two cores: 10 requests a window at batch 1, 25 waiting and more coming;
    # the demo's 30-request minimum no longer holds it
    assert traffic_status(10.0, 25.0, 0.0, min_requests=30) == "ok"
    slow = signals(requests=10.0, request_rate=0.33, arrival_rate=1.2, waiting=25.0,
                   p99_latency_s=20.0, queue_wait_p99_s=15.0, mean_batch_size=1.0)  # fmt: skip
    d = decide(slow, BatchingConfig(max_batch_size=1), Goal(Slo(e2e_s=10.0), WIDE),
               PolicyMemory())  # fmt: skip
    assert d.action == "grow_batch" and d.config.max_batch_size > 1


def test_a_full_batch_of_long_answers_is_judged_though_few_finish() -> None:
    # 64 long answers fill the batch and 5 of them finished in the window: load, not a
    # thin window (counting only what finished and waits held it)
    status = traffic_status(5.0, 0.0, 64.0)
    assert status == "ok"
    full = signals(status=status, requests=5.0, request_rate=0.17, running=64.0,
                   mean_batch_size=64.0, tpot_p99_s=0.08, ttft_p99_s=0.3)  # fmt: skip
    d = decide(full, BatchingConfig(max_batch_size=64), Goal(Slo(tpot_s=0.05), WIDE),
               PolicyMemory())  # fmt: skip
    assert d.config.max_batch_size < 64 or d.config.prefill_token_budget < 2048
    assert "tpot p99 80 ms > target 50 ms while running" in d.reason


def test_a_full_batch_with_nothing_finished_holds_and_says_why() -> None:
    # no request finished: no p99 to read, whatever runs; a hold that says so, not a crash
    status = traffic_status(0.0, 3.0, 64.0)
    detail = status_detail(status, 0.0, 3.0, 64.0, min_requests=50)
    busy = Signals(status=status, window_s=30.0, waiting=3.0, running=64.0, pods=1,
                   kv_usage=0.5, detail=detail)  # fmt: skip
    d = decide(busy, BatchingConfig(max_batch_size=64), Goal(E2E, WIDE), PolicyMemory())
    assert d.action == "hold" and d.config.max_batch_size == 64
    assert "too little traffic: no request finished in the window while 64 run" in d.reason


def test_a_wait_that_is_most_of_the_ttft_is_queueing_though_long_answers_hide_it() -> None:
    # The wait is nearly all of the TTFT p99 and a quarter of the end-to-end p99 of long
    # answers; no queue is left at the window's end.
    s = signals(ttft_p99_s=2.3, queue_wait_p99_s=2.2, p99_latency_s=9.0, tpot_p99_s=0.01)
    chat = Slo(ttft_s=1.0, tpot_s=0.02)
    assert Window.of(s, chat, None, None, ReplicaState()).queueing()
    # an end-to-end SLO reads the wait against its own p99
    assert not Window.of(s, Slo(e2e_s=10.0), None, None, ReplicaState()).queueing()


# Every row's knobs carry k (speculation.draft_length): the window's step on a plane of
# 1.5 ms fixed and 0.2 ms a token (8 rows at k 4 beside 20 prompt tokens: 13.5 ms), the
# fit through it untrusted (one load level: the rows did not vary) but pricing a prompt
# token; the numbers per k are test_speculation.py's at 8 rows.
K = 4
SPECULATING = replace(CURRENT, num_speculative_tokens=K)
SPEC_BOUNDS = replace(WIDE, min_speculative_tokens=0, max_speculative_tokens=K)


def _plane_s(rows: float, prefill: float) -> float:
    return 0.0015 + 0.0002 * (rows + prefill)


# one point a band of prompt tokens (step_model.remember keeps one a band)
SEEN = tuple(StepPoint(8, p, 1000, _plane_s(8, p), 1) for p in (20, 40, 100))


def _speculating(acceptance: float | None, **values: object) -> Signals:
    steps, rows, prefill = 1000.0, 8.0, 8.0 * K + 20
    drafts = 100.0 if acceptance is not None else 0.0
    accepted = drafts * accepted_share(acceptance, K) if acceptance is not None else 0.0
    return signals(steps=steps, step_seconds=steps * _plane_s(rows, prefill),
                   step_decode_rows=steps * rows, step_prefill_tokens=steps * prefill,
                   step_kv_tokens=steps * 1000, spec_draft_tokens_per_s=drafts,
                   spec_accepted_tokens_per_s=accepted, output_tokens_p50=64.0,
                   **values)  # fmt: skip


@pytest.mark.parametrize(
    ("name", "acceptance", "window", "row", "batch", "k"),
    [
        ("inside the band, free-form: no draft", 0.2, {"p99_latency_s": 0.9}, "hold", 8, 0),
        ("inside the band, copy-heavy: a draft of 2", 0.7, {"p99_latency_s": 0.9}, "hold", 8, 2),
        # the row's own knob moves and k with it
        (
            "KV full, free-form: a smaller batch and no draft",
            0.2,
            {"kv_usage": 0.95, "p99_latency_s": 0.1},
            "kv",
            6,
            0,
        ),
        # no drafts verified: no acceptance measured (none remembered), k kept
        ("no acceptance measured: k kept", None, {"p99_latency_s": 0.9}, "hold", 8, K),
    ],
)
def test_every_row_carries_the_draft_length(
    name: str, acceptance: float | None, window: dict[str, object], row: str, batch: int, k: int
) -> None:
    goal = Goal(E2E, SPEC_BOUNDS)
    d = decide(_speculating(acceptance, **window), SPECULATING, goal,
               PolicyMemory(points=SEEN))  # fmt: skip
    assert d.reason.startswith("fallback (step fit not trusted yet") and f"[{row}]" in d.reason
    assert (d.config.max_batch_size, d.config.num_speculative_tokens) == (batch, k), d.reason
    if k != K:
        assert f"k {K} -> {k} (k {k}: " in d.reason and "tokens/s a row" in d.reason
        assert d.action == ("kv_guard" if row == "kv" else "set_speculation")
    else:
        assert "k " not in d.reason.split("]", 1)[1]
