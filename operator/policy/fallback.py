"""The fallback: a fixed table the round steps by until the step fit is trusted, and
while its recent prediction error is over `PolicyParams.max_error` (round.py says which,
in the reason).

Pure. The window is read once into `Symptoms`; the table's rows are data, tried in
order, first match wins, and `HOLD` where none matches:

| row | when | knobs (the first that moves) | pods |
|---|---|---|---|
| kv | KV at the watermark, or preempting | batch x kv_cut_factor | +1 if spent |
| overloaded | TPOT missed, a queue | none | carrying, TPOT-scaled |
| queueing | a target missed or TPOT tight, a queue | batch grown, no wait | carrying |
| filling | a queue within the SLO | batch grown, no wait | carrying, never fewer |
| running | a target missed, no queue | budget x budget_cut, batch x backoff | TPOT-scaled or +1 |
| headroom | p99s under (1 - band) x target | batch into the steps' room | carrying the rows |

- A knob moves by a factor, at least one step, within its bounds; "no wait" sets the
  timeout to its lower bound (a queue fills any batch without waiting). A row whose knobs
  cannot move is *spent*.
- *Grown*: by capacity_factor, or further to hold the queue beside the rows in flight
  while the steps have room for it. *The steps' room*: `(1 - band) x target / p99`, how
  far the steps may lengthen before TPOT's p99 passes (1 - band) of its target (a step
  grows at most in proportion to its rows); none where TPOT is tight. Where no TPOT is
  stated (or measured), the end-to-end target's, and only while the rows in flight at
  the forecast fill `BINDING_SHARE` of the batch: an answer's time grows at most as its
  steps do, and a batch grown past the rows it carries adds nothing and leaves a surge
  no batch to grow. (A request's rows stay in flight as long, so they rise with the
  arrivals: a load rising through the day binds the batch a start-up from now.)
  With headroom the batch grows into that room: at this load the cap costs nothing, and
  a surge's first window finds it open.
- No knob helps a TPOT missed while requests queue: a larger batch lengthens every step,
  a smaller one lengthens the queue; so pods only. With nothing queued, smaller prefill
  chunks (then fewer rows) shorten the steps. Either way the pods scale with how far
  TPOT's p99 is past its target (*TPOT-scaled*: `ceil(pods x p99 / target)`, an HPA's
  replica calculator on that metric): the prompts computed beside each answer's decode
  steps are what lengthen them, and more pods put fewer beside each.
- The pods that carry the load: the forecast and the backlog drained within a window at
  `SCALE_OUT_UTILISATION` busy, each pod at the throughput a pod showed times the batch's
  growth (the most a larger batch can add; none where TPOT has no room to grow the
  steps), at least a pod more where the row is spent.
- Within the SLO a queue is the batch's to take: `filling` adds pods only where even the
  grown batch cannot carry the forecast and the backlog (a load rising through the day
  reached the miss a round later otherwise), never fewer than there are. Where TPOT is
  *tight* (its p99 past (1 - band) x its target) a larger batch lengthens every step, so
  the batch cannot carry a queue alone there, and `queueing` sizes the pods with it.
- The pods that carry the decode rows: the rows the fleet holds on average (rows a step
  x the share of the window its pods step, at the forecast where arrivals rise) at most
  `SCALE_IN_UTILISATION` of the batch each, never more than the fleet has.

- Every row's knobs, `hold`'s too, carry speculative decoding's k as data, not a row:
  `speculation.draft_length`, the shortest k within 5 % of the most tokens per second a
  row at the window's measured step, from the acceptance measured (or remembered) and the
  step fit's price of a token, trusted or not (a draft token is computed as a prompt
  token); the k in force where either is unknown. The reason says the rates where k moves.

- *A queue* is the one the binding class waits behind (window.py `queueing`, with the
  binding view): the requests of its priority or higher, since a higher class is served
  first and a lower class's queue lengthens only its own wait. So a TPOT missed by a
  high class while only a lower class queues is `running` (a smaller batch), not
  `overloaded`. Without classes, the whole queue.

The replica stabilization (replicas.py) decides when the fleet moves to the pods a row
names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

from batchpilot_operator.policy.reasons import action_of, knob_change, ms
from batchpilot_operator.policy.replicas import Need
from batchpilot_operator.policy.sizing import Sizing
from batchpilot_operator.policy.speculation import Draft, draft_length
from batchpilot_operator.policy.step_model import StepModel, point_of
from batchpilot_operator.policy.types import (
    SCALE_IN_UTILISATION,
    SCALE_OUT_UTILISATION,
    Goal,
    PolicyParams,
)
from batchpilot_operator.policy.window import Window
from batchpilot_server.batching_config import BatchingConfig

# The share of the batch the rows in flight fill where the batch binds the throughput
BINDING_SHARE = 0.8


@dataclass(frozen=True)
class Symptoms:
    """What the table reads from a window, computed once."""

    kv: str | None  # why the KV pool is full (watermark or preemptions); None: it is not
    missed: str | None  # the stated target missed, as the reason words it; None: none
    tpot_missed: bool  # the target missed is TPOT
    # TPOT's p99 past (1 - band) x its target, as the reason words it; None: TPOT is
    # unstated or has room, so the steps may grow longer
    tpot_tight: str | None
    queueing: bool
    headroom: bool  # every stated p99 under (1 - band) x its target, no queue, rows known
    # what the batch may multiply by while TPOT's p99 (else end to end's, where the rows
    # fill the batch) stays within (1 - band) x its target (a step grows at most in
    # proportion to its rows); 1 where TPOT is tight or neither has room
    step_room: float = 1.0
    # what the batch multiplies by to hold the queue beside the rows in flight
    queue_room: float = 1.0
    # the tightest view's TPOT p99 over its target (`Window.tightest`); None: no
    # view states and measured TPOT
    tpot_ratio: float | None = None
    # the k every row's knobs carry (speculation.draft_length); None: the k in force
    draft: Draft | None = None

    @classmethod
    def of(
        cls,
        window: Window,
        goal: Goal,
        current: BatchingConfig,
        model: StepModel | None = None,
    ) -> Symptoms:
        s, slo, batch = window.signals, goal.slo, current.max_batch_size
        kv = None
        if s.kv_usage is not None and s.kv_usage >= slo.kv_high_watermark:
            kv = f"KV usage {s.kv_usage:.2f} >= watermark {slo.kv_high_watermark:.2f}"
        elif s.preemption_rate > 0:
            kv = f"{s.preemption_rate:.2f} preemptions/s"
        bound = window.binding()  # (view, target, ratio) under the most pressure
        missed = None
        if bound is not None and bound[2] > 1:
            view, name, _ = bound
            seen, target = ms(view.observed[name]), ms(view.targets[name])
            missed = f"{view.label(name)} p99 {seen} > target {target}"
        elif bound is None and window.misses_are_evidence():
            judged, missed_n = s.slo_judged, s.slo_missed.get("all", 0)
            missed = f"{missed_n:.0f} of {judged:.0f} judged requests missed"
        # the queue the binding class waits behind: a lower class's is its own to wait in
        queueing = window.queueing(bound[0] if bound is not None else None)
        headroom = (
            bound is not None
            and bound[2] < 1 - goal.params.band
            and not window.queue_grows
            and not queueing
            and window.mean_rows() is not None
        )
        tpot_missed = missed is not None and bound is not None and bound[1] == "tpot"
        # TPOT's room is the tightest class's: a longer step lengthens every class's tokens
        tightest, room = window.tightest("tpot"), 1 - goal.params.band
        label, tpot, tpot_target = tightest if tightest is not None else ("tpot", None, 0.0)
        tpot_tight = None
        if tpot is not None and tpot >= room * tpot_target:
            target = ms(tpot_target)
            tpot_tight = f"{label} p99 {ms(tpot)} past {room:.0%} of its target {target}"
        step_room = 1.0
        if tpot is not None and tpot > 0 and tpot_tight is None:
            step_room = room * tpot_target / tpot
        elif tightest is None:
            step_room = end_to_end_room(window, room, batch)
        tpot_ratio = None if tpot is None else tpot / tpot_target
        queue_room = 1 + window.backlog / (window.pods * batch)
        b = goal.bounds
        draft = draft_length(
            window.acceptance, model, point_of(s), current.num_speculative_tokens,
            b.min_speculative_tokens, b.max_speculative_tokens,
        )  # fmt: skip
        return cls(
            kv, missed, tpot_missed, tpot_tight, queueing, headroom, step_room, queue_room,
            tpot_ratio, draft,
        )  # fmt: skip


def end_to_end_room(window: Window, room: float, batch: int) -> float:
    """The steps' room where no TPOT bounds them: an answer's time grows at most as its
    steps do, so `room x target / p99` of the tightest end-to-end view; taken only where
    the rows in flight at the forecast fill `BINDING_SHARE` of the batch (it binds the
    throughput), since a batch grown past what it carries adds nothing and leaves a surge
    none to grow. 1 where end to end is unstated or unmeasured, or the batch does not
    bind."""
    e2e, in_flight = window.tightest("e2e"), window.rows_at_forecast()
    if e2e is None or e2e[1] <= 0 or in_flight is None or in_flight < BINDING_SHARE * batch:
        return 1.0
    return max(1.0, room * e2e[2] / e2e[1])


Knob = Literal["max_batch_size", "prefill_token_budget"]


@dataclass(frozen=True)
class Move:
    """A knob moved by one of the rule's factors (a `PolicyParams` field), within its
    bounds: up for a factor over 1, down for one under."""

    knob: Knob
    factor: Callable[[PolicyParams, Symptoms], float]

    def apply(self, config: BatchingConfig, goal: Goal, y: Symptoms) -> BatchingConfig:
        b, factor = goal.bounds, self.factor(goal.params, y)
        if factor == 1:
            return config
        low, high = {
            "max_batch_size": (b.min_batch, b.max_batch),
            "prefill_token_budget": (b.min_prefill_budget, b.max_prefill_budget),
        }[self.knob]
        value: int = getattr(config, self.knob)
        # At least one step either way: a factor that rounds back still moves.
        moved = (
            min(high, max(value + 1, round(value * factor)))
            if factor > 1
            else max(low, min(value - 1, math.floor(value * factor)))
        )
        return replace(config, **{self.knob: moved})


# The pods a row names: (window, symptoms, knobs after the row, knobs in force, goal).
Pods = Callable[[Window, Symptoms, BatchingConfig, BatchingConfig, Goal], int]


def _desired(window: Window) -> int:
    return window.fleet.desired if window.fleet is not None else window.pods


def held(window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal) -> int:
    return _desired(window)


def more_where_spent(
    window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal
) -> int:
    return _desired(window) + (moved == c)


def tpot_scaled(window: Window, y: Symptoms) -> int:
    """The pods in proportion to how far TPOT's p99 is past its target, as an HPA's
    replica calculator scales on a metric: the prompts computed beside each answer's
    decode steps, which lengthen them, spread over that many more pods."""
    assert y.tpot_ratio is not None  # TPOT missed: some view measured it
    return math.ceil(_desired(window) * y.tpot_ratio - 1e-9)


def more_where_spent_or_tpot(
    window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal
) -> int:
    if y.tpot_missed:
        return tpot_scaled(window, y)
    return more_where_spent(window, y, moved, c, goal)


def carrying_and_tpot(
    window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal
) -> int:
    return max(carrying(window, y, moved, c, goal), tpot_scaled(window, y))


def carrying(
    window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal
) -> int:
    return max(more_where_spent(window, y, moved, c, goal), demand_pods(window, y, moved, c, goal))


def demand_pods(
    window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal
) -> int:
    # A batch grown by a factor raises a pod's throughput by that factor at most: the pods
    # that carry the demand and drain the backlog even at that best, now, rather than a
    # round and a start-up later. A stated TPOT without headroom takes the growth back:
    # longer steps would miss it.
    growth = moved.max_batch_size / c.max_batch_size if y.tpot_tight is None else 1.0
    per_pod = window.measured_per_pod_rps()
    carried = math.inf if per_pod is None else SCALE_OUT_UTILISATION * per_pod * growth
    demand = window.demand_with_backlog_rps(goal.params.backlog_drain_s)
    return math.ceil(demand / carried - 1e-9)


def demand_or_held(
    window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal
) -> int:
    # Within the SLO the grown batch may carry the queue: the pods grow only where even
    # it cannot carry the forecast, and a queue is never the evidence for fewer
    return max(_desired(window), demand_pods(window, y, moved, c, goal))


def carrying_rows(
    window: Window, y: Symptoms, moved: BatchingConfig, c: BatchingConfig, goal: Goal
) -> int:
    # The decode rows the fleet carries on average (at the forecast: a rising load is no
    # time for fewer), spread over fewer pods, each within the share of the batch.
    carried = window.pods * (window.rows_at_forecast() or 0.0)
    wanted = math.ceil(carried / (SCALE_IN_UTILISATION * c.max_batch_size) - 1e-9)
    return max(1, min(_desired(window), wanted))


@dataclass(frozen=True)
class Row:
    name: str
    when: Callable[[Symptoms], bool]
    why: Callable[[Symptoms], str]
    moves: tuple[Move, ...]  # tried in order: the first that moves a knob is taken
    pods: Pods
    no_wait: bool = False  # the timeout to its lower bound with the move
    spent: str = ""  # what the reason names where the row adds pods


BATCH_CUT_KV = Move("max_batch_size", lambda p, y: p.kv_cut_factor)
BATCH_GROWTH = Move(
    "max_batch_size", lambda p, y: max(p.capacity_factor, min(y.queue_room, y.step_room))
)
BATCH_INTO_ROOM = Move("max_batch_size", lambda p, y: y.step_room)
BUDGET_CUT = Move("prefill_token_budget", lambda p, y: p.budget_cut)
BATCH_BACKOFF = Move("max_batch_size", lambda p, y: p.backoff_factor)

TABLE: tuple[Row, ...] = (
    Row(
        "kv", lambda y: y.kv is not None, lambda y: f"{y.kv}: a smaller batch",
        (BATCH_CUT_KV,), more_where_spent, spent="the batch is at its minimum",
    ),
    Row(
        "overloaded", lambda y: y.tpot_missed and y.queueing,
        lambda y: f"{y.missed}, requests queue: no knob helps, pods carry the load",
        (), carrying_and_tpot, spent="the knobs cannot help",
    ),
    Row(
        "queueing", lambda y: y.queueing and (y.missed or y.tpot_tight) is not None,
        lambda y: f"{y.missed or y.tpot_tight}, requests queue: a larger batch, no wait",
        (BATCH_GROWTH,), carrying, no_wait=True,
        spent="the batch is spent or cannot carry the load alone",
    ),
    Row(
        "filling", lambda y: y.queueing,
        lambda y: "within the SLO, requests queue: a larger batch, no wait",
        (BATCH_GROWTH,), demand_or_held, no_wait=True,
        spent="the grown batch cannot carry the load alone",
    ),
    Row(
        "running", lambda y: y.missed is not None,
        lambda y: f"{y.missed} while running: smaller prefill chunks, then a smaller batch",
        (BUDGET_CUT, BATCH_BACKOFF), more_where_spent_or_tpot,
        spent="the budget and the batch are spent, or TPOT needs fewer prompts a pod",
    ),
    Row(
        "headroom", lambda y: y.headroom,
        lambda y: (
            "every p99 with headroom, no queue: the pods that carry the decode rows in "
            f"flight within {SCALE_IN_UTILISATION:.0%} of the batch each"
        ),
        (BATCH_INTO_ROOM,), carrying_rows,
    ),
)  # fmt: skip
HOLD = Row("hold", lambda y: True, lambda y: "inside the band: nothing to change", (), held)


def apply(
    row: Row, window: Window, y: Symptoms, current: BatchingConfig, goal: Goal
) -> tuple[BatchingConfig, int]:
    """The row's knobs (the first of its moves that moves one), k (every row's: the
    symptoms' draft length), and pods."""
    tried = (move.apply(current, goal, y) for move in row.moves)
    moved = next((c for c in tried if c != current), current)
    if row.no_wait:
        moved = replace(moved, batch_timeout_ms=goal.bounds.min_timeout_ms)
    if y.draft is not None:
        moved = replace(moved, num_speculative_tokens=y.draft.k)
    return moved, row.pods(window, y, moved, current, goal)


def step(
    window: Window, current: BatchingConfig, goal: Goal, model: StepModel | None = None
) -> Sizing:
    """The first row of `TABLE` that matches the window (else `HOLD`), applied. `model`:
    the step fit, trusted or not (it prices the draft tokens); None: none formed."""
    symptoms = Symptoms.of(window, goal, current, model)
    row = next((r for r in TABLE if r.when(symptoms)), HOLD)
    config, pods = apply(row, window, symptoms, current, goal)
    pods_text = "" if window.fleet is None else f", {pods} pod(s)"
    if window.fleet is not None and pods > _desired(window):  # without a fleet: no pods
        pods_text = f"; {row.spent}{pods_text}"
    draft = symptoms.draft
    k_text = (
        f" ({draft.why})" if draft is not None and draft.k != current.num_speculative_tokens else ""
    )
    reason = f"[{row.name}] {row.why(symptoms)}: {knob_change(current, config)}{k_text}{pods_text}"
    need = None if window.fleet is None or goal.replicas is None else Need(pods, reason)
    action = "kv_guard" if row.name == "kv" and config != current else action_of(current, config)
    return Sizing(config, action, reason, need)
