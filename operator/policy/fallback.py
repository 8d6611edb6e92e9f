"""The fallback: a fixed table the round steps by until the step fit is trusted, and
while its recent prediction error is over `PolicyParams.max_error` (round.py says which,
in the reason).

Pure. The window is read once into `Symptoms`; the table's rows are data, tried in
order, first match wins:

1. kv: KV use at the watermark, or preemptions: the batch x `kv_cut_factor`;
2. overloaded: TPOT missed while requests queue: no knob helps (a larger batch
   lengthens every step, a smaller one lengthens the queue): pods only;
3. queueing: requests queue (a target missed or not): the batch x `capacity_factor`,
   and the timeout to its lower bound (a queue fills any batch without waiting); the
   pods that carry the load where a target is missed (within the SLO the knobs go first);
4. running: a target missed with nothing queueing: the prefill budget x `budget_cut`
   (smaller chunks of the long prompts beside each decode step), then the batch x
   `backoff_factor`; a TPOT missed adds a pod beside the cut;
5. headroom: every p99 under (1 - band) x its target and no queue: no knob moves, and
   the pods are those that carry the decode rows in flight (rows a step x busy share)
   at most `SCALE_IN_UTILISATION` of the batch each;
6. hold: anything else (inside the band).

A knob moves by a factor (at least one step, within its bounds); where the row's knob is
spent, a pod more takes its part of the load instead. Queueing (a target missed) and overloaded size
the fleet at once: the pods that carry the forecast and drain the backlog within a window at
`SCALE_OUT_UTILISATION` busy, each at the throughput a pod showed times the batch's
growth (the most a larger batch can add). The replica stabilization
(replicas.py) decides when the fleet moves to the pods a row names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace

from batchpilot_operator.policy.reasons import action_of, knob_change, ms
from batchpilot_operator.policy.replicas import Need
from batchpilot_operator.policy.sizing import Sizing
from batchpilot_operator.policy.types import SCALE_IN_UTILISATION, SCALE_OUT_UTILISATION, Goal
from batchpilot_operator.policy.window import Window
from batchpilot_server.batching_config import BatchingConfig


@dataclass(frozen=True)
class Symptoms:
    """What the table reads from a window, computed once."""

    kv: str | None  # why the KV pool is full (watermark or preemptions); None: it is not
    missed: str | None  # the stated target missed, as the reason words it; None: none
    tpot_missed: bool  # the target missed is TPOT: a larger batch only lengthens the steps
    queueing: bool
    headroom: bool  # every stated p99 under (1 - band) x its target, and no growing queue

    @classmethod
    def of(cls, window: Window, goal: Goal) -> Symptoms:
        s, slo = window.signals, goal.slo
        kv = None
        if s.kv_usage is not None and s.kv_usage >= slo.kv_high_watermark:
            kv = f"KV usage {s.kv_usage:.2f} >= watermark {slo.kv_high_watermark:.2f}"
        elif s.preemption_rate > 0:
            kv = f"{s.preemption_rate:.2f} preemptions/s"
        pressure = window.pressure()
        missed = None
        if pressure is not None and pressure[1] > 1:
            name = pressure[0]
            missed = f"{name} p99 {ms(window.observed()[name])} > target {ms(slo.stated[name])}"
        elif pressure is None and window.misses_are_evidence():
            judged, missed_n = s.slo_judged, s.slo_missed.get("all", 0)
            missed = f"{missed_n:.0f} of {judged:.0f} judged requests missed"
        headroom = (
            pressure is not None and pressure[1] < 1 - goal.params.band and not window.queue_grows
        )
        tpot_missed = missed is not None and pressure is not None and pressure[0] == "tpot"
        return cls(kv, missed, tpot_missed, window.queueing(), headroom)


@dataclass(frozen=True)
class Row:
    name: str
    when: Callable[[Symptoms], bool]
    act: Callable[[Window, BatchingConfig, Goal, Symptoms], tuple[BatchingConfig, int]]
    why: Callable[[Symptoms], str]
    spent: str = ""  # what the row names when its knob is spent and a pod takes its part


def _cut(value: int, factor: float, low: int) -> int:
    """A factor down, at least one step (a factor that rounds back still moves), not below
    `low`."""
    return max(low, min(value - 1, math.floor(value * factor)))


def _grow(value: int, factor: float, high: int) -> int:
    return min(high, max(value + 1, round(value * factor)))


def _spent(moved: BatchingConfig, current: BatchingConfig, desired: int) -> int:
    """A pod more where the row could move no knob."""
    return desired + (moved == current)


def _kv(window: Window, c: BatchingConfig, goal: Goal, y: Symptoms) -> tuple[BatchingConfig, int]:
    b, p = goal.bounds, goal.params
    moved = replace(c, max_batch_size=_cut(c.max_batch_size, p.kv_cut_factor, b.min_batch))
    return moved, _spent(moved, c, _desired(window))


def _queueing(
    window: Window, c: BatchingConfig, goal: Goal, y: Symptoms
) -> tuple[BatchingConfig, int]:
    b, p = goal.bounds, goal.params
    moved = replace(
        c, max_batch_size=_grow(c.max_batch_size, p.capacity_factor, b.max_batch),
        batch_timeout_ms=b.min_timeout_ms,
    )  # fmt: skip
    # Within the SLO the knobs go first: a queue behind full batches is the batch's to take.
    return moved, _carrying(window, moved, c, goal) if y.missed else _desired(window)


def _overloaded(
    window: Window, c: BatchingConfig, goal: Goal, y: Symptoms
) -> tuple[BatchingConfig, int]:
    return c, _carrying(window, c, c, goal)


def _carrying(window: Window, moved: BatchingConfig, c: BatchingConfig, goal: Goal) -> int:
    # A batch grown by a factor raises a pod's throughput by that factor at most: the pods
    # that carry the demand and drain the backlog even at that best, now, rather than a
    # round and a start-up later; where the batch is spent, a pod more at least. A stated
    # TPOT without headroom takes the growth back: longer steps would miss it.
    tpot = window.observed().get("tpot")
    tpot_room = tpot is None or tpot < (1 - goal.params.band) * goal.slo.stated["tpot"]
    growth = moved.max_batch_size / c.max_batch_size if tpot_room else 1.0
    per_pod = window.measured_per_pod_rps()
    carried = math.inf if per_pod is None else SCALE_OUT_UTILISATION * per_pod * growth
    needed = math.ceil(window.demand_with_backlog_rps / carried - 1e-9)
    return max(_desired(window) + (moved == c), needed)


def _running(
    window: Window, c: BatchingConfig, goal: Goal, y: Symptoms
) -> tuple[BatchingConfig, int]:
    b, p = goal.bounds, goal.params
    budget = _cut(c.prefill_token_budget, p.budget_cut, b.min_prefill_budget)
    moved = (
        replace(c, prefill_token_budget=budget)
        if budget != c.prefill_token_budget
        else replace(c, max_batch_size=_cut(c.max_batch_size, p.backoff_factor, b.min_batch))
    )
    # A TPOT missed while nothing queues is the prompts computed beside the decode steps
    # as often as the rows: fewer arrivals a pod put fewer prompts beside each answer, so
    # a pod more goes with the cut.
    return moved, _spent(moved, c, _desired(window)) + (y.tpot_missed and moved != c)


def _headroom(
    window: Window, c: BatchingConfig, goal: Goal, y: Symptoms
) -> tuple[BatchingConfig, int]:
    rows = window.mean_rows()
    if rows is None:
        return c, _desired(window)
    # The decode rows the fleet carries on average (the rows a step runs times the share
    # of the window its pods step: a pod serving a few long answers steps all the time),
    # spread over fewer pods, each within the share of the batch.
    s = window.signals
    busy = 1.0 if s.utilisation is None else min(1.0, s.utilisation)
    carried = window.pods * rows * busy
    wanted = math.ceil(carried / (SCALE_IN_UTILISATION * c.max_batch_size) - 1e-9)
    return c, max(1, min(_desired(window), wanted))


def _hold(window: Window, c: BatchingConfig, goal: Goal, y: Symptoms) -> tuple[BatchingConfig, int]:
    return c, _desired(window)


def _desired(window: Window) -> int:
    return window.fleet.desired if window.fleet is not None else window.pods


TABLE: tuple[Row, ...] = (
    Row(
        "kv",
        lambda y: y.kv is not None,
        _kv,
        lambda y: f"{y.kv}: a smaller batch",
        "the batch is at its minimum",
    ),
    Row(
        "overloaded",
        lambda y: y.tpot_missed and y.queueing,
        _overloaded,
        lambda y: f"{y.missed}, requests queue: no knob helps, pods carry the load",
        "the knobs cannot help",
    ),
    Row(
        "queueing",
        lambda y: y.queueing,
        _queueing,
        lambda y: f"{y.missed or 'within the SLO'}, requests queue: a larger batch, no wait",
        "the batch is spent or cannot carry the load alone",
    ),
    Row(
        "running",
        lambda y: y.missed is not None,
        _running,
        lambda y: f"{y.missed} while running: smaller prefill chunks, then a smaller batch",
        "the budget and the batch are spent",
    ),
    Row(
        "headroom",
        lambda y: y.headroom and not y.queueing,
        _headroom,
        lambda y: (
            "every p99 with headroom, no queue: the pods that carry the decode rows in "
            f"flight within {SCALE_IN_UTILISATION:.0%} of the batch each"
        ),
    ),
    Row("hold", lambda y: True, _hold, lambda y: "inside the band: nothing to change"),
)


def step(window: Window, current: BatchingConfig, goal: Goal) -> Sizing:
    """The first row of `TABLE` that matches the window, applied."""
    symptoms = Symptoms.of(window, goal)
    row = next(r for r in TABLE if r.when(symptoms))
    config, pods = row.act(window, current, goal, symptoms)
    pods_text = "" if window.fleet is None else f", {pods} pod(s)"
    if pods > _desired(window):
        pods_text = f"; {row.spent}{pods_text}"
    reason = f"[{row.name}] {row.why(symptoms)}: {knob_change(current, config)}{pods_text}"
    need = None if window.fleet is None or goal.replicas is None else Need(pods, reason)
    action = "kv_guard" if row.name == "kv" and config != current else action_of(current, config)
    return Sizing(config, action, reason, need)
