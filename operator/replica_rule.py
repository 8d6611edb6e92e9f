"""The replica rule: how many pods a policy runs, decided after the knobs each round.

Pure and deterministic, like the tuner: the same (signals, knob decision,
fleet, bounds, state, now) always gives the same answer. It runs in the same
round as `tuner.decide`, on the same signals, after it, so that the knobs are
spent before the pod count moves:

1. hold while the fleet is not what was asked for (pods still starting or
   stopping) or the window does not cover every pod yet: a scale step's
   effect must be seen before the next one (`settling`: the loop restarts
   the window, so the next one shows the settled fleet alone);
2. scale out when the SLO is broken by queueing, or the capacity model says
   the demand exceeds what the pods can carry at all, *and* the knobs cannot
   add capacity: the batch is at the most the knobs may give (bound, probing
   ceiling, the SLO's running-time cap) or cut by the KV guard or a back-off.
   With a model that says even the batch limit cannot carry the demand, the
   knobs and the pods move in the same round;
   The step is sized, not one pod at a time: enough pods that each carries at
   most `SCALE_OUT_UTILISATION` of its throughput (the model's at the batch
   limit, else the measured completions per saturated pod), for the arrivals
   the new pods will meet: a steady rise is forecast over the lead time (the
   last start-up and a round), one jump is not;
3. scale in when fewer pods would carry the demand at `SCALE_IN_UTILISATION`
   of their throughput, the SLO has headroom and nothing queues, for a whole
   scale-down stabilization window (the window's highest recommendation
   wins, as HPA does), and never before the fleet has been watched that long
   since the last change (or since the rule's first round: a restarted
   operator waits a window too);
4. `minReplicas <= replicas <= maxReplicas` always.

The two utilisations leave a band between them, so a steady load that sits
at one pod count recommends that same count from both sides: no flapping.
docs/tuning.md gives the numbers behind each constant.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from batchpilot_operator.capacity_model import TRUSTED_WINDOWS
from batchpilot_operator.signals import Signals

ScaleAction = Literal["hold", "scale_out", "scale_in"]

SCALE_OUT_UTILISATION = 0.8  # a scale-out sizes the fleet so each pod runs at most this busy
SCALE_IN_UTILISATION = 0.6  # a scale-in only to a fleet that would run at most this busy
RECOMMENDATION_LIMIT = 64  # kept rounds, whatever the window (a 300 s window at 30 s is 11)
# Rounds of arrivals kept for the forecast: three round-to-round rises, whose median is
# the trend (one jump, a step or a flash crowd, is no trend; a steady climb is).
ARRIVAL_HISTORY = 4
# HPA's default scale-down stabilization: long enough to ride out a lull between bursts.
SCALE_DOWN_STABILIZATION_S = 300.0


@dataclass(frozen=True)
class ReplicaBounds:
    """`spec.autoscale`: the range the rule moves the replica count in, and its patience."""

    min_replicas: int = 1
    max_replicas: int = 10
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = SCALE_DOWN_STABILIZATION_S

    def __post_init__(self) -> None:
        # At least one pod: a fleet of none has no signals to scale up from.
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                "replica bounds must satisfy 1 <= min <= max, got "
                f"{self.min_replicas}..{self.max_replicas}"
            )
        if self.scale_up_stabilization_s < 0 or self.scale_down_stabilization_s < 0:
            raise ValueError("stabilization windows cannot be negative")

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class Fleet:
    """The replica count of record and how many of its pods serve now."""

    desired: int
    ready: int


@dataclass(frozen=True)
class Capacity:
    """What the knob decision leaves for the replica rule: how far the batch may go now,
    and what one pod carries there."""

    batch_limit: int  # the most batch the knobs may give (bounds, ceiling, running-time cap)
    per_pod_rps: float  # one always-busy pod at batch_limit, by the capacity model
    demand_rps: float  # the fleet's arrivals plus its backlog to drain (the knobs' target)
    prediction: str  # the model and its numbers, for reasons
    windows: int = 0  # how many windows the model's line went through


@dataclass(frozen=True)
class ScaleChange:
    at: float
    before: int
    after: int
    ready_at: float | None = None  # the first round that found a scale-out's pods all ready


@dataclass(frozen=True)
class ReplicaState:
    """What the rule remembers between rounds; the operator keeps it in the policy's status,
    so a restarted operator resumes mid-scaling without a second step."""

    last_change: ScaleChange | None = None
    recommendations: tuple[tuple[float, int], ...] = ()  # (at, replicas), newest last
    # Since when this fleet has been watched: the last change, or the rule's first round.
    since: float | None = None
    arrivals: tuple[tuple[float, float], ...] = ()  # (at, req/s) of the last rounds, newest last
    startup_s: float | None = None  # how long the last scale-out took to serve: its lead time

    def to_dict(self) -> dict[str, Any]:
        change = self.last_change
        return {
            "since": self.since,
            "lastChange": None
            if change is None
            else {
                "at": change.at,
                "from": change.before,
                "to": change.after,
                "readyAt": change.ready_at,
            },
            "recommendations": [[at, n] for at, n in self.recommendations],
            "arrivals": [[at, rps] for at, rps in self.arrivals],
            "startupSeconds": self.startup_s,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ReplicaState:
        """Whatever was stored; what cannot be read is left out (a fresh rule is safe)."""
        if not isinstance(data, dict):
            return cls()
        change = data.get("lastChange")
        last: ScaleChange | None = None
        try:
            if isinstance(change, dict):
                last = ScaleChange(
                    float(change["at"]), int(change["from"]), int(change["to"]),
                    _finite(change.get("readyAt")),
                )  # fmt: skip
        except (KeyError, TypeError, ValueError):
            last = None
        return cls(
            last,
            tuple(_pairs(data.get("recommendations"), int)[-RECOMMENDATION_LIMIT:]),
            _finite(data.get("since")),
            tuple(_pairs(data.get("arrivals"), float)[-ARRIVAL_HISTORY:]),
            _finite(data.get("startupSeconds")),
        )


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def _pairs(items: Any, kind: type[int] | type[float]) -> list[tuple[float, Any]]:
    """The readable (at, value) pairs of a stored list; the rest is left out."""
    pairs: list[tuple[float, Any]] = []
    for item in items if isinstance(items, list) else []:
        try:
            at, value = item
            pairs.append((float(at), kind(value)))
        except (TypeError, ValueError):
            continue
    return pairs


@dataclass(frozen=True)
class ScaleDecision:
    replicas: int
    action: ScaleAction
    reason: str
    state: ReplicaState = field(default_factory=ReplicaState)
    # The fleet is still moving (pods starting, or not yet in a whole window): the next
    # window must start now, so that it shows the fleet that will be judged.
    settling: bool = False


@dataclass(frozen=True)
class ReplicaCase:
    """One round's inputs to the rule."""

    signals: Signals
    slo_s: float
    band: float  # the tuner's hysteresis band: headroom means p99 < (1 - band) * SLO
    queue_share: float  # queue wait >= share * p99: the breach is queueing
    knobs_spent: bool  # the knob decision cannot add capacity
    capacity: Capacity | None
    fleet: Fleet
    bounds: ReplicaBounds
    state: ReplicaState
    now: float


