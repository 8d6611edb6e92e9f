"""The rule's types: what a policy asks of it (the SLO's goal, the knobs' and the replica
count's bounds, the cadence, the rule's constants) and the fleet it sizes.

Everything the rule reads comes in as these values; the round's answer is
`round.Decision`. The replica count's memory (`ReplicaState`) is kept in the policy's
status, so a restarted operator resumes mid-scaling without a second step. Nothing here
imports the rest of the package.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import MAX_SPECULATIVE_TOKENS, BatchingConfig

Action = Literal[
    "hold",
    "clamp",
    "kv_guard",
    "grow_batch",
    "backoff_batch",
    "shrink_timeout",
    "grow_timeout",
    "set_budget",
    "set_speculation",
]


@dataclass(frozen=True)
class Bounds:
    """The range the tuner may move each knob in; the one bounds type of the project."""

    min_batch: int = 1
    max_batch: int = 64
    min_timeout_ms: float = 0.0
    max_timeout_ms: float = 200.0
    # continuous mode's prompt tokens per step (the CRD's batching.prefillTokenBudget)
    min_prefill_budget: int = 2048
    max_prefill_budget: int = 2048
    # draft tokens verified per decode row (the CRD's batching.numSpeculativeTokens);
    # 0..0 by default: speculation stays off unless the policy widens it
    min_speculative_tokens: int = 0
    max_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(
                f"batch bounds must satisfy 1 <= min <= max, got {self.min_batch}..{self.max_batch}"
            )
        if not 0 <= self.min_timeout_ms <= self.max_timeout_ms:
            raise ValueError(
                "timeout bounds must satisfy 0 <= min <= max, got "
                f"{self.min_timeout_ms:g}..{self.max_timeout_ms:g} ms"
            )
        if not 1 <= self.min_prefill_budget <= self.max_prefill_budget:
            raise ValueError(
                "prefill token budget bounds must satisfy 1 <= min <= max, got "
                f"{self.min_prefill_budget}..{self.max_prefill_budget}"
            )
        low, high = self.min_speculative_tokens, self.max_speculative_tokens
        if not 0 <= low <= high <= MAX_SPECULATIVE_TOKENS:  # past it, no server takes k
            raise ValueError(
                "speculative token bounds must satisfy "
                f"0 <= min <= max <= {MAX_SPECULATIVE_TOKENS}, got {low}..{high}"
            )

    def clamp(self, config: BatchingConfig) -> BatchingConfig:
        batch = min(max(config.max_batch_size, self.min_batch), self.max_batch)
        timeout = min(max(config.batch_timeout_ms, self.min_timeout_ms), self.max_timeout_ms)
        budget = min(
            max(config.prefill_token_budget, self.min_prefill_budget), self.max_prefill_budget
        )
        speculative = min(
            max(config.num_speculative_tokens, self.min_speculative_tokens),
            self.max_speculative_tokens,
        )
        return replace(
            config,
            max_batch_size=batch,
            batch_timeout_ms=float(timeout),
            prefill_token_budget=budget,
            num_speculative_tokens=speculative,
        )

    def contains(self, config: BatchingConfig) -> bool:
        return self.clamp(config) == config


@dataclass(frozen=True)
class PolicyParams:
    """The rule's constants; `docs/tuning.md` gives the reasoning for each."""

    band: float = 0.2  # headroom: every observed p99 under (1 - band) x its target
    # The choice: a candidate is eligible when its predicted misses are at most this
    # share of the misses the attainment allows (the stated margin).
    margin_share: float = 0.5
    # The fit's median relative error on the config in force above this: the fallback steps.
    max_error: float = 0.5
    # The fallback table's steps (fallback.py): each knob moves by a factor.
    capacity_factor: float = 1.5  # batch growth where queueing misses a target
    backoff_factor: float = 0.7  # batch cut where running alone misses a target
    kv_cut_factor: float = 0.75  # batch cut at the KV watermark or on preemptions
    budget_cut: float = 0.25  # prefill budget cut: a long prompt's chunk is most of a step
    # The fallback's pods drain the backlog within this long: a fixed horizon, not the
    # window read, which the first round and every change cut to one interval (the same
    # backlog read as twice as urgent there).
    backlog_drain_s: float = 60.0


@dataclass(frozen=True)
class Goal:
    """What a policy asks of the rule: the SLO, the knobs' bounds, the rule's constants."""

    slo: Slo
    bounds: Bounds = field(default_factory=Bounds)
    params: PolicyParams = field(default_factory=PolicyParams)
    replicas: ReplicaBounds | None = None  # None: the loop leaves the replica count alone


@dataclass(frozen=True)
class Cadence:
    """How often the loop decides, and how much history a decision reads at most."""

    interval_s: float = 30.0
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("the interval and the window must be positive")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"the window ({self.window_s:g} s) must be at least the interval "
                f"({self.interval_s:g} s): each decision needs a full interval of data"
            )


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
