"""The tuning loop: read signals -> decide -> apply -> record, one round at a time.

Every way of tuning runs this loop, and only this loop calls `tuner.decide`.
What differs between them are its three plug points and who paces the rounds:

- the operator (`autotune.py`): signals from Prometheus or a scrape of the
  round's ready pods; the policy's ConfigMap and pods as actuator; status and
  Events as record; a round every `autotune.intervalSeconds`;
- `batchpilot tune` (`tune_local.py`), which `batchpilot demo` runs: signals
  from Prometheus or a scrape of the servers; their URLs as actuator; printed
  lines (the demo's live view and plot) as record; a round every `--interval`;
- the simulator (`tools/simulator.py`): the simulated server is signal source and
  actuator, each interval's record keeps the decision; a virtual clock.

A policy whose goal has replica bounds (`Goal.replicas`) and whose plug
points have a `Scaler` also gets the replica rule (`replica_rule.py`) in the
same round, after the knobs and on the same signals: the knobs are spent
before the pod count moves. A scale step restarts the signal window, as a
change of the knobs does. A scaler that does not own the replica count (an
HPA does, say) answers no fleet, and the rule stands back.

The config in force is the actuator's config of record: the ConfigMap in the
operator, the actuator's memory elsewhere. A decision is in force once the
actuator recorded it, even where some target refused the push; rounds without
a change resync such targets. See docs/tuning.md for why.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from batchpilot_operator.replica_rule import (
    Fleet,
    ReplicaCase,
    ReplicaState,
    ScaleDecision,
    decide_replicas,
)
from batchpilot_operator.signals import Signals
from batchpilot_operator.tuner import (
    Cadence,
    Decision,
    Goal,
    TunerState,
    decide,
    signal_window_s,
)
from batchpilot_server.batching_config import BatchingConfig


@dataclass(frozen=True)
class Applied:
    target: str  # URL or pod name
    version: int | None  # the server's config version after the PUT


@dataclass(frozen=True)
class Refused:
    target: str
    reason: str


@dataclass
class ActuationReport:
    applied: list[Applied] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    config_map_written: bool = False

    @property
    def ok(self) -> bool:
        return not self.refused

    def summary(self) -> str:
        parts = [f"applied on {len(self.applied)}"]
        if self.refused:
            parts.append(f"refused by {self.refusals()}")
        return ", ".join(parts)

    def refusals(self) -> str:
        """Each refusing target with its reason; empty when none refused."""
        return "; ".join(f"{r.target}: {r.reason}" for r in self.refused)


class SignalSource(Protocol):
    async def read(self, window_s: float) -> Signals:
        """What the servers did over (about) the last `window_s` seconds."""
        ...


class Actuator(Protocol):
    async def in_force(self) -> BatchingConfig | None:
        """The config of record; None while there is none yet (nothing to tune)."""
        ...

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        """Record `config` as the one in force, then push it to every target."""
        ...

    async def resync(self, config: BatchingConfig) -> ActuationReport:
        """Push `config` again to the targets that hold other values."""
        ...


class Scaler(Protocol):
    async def fleet(self) -> Fleet | None:
        """The replica count of record and the pods ready; None when something else owns
        the count (the rule then stands back)."""
        ...

    async def scale(self, decision: ScaleDecision) -> None:
        """Record `decision.replicas` as the count of record and start moving the fleet."""
        ...


@dataclass(frozen=True)
class TuneStep:
    """One round: what was seen, decided and done."""

    index: int
    at: float  # the loop's clock when the round decided
    signals: Signals
    before: BatchingConfig  # in force when the round started
    decision: Decision  # its config is in force after the round
    report: ActuationReport  # apply's after a change, resync's otherwise
    scale: ScaleDecision | None = None  # None: the round did not decide the replica count
    fleet: Fleet | None = None  # the fleet the replica rule saw

    @property
    def changed(self) -> bool:
        return self.decision.config != self.before


Recorder = Callable[[TuneStep], Awaitable[None] | None]


@dataclass(frozen=True)
class PlugPoints:
    source: SignalSource
    actuator: Actuator
    recorder: Recorder
    scaler: Scaler | None = None


class TuningLoop:
    """The tuner's state between rounds, and the round itself; the driver paces it."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.state = TunerState()
        self.replica_state = ReplicaState()
        self.rounds = 0

    async def round(
        self,
        goal: Goal,
        cadence: Cadence,
        plugs: PlugPoints,
        guard: contextlib.AbstractAsyncContextManager[object] | None = None,
    ) -> TuneStep | None:
        """One round; None when the actuator has no config in force yet.

        `guard` is held from reading the config in force to the end of the
        record (the operator's per-policy lock: a reconcile must not write the
        ConfigMap in between). Reading the signals, the slow part, stays outside.
        """
        signals = await plugs.source.read(signal_window_s(self.state, cadence))
        async with guard or contextlib.nullcontext():
            before = await plugs.actuator.in_force()
            if before is None:
                return None
            decision = decide(signals, before, goal, self.state)
            if decision.config != before:
                report = await plugs.actuator.apply(decision.config)
            else:
                report = await plugs.actuator.resync(before)
            # From here the decision is in force: a failed record must not repeat it.
            self.state = decision.state
            at = self.clock()
            fleet, scale = await self._scale(goal, plugs, signals, decision, at)
            step = TuneStep(
                self.rounds, at, signals, before, decision, report, scale=scale, fleet=fleet
            )
            self.rounds += 1
            recorded = plugs.recorder(step)
            if recorded is not None:
                await recorded
        return step

    async def _scale(
        self, goal: Goal, plugs: PlugPoints, signals: Signals, decision: Decision, at: float
    ) -> tuple[Fleet | None, ScaleDecision | None]:
        """The replica rule's round, where the goal and the plug points ask for one."""
        if goal.replicas is None or plugs.scaler is None:
            return None, None
        fleet = await plugs.scaler.fleet()
        if fleet is None:
            return None, None
        p = goal.params
        scale = decide_replicas(
            ReplicaCase(
                signals=signals,
                slo_s=goal.slo.e2e_s,
                band=p.band,
                queue_share=p.queue_share,
                knobs_spent=decision.spent,
                capacity=decision.capacity,
                fleet=fleet,
                bounds=goal.replicas,
                state=self.replica_state,
                now=at,
            )
        )
        if scale.replicas != fleet.desired:
            await plugs.scaler.scale(scale)
        if scale.replicas != fleet.desired or scale.settling:
            # The next window must show the new fleet alone.
            self.state = replace(self.state, since_change=0)
        self.replica_state = scale.state
        return fleet, scale
