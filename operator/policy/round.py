"""One round of the rule: the knobs, the replica count and the mode, from one window.

Pure and deterministic: the same (signals, config in force, goal, memory, fleet, now,
mode) always gives the same decision; `tuning_loop.TuningLoop` is its one caller.

1. The memory takes the window in: its step point (step_model.py), its arrivals and a
   scale-out's start-up (replicas.py).
2. The window's derived quantities are computed once (window.py).
3. One sizing step gives both the knobs and the pods needed, from the config in force
   clamped into the bounds (a constraint of every answer; the reason says where it moved):
   - a window without evidence holds (`Window.has_evidence`: too little traffic, and
     no more misses judged than chance allows);
   - where the step fit for this fleet size is trusted, its recent error on the config
     in force is small (the median of its last errors, those of its own form:
     memory.py `FitErrors`; a refit through other terms or points is judged on its own
     errors from the first window that judges it; the error is the prediction at the
     arrivals the window saw, not at the forecast) and the window has lengths to
     predict by, the choice (choice.py) picks the cheapest candidate the predictor
     (predictor.py) says meets the SLO with the margin;
   - otherwise the fallback table (fallback.py) steps, and the reason says why the fit
     was not used.
4. The pods needed go through the stabilization rules (replicas.py) where the round
   owns the replica count; the mode choice (mode.py) runs where the policy's mode is
   auto.
5. The memory is written once: `since_change` restarts at any move of the knobs, the
   fleet (or a fleet still settling) or the mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from batchpilot_operator.policy import fallback
from batchpilot_operator.policy.choice import choose
from batchpilot_operator.policy.memory import SINCE_CHANGE_CAP, FitErrors, PolicyMemory
from batchpilot_operator.policy.mode import ModeChoice, ModeState, choose_mode
from batchpilot_operator.policy.predictor import Candidate, Prediction, lengths_of, predict
from batchpilot_operator.policy.reasons import knob_change
from batchpilot_operator.policy.replicas import observe, stabilize
from batchpilot_operator.policy.sizing import Sizing
from batchpilot_operator.policy.speculation import measured_acceptance
from batchpilot_operator.policy.step_model import StepModel, fit_for, point_of, remember
from batchpilot_operator.policy.types import Action, Cadence, Fleet, Goal, ScaleDecision
from batchpilot_operator.policy.window import Forecast, Window
from batchpilot_operator.signals import Signals
from batchpilot_server.batching_config import BatchingConfig, Mode


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


def decide(
    signals: Signals,
    current: BatchingConfig,
    goal: Goal,
    memory: PolicyMemory,
    *,
    fleet: Fleet | None = None,
    now: float = 0.0,
    mode: Mode | None = None,
) -> Decision:
    """This round's decision; see the module docstring. `fleet` None: the round does not
    own the replica count; `mode` None: the policy's mode is not auto."""
    memory = _taken_in(signals, current, memory, fleet, now)
    window = replace(
        Window.of(signals, goal.slo, fleet, goal.replicas, memory.replicas),
        acceptance=memory.acceptance,
    )
    # The bounds are a constraint of every answer: a config outside them (the policy's
    # bounds changed) is sized from its clamp, and the reason says so.
    clamped = goal.bounds.clamp(current)
    sizing, errors = _size(window, clamped, goal, memory)
    if clamped != current:
        outside = f"config outside the bounds: {knob_change(current, clamped)}"
        sizing = replace(sizing, action="clamp", reason=f"{outside}; {sizing.reason}")
    scale = None
    if fleet is not None and goal.replicas is not None:
        scale = stabilize(sizing.need, signals, fleet, goal.replicas, memory.replicas, now)
    choice: ModeChoice | None = None
    if mode is not None:
        choice = choose_mode(signals, mode, sizing.config.max_batch_size, goal.slo, memory.mode)
    moved = (
        sizing.config != current
        or (scale is not None and fleet is not None
            and (scale.replicas != fleet.desired or scale.settling))
        or (choice is not None and choice.switched)
    )  # fmt: skip
    memory = replace(
        memory,
        since_change=0 if moved else min(memory.since_change + 1, SINCE_CHANGE_CAP),
        errors=errors,
        replicas=scale.state if scale is not None else memory.replicas,
        mode=choice.state if choice is not None else ModeState(),
    )
    return Decision(
        sizing.config, sizing.action, sizing.reason,  # type: ignore[arg-type]
        memory, scale, choice, sizing.prediction,
    )  # fmt: skip


