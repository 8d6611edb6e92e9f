"""The replica count: the sizing step's pods needed, held to the stabilization rules.

Pure. The round's sizing step (the chosen candidate, or the fallback table) says how
many pods the window needs and why (`Need`); this part only decides *when* the fleet
moves there, with the rules an HPA user expects:

1. a count outside `minReplicas..maxReplicas` is brought inside at once;
2. hold while the fleet is not what was asked for (pods starting or stopping) or the
   window does not cover every pod yet (`settling`: the loop restarts the window, so
   the next one shows the settled fleet alone); a window without judgement holds;
3. otherwise every round's count (within the bounds) is a recommendation, and the
   fleet moves to: more pods at once, unless within the scale-up stabilization since
   the last change; fewer, the highest recommendation of the scale-down stabilization
   window. The fleet's count of record is a recommendation from the moment it is
   watched (the last change, or the rule's first round: a restarted operator waits a
   window too), so no scale-in comes sooner than a window after it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from batchpilot_operator.policy.types import (
    ARRIVAL_HISTORY,
    RECOMMENDATION_LIMIT,
    Fleet,
    ReplicaBounds,
    ReplicaState,
    ScaleChange,
    ScaleDecision,
)
from batchpilot_operator.signals import Signals


@dataclass(frozen=True)
class Need:
    """The pods the sizing step needs this round, and why (worded for the direction)."""

    pods: int
    reason: str


def observe(state: ReplicaState, signals: Signals, fleet: Fleet | None, now: float) -> ReplicaState:
    """The round's arrivals into the history; a scale-out's lead time once its pods serve."""
    if state.since is None:
        state = replace(state, since=now)
    rate = signals.arrival_rate
    if rate is not None:
        state = replace(state, arrivals=(*state.arrivals, (now, rate))[-ARRIVAL_HISTORY:])
    change = state.last_change
    if (
        fleet is not None
        and change is not None
        and change.after > change.before
        and change.ready_at is None
        and fleet.ready >= fleet.desired
    ):
        state = replace(state, last_change=replace(change, ready_at=now), startup_s=now - change.at)
    return state


def stabilize(
    need: Need | None,
    signals: Signals,
    fleet: Fleet,
    bounds: ReplicaBounds,
    state: ReplicaState,
    now: float,
) -> ScaleDecision:
    """The replica count for this round (see the module docstring); `need` None: the
    window holds no judgement."""
    desired = fleet.desired
    if not bounds.min_replicas <= desired <= bounds.max_replicas:
        return _change(
            state, desired, bounds.clamp(desired), now,
            f"{desired} replicas is outside autoscale's {bounds.min_replicas}.."
            f"{bounds.max_replicas}",
        )  # fmt: skip
    waiting = _waiting(need, signals, fleet)
    if waiting is not None:
        return _hold(state, desired, waiting, settling=_moving(signals, fleet))
    assert need is not None  # _waiting: a window without judgement waits
    wanted = bounds.clamp(need.pods)
    state = _recommend(state, now, wanted, bounds)
    window = bounds.scale_down_stabilization_s
    watched = now - (state.since if state.since is not None else now)
    # The fleet of record counts as needed until it has been watched a whole window.
    highest = max(
        [n for at, n in state.recommendations if at >= now - window]
        + ([desired] if watched < window else [])
    )
    change = state.last_change
    up_allowed = change is None or now - change.at >= bounds.scale_up_stabilization_s
    target = wanted if wanted > desired and up_allowed else min(desired, highest)
    if target == desired:
        held = _held(need, desired, highest, watched, bounds)
        return _hold(state, desired, need.reason if need.pods == desired else held)
    why = need.reason if target > desired else f"{need.reason} for {window:.0f} s"
    return _change(state, desired, target, now, why)


def _moving(signals: Signals, fleet: Fleet) -> bool:
    """Pods starting or stopping, or a window that does not cover them all yet."""
    return fleet.ready < fleet.desired or 0 < signals.pods < fleet.desired


def _waiting(need: Need | None, signals: Signals, fleet: Fleet) -> str | None:
    """Why the round cannot size the fleet yet (wording only), or None."""
    covered = signals.pods or fleet.desired
    if _moving(signals, fleet):
        return (
            f"{fleet.ready} of {fleet.desired} pods ready and the window covers {covered} of "
            f"{fleet.desired} pods: waiting for a window that shows them all"
        )
    if need is None:
        return f"no judgement on this window ({signals.status.replace('_', ' ')})"
    return None


def _held(need: Need, desired: int, highest: int, watched: float, bounds: ReplicaBounds) -> str:
    """What kept the fleet from the pods needed (wording only): a scale-out's bounds, or a
    scale-in's stabilization window."""
    window = bounds.scale_down_stabilization_s
    why = (
        f"maxReplicas {bounds.max_replicas}, scale-up stabilization "
        f"{bounds.scale_up_stabilization_s:.0f} s"
        if need.pods > desired
        else f"{highest} were needed within the last {window:.0f} s, this fleet watched for "
        f"{watched:.0f} s"
    )
    return f"{need.reason}; held at {desired} ({why})"


def _recommend(
    state: ReplicaState, now: float, replicas: int, bounds: ReplicaBounds
) -> ReplicaState:
    keep_from = now - max(bounds.scale_down_stabilization_s, bounds.scale_up_stabilization_s)
    recent = [(at, n) for at, n in state.recommendations if at >= keep_from]
    return replace(state, recommendations=(*recent, (now, replicas))[-RECOMMENDATION_LIMIT:])


def _hold(state: ReplicaState, desired: int, reason: str, settling: bool = False) -> ScaleDecision:
    return ScaleDecision(desired, "hold", reason, state, settling=settling)


def _change(
    state: ReplicaState, desired: int, replicas: int, now: float, reason: str
) -> ScaleDecision:
    changed = replace(
        state,
        last_change=ScaleChange(now, desired, replicas),
        recommendations=(),  # they described another fleet
        since=now,
    )
    action = "scale_out" if replicas > desired else "scale_in"
    return ScaleDecision(replicas, action, f"{desired} -> {replicas} replicas: {reason}", changed)
