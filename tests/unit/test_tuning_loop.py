"""The tuning loop's round with in-memory plug points: what it reads, applies, scales,
switches and records, under which guard, and what a failure leaves."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field, replace

import pytest
from batchpilot_operator.policy.mode import ModeChoice
from batchpilot_operator.policy.types import (
    Bounds,
    Cadence,
    Fleet,
    Goal,
    ReplicaBounds,
    ScaleDecision,
)
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_operator.tuning_loop import (
    ActuationReport,
    Applied,
    PlugPoints,
    TuneStep,
    TuningLoop,
)
from batchpilot_server.batching_config import BatchingConfig, Mode

GOAL = Goal(Slo(e2e_s=1.0))
CADENCE = Cadence(interval_s=10.0, window_s=30.0)
# p99 past the SLO while requests queue behind full batches: the rule grows the batch
QUEUEING = Signals(
    status="ok", requests=500, p99_latency_s=2.0, queue_wait_p99_s=1.5, mean_batch_size=4.0,
    kv_usage=0.1,
)  # fmt: skip
QUIET = Signals(status="no_traffic")


@dataclass
class World:
    """A source, an actuator and a recorder that note each call and whether the guard was
    held at that moment."""

    guard: asyncio.Lock
    signals: list[Signals]
    record: BatchingConfig | None = field(default_factory=lambda: BatchingConfig(4))
    fail_apply: bool = False
    calls: list[tuple[str, bool]] = field(default_factory=list)
    windows: list[float] = field(default_factory=list)
    steps: list[TuneStep] = field(default_factory=list)

    def note(self, call: str) -> None:
        self.calls.append((call, self.guard.locked()))

    async def read(self, window_s: float) -> Signals:
        self.note("read")
        self.windows.append(window_s)
        return self.signals.pop(0)

    async def in_force(self) -> BatchingConfig | None:
        self.note("in_force")
        return self.record

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        self.note("apply")
        if self.fail_apply:
            raise ConnectionError("the record could not be written")
        self.record = config
        return ActuationReport(applied=[Applied("server", 2)])

    async def resync(self, config: BatchingConfig) -> ActuationReport:
        self.note("resync")
        return ActuationReport()

    def recorder(self, step: TuneStep) -> None:
        self.note("record")
        self.steps.append(step)

    @property
    def plugs(self) -> PlugPoints:
        return PlugPoints(source=self, actuator=self, recorder=self.recorder)


def world(*signals: Signals) -> World:
    return World(guard=asyncio.Lock(), signals=list(signals))


async def test_a_change_is_applied_once_recorded_and_in_force_for_the_next_round() -> None:
    w = world(QUEUEING, QUIET)
    loop = TuningLoop(clock=lambda: 42.0)
    step = await loop.round(GOAL, CADENCE, w.plugs, guard=w.guard)
    assert step is not None and step.changed and step.decision.action == "grow_batch"
    assert step.before == BatchingConfig(max_batch_size=4)
    assert w.record == step.decision.config and step.report.applied
    assert (step.index, step.at) == (0, 42.0)
    # Read outside the guard; from the config in force to the record, inside it.
    assert w.calls == [("read", False), ("in_force", True), ("apply", True), ("record", True)]
    assert loop.memory == step.decision.memory

    held = await loop.round(GOAL, CADENCE, w.plugs, guard=w.guard)
    assert held is not None and not held.changed and held.index == 1
    assert held.before == step.decision.config  # decided from what the record holds
    assert [c for c, _ in w.calls[4:]] == ["read", "in_force", "resync", "record"]
    # Right after a change the window is one interval, then it grows back.
    assert w.windows == [CADENCE.window_s, CADENCE.interval_s]


async def test_no_config_in_force_yet_means_no_decision_and_no_record() -> None:
    w = world(QUEUEING)
    w.record = None
    assert await TuningLoop().round(GOAL, CADENCE, w.plugs) is None
    assert [c for c, _ in w.calls] == ["read", "in_force"]


async def test_a_failed_apply_leaves_the_state_and_the_next_round_decides_again() -> None:
    w = world(QUEUEING, QUEUEING)
    w.fail_apply = True
    loop = TuningLoop()
    with pytest.raises(ConnectionError):
        await loop.round(GOAL, CADENCE, w.plugs, guard=w.guard)
    assert not w.steps and not w.guard.locked()
    assert loop.memory.since_change > 0 and loop.rounds == 0  # nothing was put in force
    w.fail_apply = False
    step = await loop.round(GOAL, CADENCE, w.plugs, guard=w.guard)
    assert step is not None and step.changed and step.index == 0
    assert [c for c, _ in w.calls].count("apply") == 2  # the first never reached the record


async def test_an_async_recorder_is_awaited() -> None:
    w = world(QUIET)
    recorded: list[int] = []

    async def recorder(step: TuneStep) -> None:
        await asyncio.sleep(0)
        recorded.append(step.index)

    plugs = PlugPoints(source=w, actuator=w, recorder=recorder)
    await TuningLoop().round(GOAL, CADENCE, plugs)
    assert recorded == [0]


@dataclass
class FleetOf:
    """A scaler over an in-memory fleet; `owned=False` plays an HPA owning the count."""

    desired: int
    owned: bool = True
    starting: int = 0  # pods asked for that are not ready yet
    scaled: list[ScaleDecision] = field(default_factory=list)

    async def fleet(self) -> Fleet | None:
        return Fleet(self.desired, self.desired - self.starting) if self.owned else None

    async def scale(self, decision: ScaleDecision) -> None:
        self.scaled.append(decision)
        self.desired = decision.replicas


# p99 over the SLO from queueing on one pod whose batch is at its bound: only pods help
SPENT = replace(
    Signals(status="ok", window_s=30.0, requests=600, request_rate=20.0, p99_latency_s=2.0,
            queue_wait_p99_s=1.5, mean_batch_size=8.0, kv_usage=0.1, arrival_rate=50.0),
    pods=1,
)  # fmt: skip
AUTOSCALED = replace(GOAL, bounds=Bounds(max_batch=8), replicas=ReplicaBounds(1, 4))


async def test_the_replica_rule_runs_after_the_knobs_and_restarts_the_window() -> None:
    w = world(SPENT, QUIET)
    w.record = BatchingConfig(8, batch_timeout_ms=0.0)  # both knobs where queueing puts them
    scaler = FleetOf(desired=1)
    plugs = replace(w.plugs, scaler=scaler)
    loop = TuningLoop(clock=lambda: 100.0)
    step = await loop.round(AUTOSCALED, CADENCE, plugs)
    assert step is not None and not step.changed
    assert step.scale is not None and step.scale.action == "scale_out"
    assert "the batch is spent" in step.scale.reason
    assert step.fleet == Fleet(1, 1)
    # 50 req/s over the 20 a saturated pod finished, at 80 % busy: ceil(3.1) = 4
    assert [d.replicas for d in scaler.scaled] == [4] and scaler.desired == 4
    assert loop.memory.replicas == step.scale.state
    await loop.round(AUTOSCALED, CADENCE, plugs)
    assert w.windows == [CADENCE.window_s, CADENCE.interval_s]  # the new fleet alone


@pytest.mark.parametrize("owned", [False, True])
async def test_no_replica_decision_without_bounds_or_ownership(owned: bool) -> None:
    w = world(SPENT)
    w.record = BatchingConfig(8)
    scaler = FleetOf(desired=1, owned=owned)
    goal = AUTOSCALED if not owned else replace(AUTOSCALED, replicas=None)
    step = await TuningLoop().round(goal, CADENCE, replace(w.plugs, scaler=scaler))
    assert step is not None and step.scale is None and step.fleet is None
    assert not scaler.scaled


async def test_a_settling_fleet_restarts_the_window_each_round() -> None:
    w = world(SPENT, SPENT, SPENT)
    w.record = BatchingConfig(8)
    scaler = FleetOf(desired=2, starting=1)
    plugs = replace(w.plugs, scaler=scaler)
    loop = TuningLoop()
    for _ in range(2):
        step = await loop.round(AUTOSCALED, CADENCE, plugs)
        assert step is not None and step.scale is not None and step.scale.settling
    scaler.starting = 0
    await loop.round(AUTOSCALED, CADENCE, plugs)
    # a full window first; then, while a pod starts, each window covers one interval
    assert w.windows == [CADENCE.window_s, CADENCE.interval_s, CADENCE.interval_s]
    assert not scaler.scaled


@dataclass
class Modes:
    """A mode switch over an in-memory mode."""

    mode: Mode = "continuous"
    switched: list[ModeChoice] = field(default_factory=list)

    async def in_force(self) -> Mode:
        return self.mode

    async def switch(self, choice: ModeChoice) -> None:
        self.switched.append(choice)
        self.mode = choice.mode


# equal output lengths at low load, with room under the SLO: the map's dynamic region
EQUAL_LOW = Signals(
    status="ok", window_s=30.0, requests=60, request_rate=2.0, p99_latency_s=0.2,
    mean_latency_s=0.1, output_tokens_p50=32.0, output_tokens_p90=33.0, kv_usage=0.1,
)  # fmt: skip


async def test_mode_auto_switches_inside_the_round_and_restarts_the_window() -> None:
    w = world(*[EQUAL_LOW] * 4)
    modes = Modes()
    plugs = replace(w.plugs, modes=modes)
    loop = TuningLoop()
    steps = [await loop.round(GOAL, CADENCE, plugs) for _ in range(4)]
    choices = [s.decision.mode for s in steps if s is not None]
    assert all(c is not None for c in choices)
    # three agreeing rounds of evidence, then one switch, in force through the plug point
    assert [c.switched for c in choices if c is not None] == [False, False, True, False]
    assert [c.mode for c in modes.switched] == ["dynamic"] and modes.mode == "dynamic"
    assert w.windows[3] == CADENCE.interval_s  # the round after the switch: one interval


async def test_without_a_mode_switch_there_is_no_mode_choice() -> None:
    w = world(EQUAL_LOW)
    step = await TuningLoop().round(GOAL, CADENCE, w.plugs)
    assert step is not None and step.decision.mode is None
