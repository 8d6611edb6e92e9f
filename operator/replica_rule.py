"""The replica count's types: its bounds, the fleet, the rule's memory and its answer.

The count itself comes from the round's one sizing step (`policy/round.py`): the pods
needed by the chosen candidate, or by the AIMD fallback, held to the stabilization,
drain and bounds rules of `policy/replicas.py`. What lives here is shared with the
operator (status, scaler), the simulator and bench/hpa.py; the memory is kept in the
policy's status, so a restarted operator resumes mid-scaling without a second step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

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