def decide_replicas(case: ReplicaCase) -> ScaleDecision:
    """The replica count for this round; see the module docstring."""
    if case.state.since is None:
        case = replace(case, state=replace(case.state, since=case.now))
    case = replace(case, state=_observe(case))
    if case.capacity is not None and case.capacity.windows < TRUSTED_WINDOWS:
        case = replace(case, capacity=None)  # a young line moves no pods: measure instead
    fleet, bounds, signals = case.fleet, case.bounds, case.signals
    desired = fleet.desired
    if not bounds.min_replicas <= desired <= bounds.max_replicas:
        target = bounds.clamp(desired)
        return _change(
            case, target, f"{desired} replicas is outside autoscale's "
            f"{bounds.min_replicas}..{bounds.max_replicas}",
        )  # fmt: skip
    if fleet.ready < desired:
        return _settling(case, f"{fleet.ready} of {desired} pods ready: waiting for them")
    if signals.pods and signals.pods < desired:
        return _settling(
            case, f"the window covers {signals.pods} of {desired} pods: waiting for one that "
            "shows them all",
        )  # fmt: skip
    if not signals.ok or signals.p99_latency_s is None:
        return _hold(case, f"no judgement on this window ({signals.status.replace('_', ' ')})")
    out = _scale_out(case)
    if out is not None:
        return out
    return _scale_in(case)


