"""An HPA-like replica rule for the tuner benchmark's baseline (not the operator's).

The Horizontal Pod Autoscaler's algorithm (autoscaling/v2) on one metric:
`desired = ceil(current * metric / target)`, nothing done within the 10%
tolerance, scale-up limited by the default policies (double, or four pods more,
per 15 s period, whichever is more), scale-down to the highest
recommendation of the last 300 s (the default stabilization window), up at
once (0 s). The metric is either the fleet's p99 (an Object metric from
Prometheus: `current` is the replica count of record) or the pods' average
utilisation (a Pods metric: `current` is the pods that report it). It never
touches the knobs: the benchmark runs it with the batching config at its
default, as a user of HPA alone would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from batchpilot_operator.policy.types import (
    Fleet,
    ReplicaBounds,
    ReplicaState,
    ScaleChange,
    ScaleDecision,
)
from batchpilot_operator.signals import Signals

HpaMetric = Literal["p99", "utilisation"]

TOLERANCE = 0.1  # kube-controller-manager's --horizontal-pod-autoscaler-tolerance
UP_PERCENT, UP_PODS = 100, 4  # the default scaleUp policies per 15 s, selectPolicy Max


@dataclass(frozen=True)
class HpaRule:
    metric: HpaMetric
    target: float  # seconds of p99, or a share of busy time
    bounds: ReplicaBounds

    def decide(
        self, signals: Signals, fleet: Fleet, state: ReplicaState, now: float
    ) -> ScaleDecision:
        current = fleet.desired
        value, basis = self._metric(signals, fleet)
        if value is None or basis <= 0:
            return ScaleDecision(current, "hold", f"no {self.metric} metric", state)
        ratio = value / self.target
        raw = current if abs(ratio - 1.0) <= TOLERANCE else math.ceil(basis * ratio - 1e-9)
        reason = f"{self.metric} {value:.3g} against target {self.target:.3g}"
        return hpa_decision(raw, current, self.bounds, state, now, reason)

    def _metric(self, signals: Signals, fleet: Fleet) -> tuple[float | None, int]:
        """The metric's value and the replica count it scales (see the module docstring)."""
        if not signals.ok:
            return None, 0
        if self.metric == "p99":
            return signals.p99_latency_s, fleet.desired
        return signals.utilisation, signals.pods


def hpa_decision(
    raw: int, current: int, bounds: ReplicaBounds, state: ReplicaState, now: float, reason: str
) -> ScaleDecision:
    """HPA's default behaviour around a raw recommendation: the scale-up policies' limit,
    the bounds, then down only to the highest recommendation of the scale-down window
    (up at once). Shared by the HPA-like rules here and the KEDA-style one
    (bench/planner_baselines.py), since KEDA hands its metric to an HPA."""
    limit = max(current * (100 + UP_PERCENT) // 100, current + UP_PODS)
    recommended = bounds.clamp(min(raw, limit))
    window = bounds.scale_down_stabilization_s
    recent = [(at, n) for at, n in state.recommendations if at > now - window]
    recs = (*recent, (now, recommended))
    replicas = recommended if recommended >= current else min(current, max(n for _, n in recs))
    kept = replace(state, recommendations=recs)
    reason = f"{reason}: {recommended}"
    if replicas == current:
        return ScaleDecision(current, "hold", reason, kept)
    action = "scale_out" if replicas > current else "scale_in"
    changed = replace(kept, last_change=ScaleChange(now, current, replicas))
    return ScaleDecision(replicas, action, f"{current} -> {replicas}: {reason}", changed)
