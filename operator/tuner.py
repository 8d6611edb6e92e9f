"""The rule's types: the knobs' bounds, the goal, the cadence and a round's decision.

The rule itself is the `policy` package: `policy.round.decide` is the one function
that gives, each round, the knobs, the replica count and (for `mode: auto`) the mode;
`tuning_loop.TuningLoop` is its one caller. docs/tuning.md describes the rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

from batchpilot_operator.policy.memory import SINCE_CHANGE_CAP, PolicyMemory
from batchpilot_operator.policy.mode import ModeChoice
from batchpilot_operator.policy.predictor import Prediction
from batchpilot_operator.replica_rule import ReplicaBounds, ScaleDecision
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig

__all__ = ["Slo"]  # re-exported for the callers that took the SLO from here

Action = Literal[
    "hold",
    "clamp",
    "kv_guard",
    "grow_batch",
    "backoff_batch",
    "shrink_timeout",
    "grow_timeout",
    "set_budget",
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

    def clamp(self, config: BatchingConfig) -> BatchingConfig:
        batch = min(max(config.max_batch_size, self.min_batch), self.max_batch)
        timeout = min(max(config.batch_timeout_ms, self.min_timeout_ms), self.max_timeout_ms)
        budget = min(
            max(config.prefill_token_budget, self.min_prefill_budget), self.max_prefill_budget
        )
        return replace(
            config,
            max_batch_size=batch,
            batch_timeout_ms=float(timeout),
            prefill_token_budget=budget,
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
    # The fit's median relative error on the config in force above this: AIMD steps.
    max_error: float = 0.5
    # The AIMD fallback's steps.
    additive_step: int = 4  # batch growth with headroom while requests queue
    capacity_factor: float = 1.5  # batch growth when queueing breaks a target
    backoff_factor: float = 0.7  # batch cut when running alone breaks a target
    kv_cut_factor: float = 0.75  # batch cut at the KV watermark or on preemptions
    timeout_cut_factor: float = 0.5
    timeout_explains: float = 2.0  # queue wait <= this x timeout: the timeout causes it
    full_batch_share: float = 0.8  # mean batch >= share x max counts as "full"
    queueing_share: float = 0.05  # queue wait p99 >= share x target: requests queue


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


@dataclass(frozen=True)
class Decision:
    """One round's answer: the knobs in force after it, why, and the rest of the round."""

    config: BatchingConfig
    action: Action
    reason: str
    memory: PolicyMemory = field(default_factory=PolicyMemory)
    scale: ScaleDecision | None = None  # None: the round does not own the replica count
    mode: ModeChoice | None = None  # None: the policy's mode is not auto
    prediction: Prediction | None = None  # the chosen candidate's, where the fit chose


def signal_window_s(memory: PolicyMemory, cadence: Cadence) -> float:
    """The window the next signals should cover: never reaching back past the last change.

    Right after a change the window is one interval long, so the rule judges the new
    config alone instead of a blend of old and new.
    """
    since = min(memory.since_change, SINCE_CHANGE_CAP) + 1
    return min(cadence.window_s, cadence.interval_s * since)