def _scale_out(case: ReplicaCase) -> ScaleDecision | None:
    signals, desired = case.signals, case.fleet.desired
    p99 = signals.p99_latency_s or 0.0
    queue_wait = signals.queue_wait_p99_s or 0.0
    breach = p99 > case.slo_s and queue_wait >= case.queue_share * p99
    per_pod = _per_pod_throughput(case)
    # The model says even the batch limit cannot carry the demand: knobs and pods move
    # together, in this round (a 5x step is no time to wait a round per knob).
    overload = (
        case.capacity is not None and per_pod is not None and _demand(case) > desired * per_pod
    )
    if not (breach or overload):
        return None
    head = (
        f"p99 {_ms(p99)} > SLO {_ms(case.slo_s)} from queueing (queue wait p99 {_ms(queue_wait)})"
        if breach
        else f"demand {_rate(case)} exceeds what {desired} pod(s) carry"
    )
    if not (case.knobs_spent or overload):
        return _hold(case, f"{head}, but the batch can still grow: knobs first")
    if desired >= case.bounds.max_replicas:
        return _hold(case, f"{head} at maxReplicas {desired}: the load exceeds the fleet")
    change = case.state.last_change
    if change is not None and case.now - change.at < case.bounds.scale_up_stabilization_s:
        return _hold(case, f"{head}; scale-up stabilization since the last change")
    if per_pod is None or per_pod <= 0:
        return _hold(case, f"{head}, but no pod throughput is known yet to size the step")
    wanted = math.ceil(_demand(case) / (SCALE_OUT_UTILISATION * per_pod) - 1e-9)
    target = case.bounds.clamp(max(desired + 1, wanted))
    return _change(
        case, target,
        f"{head} and the batch is spent: {_rate(case)} over {per_pod:.2f} req/s per pod "
        f"({_basis(case, case.capacity is None)}) needs {wanted} at "
        f"{SCALE_OUT_UTILISATION:.0%} busy",
    )  # fmt: skip


def _scale_in(case: ReplicaCase) -> ScaleDecision:
    signals, desired, bounds = case.signals, case.fleet.desired, case.bounds
    p99 = signals.p99_latency_s or 0.0
    measured = case.capacity is None
    per_pod = _per_pod_throughput(case)
    if per_pod is None or per_pod <= 0:
        return _hold(case, "no pod throughput known: the replica count stays")
    wanted = bounds.clamp(math.ceil(_demand(case) / (SCALE_IN_UTILISATION * per_pod) - 1e-9))
    # A request or two waiting on an idle pod's batch timeout is no queueing: the p99 says
    # whether anything waits too long.
    quiet = p99 < (1 - case.band) * case.slo_s
    # A round that is not quiet recommends what runs now: it keeps the count up.
    recommended = wanted if quiet else max(wanted, desired)
    case = replace(case, state=_recommend(case.state, case.now, recommended, bounds))
    if recommended >= desired:
        return _hold(case, f"{desired} pod(s) needed for {_rate(case)}")
    window = bounds.scale_down_stabilization_s
    watched = case.now - (case.state.since if case.state.since is not None else case.now)
    if watched < window:
        return _hold(
            case, f"{wanted} pod(s) would do, but this fleet has been watched for "
            f"{watched:.0f} s of the {window:.0f} s scale-down stabilization",
        )  # fmt: skip
    in_window = [n for at, n in case.state.recommendations if at >= case.now - window]
    highest = max(in_window)
    if highest >= desired:
        return _hold(
            case, f"{wanted} pod(s) would do now, but {highest} were needed within the last "
            f"{window:.0f} s",
        )  # fmt: skip
    return _change(
        case, highest,
        f"p99 {_ms(p99)} with headroom: {_rate(case)} over {per_pod:.2f} req/s per pod "
        f"({_basis(case, measured)}) needs {highest} at {SCALE_IN_UTILISATION:.0%} busy for "
        f"{window:.0f} s",
    )  # fmt: skip


def _per_pod_throughput(case: ReplicaCase) -> float | None:
    """The model's throughput at the batch limit; without a model, what each pod finished
    over the share of the window it was busy (a saturated pod, busy all along, finishes
    what it can; one busy a third of the time would carry three times as much at the
    config in force, more at a larger batch)."""
    if case.capacity is not None:
        return case.capacity.per_pod_rps
    return _measured_throughput(case)


