"""The tuning loop: read signals -> decide -> apply -> record, one round at a time.

Every way of tuning runs this loop, and only this loop calls the rule
(`policy.round.decide`). What differs between them are its plug points and who
paces the rounds:

- the operator (`autotune.py`): signals from Prometheus or a scrape of the
  round's ready pods; the policy's ConfigMap and pods as actuator; status and
  Events as record; a round every `autotune.intervalSeconds`;
- `batchpilot tune` (`tune_local.py`), which `batchpilot demo` runs: signals
  from Prometheus or a scrape of the servers; their URLs as actuator; printed
  lines (the demo's live view and plot) as record; a round every `--interval`;
- the simulator (`tools/simulator.py`): the simulated server is signal source and
  actuator, each interval's record keeps the decision; a virtual clock.

The rule gives the knobs, the replica count and the mode from one decision.
A policy whose goal has replica bounds (`Goal.replicas`) and whose plug
points have a `Scaler` gets the replica count from it: the fleet is read
before the decision and moved after the knobs are applied. A scaler that does
not own the replica count (an HPA does, say) answers no fleet, and the count
stays. Plug points with a `ModeSwitch` (a `mode: auto` policy) get the mode
choice in the same round. The rule's memory has one writer: the decision
carries the next one, and the loop keeps it.

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

from batchpilot_operator.policy.memory import PolicyMemory
from batchpilot_operator.policy.mode import ModeChoice
from batchpilot_operator.policy.round import Decision, decide, signal_window_s
from batchpilot_operator.policy.types import Cadence, Fleet, Goal, ReplicaState, ScaleDecision
from batchpilot_operator.signals import Signals
from batchpilot_server.batching_config import BatchingConfig, Mode


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


class ModeSwitch(Protocol):
    async def in_force(self) -> Mode:
        """The serving mode the pods run now (the mode choice's `current`)."""
        ...

    async def switch(self, choice: ModeChoice) -> None:
        """Put `choice.mode` in force (the pods roll to it) and announce it."""
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
    fleet: Fleet | None = None  # the fleet the round saw (None: it does not own the count)

    @property
    def scale(self) -> ScaleDecision | None:
        """The replica count's decision; None: the round did not decide it."""
        return self.decision.scale

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
    modes: ModeSwitch | None = None  # `mode: auto` only


class TuningLoop:
    """The rule's memory between rounds, and the round itself; the driver paces it."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.memory = PolicyMemory()
        self.rounds = 0

    def resume(self, replicas: ReplicaState) -> None:
        """Start from the replica count's memory of a previous run (the policy's status),
        before the first round: a scale step in flight is not repeated."""
        self.memory = replace(self.memory, replicas=replicas)

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
        signals = await plugs.source.read(signal_window_s(self.memory, cadence))
        async with guard or contextlib.nullcontext():
            before = await plugs.actuator.in_force()
            if before is None:
                return None
            fleet = None
            if goal.replicas is not None and plugs.scaler is not None:
                fleet = await plugs.scaler.fleet()
            mode = None if plugs.modes is None else await plugs.modes.in_force()
            at = self.clock()
            decision = decide(signals, before, goal, self.memory, fleet=fleet, now=at, mode=mode)
            if decision.config != before:
                report = await plugs.actuator.apply(decision.config)
            else:
                report = await plugs.actuator.resync(before)
            # From here the decision is in force: a failed record must not repeat it.
            self.memory = decision.memory
            scale = decision.scale
            if scale is not None and fleet is not None and scale.replicas != fleet.desired:
                assert plugs.scaler is not None
                await plugs.scaler.scale(scale)
            if decision.mode is not None and decision.mode.switched:
                assert plugs.modes is not None
                await plugs.modes.switch(decision.mode)
            step = TuneStep(self.rounds, at, signals, before, decision, report, fleet=fleet)
            self.rounds += 1
            recorded = plugs.recorder(step)
            if recorded is not None:
                await recorded
        return step