def _taken_in(
    signals: Signals,
    current: BatchingConfig,
    memory: PolicyMemory,
    fleet: Fleet | None,
    now: float,
) -> PolicyMemory:
    # A thin window's mean step is an operating point all the same (no quantile in it).
    points = remember(memory.points, point_of(signals))
    measured = measured_acceptance(signals, current.num_speculative_tokens)
    return replace(
        memory,
        points=points,
        replicas=observe(memory.replicas, signals, fleet, now),
        acceptance=memory.acceptance if measured is None else measured,
    )


def _size(
    window: Window, current: BatchingConfig, goal: Goal, memory: PolicyMemory
) -> tuple[Sizing, FitErrors]:
    """The sizing step (see the module docstring), and the fit's recent errors."""
    signals, errors = window.signals, memory.errors
    if not window.has_evidence:
        status = signals.status.replace("_", " ")
        return Sizing(current, "hold", f"{status}: {signals.detail or status}", None), errors
    model = fit_for(memory.points, window.pods)
    if model is not None and model.trusted:
        errors = errors.of(model.form, _error(window, model, current))
    why = _untrusted(model, errors, goal, signals)
    if model is not None and why is None:
        chosen = choose(window, model, current, goal)
        median = errors.median()
        err = f", error {median:.0%}" if median is not None else ""
        return replace(chosen, reason=f"predicted ({model.describe()}{err}): {chosen.reason}"), (
            errors
        )
    # the fit prices the draft tokens for the fallback's k even where it is not trusted to
    # predict the p99s: a step's cost a token is what it measured, however few its points
    stepped = fallback.step(window, current, goal, model)
    return replace(stepped, reason=f"fallback ({why}): {stepped.reason}"), errors


def _error(window: Window, model: StepModel, current: BatchingConfig) -> float | None:
    """The fit's relative error on the config in force: the worst over the stated targets
    of |predicted - observed| / max(observed, target) p99; None without a p99."""
    if window.backlog > window.pods:
        # The window's p99 holds the wait behind a queue built before it, which a steady
        # state prediction does not describe: judge the fit on windows without one.
        return None
    candidate = Candidate.in_force(current, window.pods)
    # Judged at the arrivals the window saw: its p99s are of that load, not the forecast's.
    seen_load = replace(window, forecast=Forecast(window.arrival_rps))
    prediction = predict(seen_load, model, candidate)
    observed = window.observed()
    if prediction is None or not observed:
        return None

    def off(name: str, seen: float) -> float:
        predicted = prediction.p99(name)
        if math.isinf(predicted):  # a queue that never drains: right where it grows
            return 0.0 if window.queue_grows else math.inf
        # Relative to the target where the p99 is under it: a 2 ms p99 read as 4 ms is
        # no error that matters against a 20 ms target, and would distrust the fit.
        scale = max(seen, window.slo.stated[name])
        return abs(predicted - seen) / scale if scale > 0 else 0.0

    return max(off(name, seen) for name, seen in observed.items())


def _untrusted(
    model: StepModel | None, errors: FitErrors, goal: Goal, signals: Signals
) -> str | None:
    """Why the fit is not used this round; None when it is."""
    if lengths_of(signals) is None:
        return "no prompt or output lengths to predict by"
    if model is None:
        return "no step fit yet: the window has no step counters or too few points"
    if not model.trusted:
        return f"step fit not trusted yet: {model.describe()}"
    median = errors.median()
    if median is not None and median > goal.params.max_error:
        return f"the step fit's recent error {median:.0%} is over {goal.params.max_error:.0%}"
    return None