def _measured_throughput(case: ReplicaCase) -> float | None:
    signals = case.signals
    pods = signals.pods or case.fleet.ready
    if pods <= 0 or signals.finished_rate <= 0:
        return None
    queueing = (signals.queue_wait_p99_s or 0.0) >= case.queue_share * (signals.p99_latency_s or 0)
    busy = 1.0 if queueing else signals.utilisation
    if busy is None or busy <= 0:
        return None
    return signals.finished_rate / (pods * min(1.0, busy))


def _observe(case: ReplicaCase) -> ReplicaState:
    """The round's arrivals into the history; a scale-out's lead time once its pods serve."""
    state, rate = case.state, case.signals.arrival_rate
    if rate is not None:
        state = replace(state, arrivals=(*state.arrivals, (case.now, rate))[-ARRIVAL_HISTORY:])
    change = state.last_change
    if (
        change is not None
        and change.after > change.before
        and change.ready_at is None
        and case.fleet.ready >= case.fleet.desired
    ):
        state = replace(
            state, last_change=replace(change, ready_at=case.now), startup_s=case.now - change.at
        )
    return state


@dataclass(frozen=True)
class Forecast:
    """The arrivals a pod started now would meet once it serves: now's, plus the recent
    rise over the lead time (the last scale-out's start-up, or a round before one was
    seen, and a round for its effect to show)."""

    now_rps: float
    rise_per_s: float = 0.0
    lead_s: float = 0.0

    @property
    def rps(self) -> float:
        return self.now_rps + self.rise_per_s * self.lead_s


def _forecast(case: ReplicaCase) -> Forecast:
    now, history = case.signals.demand_rate, case.state.arrivals
    rises = [(b - a) / (tb - ta) for (ta, a), (tb, b) in itertools.pairwise(history) if tb > ta]
    if len(rises) < ARRIVAL_HISTORY - 1:
        return Forecast(now)
    gap = (history[-1][0] - history[0][0]) / (len(history) - 1)
    startup = case.state.startup_s if case.state.startup_s is not None else gap
    return Forecast(now, max(0.0, statistics.median(rises)), gap + startup)


def _demand(case: ReplicaCase) -> float:
    """The arrivals alone, as forecast: a backlog drains with any spare capacity, and pods
    started for it would have to be stopped again once it is gone."""
    return _forecast(case).rps


def _basis(case: ReplicaCase, measured: bool) -> str:
    if case.capacity is not None and not measured:
        return f"model at batch {case.capacity.batch_limit}: {case.capacity.prediction}"
    return "measured: finished per busy second"


def _rate(case: ReplicaCase) -> str:
    forecast = _forecast(case)
    if forecast.rise_per_s <= 0:
        return f"{forecast.now_rps:.2f} req/s"
    return (
        f"{forecast.now_rps:.2f} req/s, rising to {forecast.rps:.2f} req/s in "
        f"{forecast.lead_s:.0f} s"
    )


def _recommend(
    state: ReplicaState, now: float, replicas: int, bounds: ReplicaBounds
) -> ReplicaState:
    keep_from = now - max(bounds.scale_down_stabilization_s, bounds.scale_up_stabilization_s)
    recent = [(at, n) for at, n in state.recommendations if at >= keep_from]
    return replace(state, recommendations=(*recent, (now, replicas))[-RECOMMENDATION_LIMIT:])


def _hold(case: ReplicaCase, reason: str) -> ScaleDecision:
    return ScaleDecision(case.fleet.desired, "hold", reason, case.state)


def _settling(case: ReplicaCase, reason: str) -> ScaleDecision:
    return ScaleDecision(case.fleet.desired, "hold", reason, case.state, settling=True)


def _change(case: ReplicaCase, replicas: int, reason: str) -> ScaleDecision:
    desired = case.fleet.desired
    action: ScaleAction = "scale_out" if replicas > desired else "scale_in"
    state = replace(
        case.state,
        last_change=ScaleChange(case.now, desired, replicas),
        # Recommendations from before the change described another fleet.
        recommendations=(),
        since=case.now,
    )
    return ScaleDecision(replicas, action, f"{desired} -> {replicas} replicas: {reason}", state)


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"
