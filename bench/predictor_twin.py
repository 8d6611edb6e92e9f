"""The predictor against the digital twin: which one foresees the next window (issue 40).

Over the LLM scenarios of bench/tuner_llm.py (the simulator's real schedulers under the
step-time curve), each played with the tuner in the loop and with the default config
fixed on one pod (the peaks overload it: the windows near saturation and with a backlog
that the tuner avoids), after every round both predict the next interval for the config
and pods in force, from the same window and the same step model: the rule's fit
(`fit_for` over the rule's points, as `predict_config` does), and again the reference
plane through the simulator's own step costs (`reference_plane`), which leaves the
predictor's error without the fit's:

- the queueing approximation (`policy/predictor.py` `predict`);
- the twin (`policy/twin.py` `simulate`), played for one interval: what is measured;
- the two combined: the twin where the window has a backlog or the approximation puts
  the pods near saturation (utilisation >= `NEAR_SATURATION`), the approximation
  elsewhere (both known before the interval, so a chooser can use the rule).

Per interval, against what it measured: |predicted - measured| / measured for the p99
TTFT and TPOT, absolute for the attainment (bench/tuner_llm.py `prediction_errors`:
median and worst over the intervals), over all windows and split by backlog (requests
waiting at the round) and by saturation. The twin's CPU time: per candidate (the config
in force, every interval) and per full round (the chooser's grid, `knob_candidates` x
`pod_counts`, at one round per scenario: the middle one). The table goes to
docs/benchmarks.md (`predictor-twin` section); the last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import tuner_llm as llm
from batchpilot_operator.policy.choice import knob_candidates, pod_counts
from batchpilot_operator.policy.predictor import Candidate, Prediction, predict
from batchpilot_operator.policy.step_model import StepModel, StepPoint, fit, fit_for
from batchpilot_operator.policy.twin import simulate as play_twin
from batchpilot_operator.policy.types import Cadence, Fleet, Goal, ReplicaState
from batchpilot_operator.policy.window import Window
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import Scenario, StepCurve, simulate, static
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
CADENCE = Cadence()  # the CRD's defaults, as bench/tuner.py
SEED = 1  # bench/tuner.py's
DURATION_S = 600.0  # bench/tuner.py's LLM scenarios: 20 intervals
QUICK = (("chat", "steady"), ("rag", "step"), ("code", "bursts"))
NEAR_SATURATION = 0.8  # the approximation's utilisation from which a window counts as near
PREDICTORS = ("queue", "twin", "combined")
SPLITS: dict[str, Callable[[Paired], bool]] = {
    "all": lambda p: True,
    "backlog": lambda p: p.backlog,
    "no backlog": lambda p: not p.backlog,
    "near saturation": lambda p: p.near,
    "not near": lambda p: not p.near,
}


@dataclass(frozen=True)
class Round:
    """What both predicted after one round, for the interval that followed."""

    queue: Prediction
    twin: Prediction
    backlog: bool
    near: bool
    twin_cpu_s: float


@dataclass(frozen=True)
class Paired:
    """One interval: a prediction and what the interval measured (tuner_llm's
    `PredictedWindow`)."""

    prediction: Prediction | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    attainment: float | None
    backlog: bool
    near: bool


class Recorder:
    """The simulator's predictor seam: both predictions after each round; returns the
    approximation's, which the interval keeps (`Interval.prediction`)."""

    def __init__(self, goal: Goal, grid_at_call: float, model: StepModel | None = None) -> None:
        self.goal = goal
        self.grid_at_call = grid_at_call
        self.given = model  # None: the fit through the rule's points, as the rule has it
        self.model: StepModel | None = None  # the last fit used
        self.rounds: list[Round | None] = []  # per call: the interval after the round
        self.grid: tuple[int, float] | None = None  # (candidates, CPU seconds) of one round

    def __call__(
        self,
        signals: Signals,
        config: BatchingConfig,
        replicas: int,
        slo: Slo,
        points: tuple[StepPoint, ...],
    ) -> Prediction | None:
        model = self.given or fit_for(points, signals.pods)
        self.model = model if model is not None and model.trusted else self.model
        window = Window.of(signals, slo, None, None, ReplicaState())
        candidate = Candidate.in_force(config, replicas)
        queue = None if model is None else predict(window, model, candidate)
        if model is None or queue is None:
            self.rounds.append(None)
            return None
        started = time.process_time()
        twin = play_twin(window, model, candidate, duration_s=CADENCE.interval_s)
        cpu = time.process_time() - started
        assert twin is not None  # the same lengths as the approximation's
        near = queue.utilisation >= NEAR_SATURATION
        self.rounds.append(Round(queue, twin, window.backlog > 0, near, cpu))
        if len(self.rounds) >= self.grid_at_call and self.grid is None:
            self.grid = self._full_round(signals, config, replicas, slo, model)
        return queue

    def _full_round(
        self, signals: Signals, config: BatchingConfig, replicas: int, slo: Slo, model: StepModel
    ) -> tuple[int, float]:
        """The twin over the chooser's whole grid at this round: (candidates, CPU s)."""
        replica_bounds = self.goal.replicas
        window = Window.of(signals, slo, Fleet(replicas, replicas), replica_bounds, ReplicaState())
        grid = [
            Candidate(batch, timeout, budget, pods, k)
            for pods in pod_counts(window)
            for batch, timeout, budget, k in knob_candidates(self.goal.bounds, config, model)
        ]
        started = time.process_time()
        for candidate in grid:
            play_twin(window, model, candidate, duration_s=CADENCE.interval_s)
        return len(grid), time.process_time() - started


def combined(r: Round) -> Prediction:
    """The twin where the window has a backlog or is near saturation, else the
    approximation."""
    return r.twin if r.backlog or r.near else r.queue


def play(
    setup: llm.LlmSetup,
    scenario: Scenario,
    curve: StepCurve,
    model: StepModel | None = None,
    tuned: bool = True,
) -> dict[str, Any]:
    """One scenario, its intervals paired with each prediction: the tuner in the loop, or
    the default config fixed on one pod; predicted with `model` (None: the rule's fit).
    The predictions do not steer the tuner: a replay with another model is the same run."""
    intervals_n = round(scenario.duration_s / CADENCE.interval_s)
    timed = tuned and model is None  # one full round timed per scenario, on the rule's fit
    recorder = Recorder(llm.goal(setup), intervals_n // 2 if timed else math.inf, model)
    options = replace(llm.tuner_options(setup, CADENCE), predictor=recorder)
    if not tuned:
        options = static(options, BatchingConfig())
    result = simulate(scenario, options, curve, seed=SEED)
    pairs: dict[str, list[Paired]] = {name: [] for name in PREDICTORS}
    # the round closing interval i predicts interval i + 1
    for r, iv in zip(recorder.rounds, result.intervals[1:], strict=False):
        assert iv.prediction is (None if r is None else r.queue)
        if r is None:
            continue
        for name, prediction in (("queue", r.queue), ("twin", r.twin), ("combined", combined(r))):
            pairs[name].append(
                Paired(prediction, iv.ttft_p99_s, iv.tpot_p99_s, iv.attainment, r.backlog, r.near)
            )
    cpus = [r.twin_cpu_s for r in recorder.rounds if r is not None]
    return {"pairs": pairs, "cpu": cpus, "grid": recorder.grid, "model": recorder.model}


def errors(pairs: Iterable[Paired]) -> dict[str, dict[str, float] | None]:
    return llm.prediction_errors(list(pairs))


def summary(runs: dict[str, dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per group of runs (tuned, fixed): errors per split and predictor over every
    scenario's intervals, and per scenario; the twin's CPU over all of them."""
    result: dict[str, Any] = {}
    for group, by_scenario in runs.items():
        table: dict[str, dict[str, Any]] = {}
        for split, keep in SPLITS.items():
            table[split] = {}
            for name in PREDICTORS:
                chosen = [p for run in by_scenario.values() for p in run["pairs"][name] if keep(p)]
                table[split][name] = {"windows": len(chosen), **errors(chosen)}
        result[group] = {
            "errors": table,
            "per_scenario": {
                key: {name: errors(run["pairs"][name]) for name in PREDICTORS}
                for key, run in by_scenario.items()
            },
        }
    every = [run for by_scenario in runs.values() for run in by_scenario.values()]
    grids = [run["grid"] for run in every if run["grid"] is not None]
    return {
        **result,
        "twin_cpu_per_candidate_s": _spread([c for run in every for c in run["cpu"]]),
        "twin_cpu_per_round_s": _spread([seconds for _, seconds in grids]),
        "round_candidates": _spread([float(n) for n, _ in grids]),
    }


def _spread(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(float(np.median(values)), 3), "max": round(max(values), 3)}


def _cell(e: dict[str, float] | None) -> str:
    return "-" if e is None else f"{e['median']}/{e['worst']}"


GROUPS = {
    "tuned": "the tuner in the loop (bench/tuner_llm.py's runs), predicted on the rule's fit",
    "fixed": "the default config (batch 8, budget 2048) fixed on one pod, which the peaks "
    "overload: the windows near and past saturation, with a backlog, the tuner avoids; "
    "predicted on the last trusted fit of the scenario's tuned run",
    "tuned, ref": "the tuned runs again, predicted on the reference plane (`reference_plane`: "
    "the plane through the simulator's own step costs), so that what is left is the "
    "predictor's error, not the fit's",
    "fixed, ref": "the fixed runs on the reference plane",
}


def reference_plane(curve: StepCurve) -> StepModel:
    """The fit through the simulator's own step costs (`StepCurve.forward_s`: a step of P
    prompt tokens, R decode rows and K KV tokens takes curve(P + R) + K x the KV cost)
    over the LLM scenarios' range: the plane a perfect history would give."""
    points = [
        StepPoint(rows, prefill, kv, curve.forward_s(rows, prefill, kv))
        for rows in (0, 1, 4, 16, 32, 64)
        for prefill in (0, 64, 256, 1024, 2048)
        for kv in (rows * 300 + prefill, rows * 3000 + prefill)
        if rows or prefill
    ]
    model = fit(points)
    assert model is not None
    return model


def markdown(result: dict[str, Any], scenarios: list[str], duration_s: float) -> str:
    lines = [
        "### Predictor error: queueing approximation against the digital twin "
        "(bench/predictor_twin.py)",
        "",
        f"The LLM scenarios of bench/tuner_llm.py ({', '.join(scenarios)}; "
        f"{duration_s / 60:g} minutes each, seed {SEED}), in four groups: "
        + "; ".join(f"*{g}*: {text}" for g, text in GROUPS.items())
        + ". After each round both predict the next interval for the config and pods in "
        "force, from the same window and step fit: the queueing approximation "
        "(`policy/predictor.py`), the twin (`policy/twin.py`: the real continuous scheduler "
        f"per pod under the fitted plane, one {CADENCE.interval_s:g} s interval from the "
        "window's backlog and running sequences), and the two combined (the twin where the "
        "window has a backlog or the approximation's utilisation is at least "
        f"{NEAR_SATURATION:g}, else the approximation). Error: |predicted - measured| / "
        "measured for the p99s, absolute for attainment, median/worst over the intervals "
        "(bench/tuner_llm.py `prediction_errors`). Target (issue 40): median within 0.25 "
        "for the p99s, within 0.03 for attainment.",
        "",
        "| run | windows | predictor | n | p99 TTFT | p99 TPOT | attainment |",
        "|---|---|---|---|---|---|---|",
    ]
    for group in GROUPS:
        for split, row in result[group]["errors"].items():
            for name in PREDICTORS:
                e = row[name]
                lines.append(
                    f"| {group} | {split} | {name} | {e['windows']} | {_cell(e['ttft_p99'])} "
                    f"| {_cell(e['tpot_p99'])} | {_cell(e['attainment'])} |"
                )
    lines += [
        "",
        "Per scenario, median/worst (queue; twin):",
        "",
        "| run | scenario | p99 TTFT | p99 TPOT | attainment |",
        "|---|---|---|---|---|",
    ]
    for group in GROUPS:
        for key, by in result[group]["per_scenario"].items():
            cells = [
                f"{_cell(by['queue'][q])}; {_cell(by['twin'][q])}"
                for q in ("ttft_p99", "tpot_p99", "attainment")
            ]
            lines.append(f"| {group} | {key} | {' | '.join(cells)} |")
    per, rounds = result["twin_cpu_per_candidate_s"], result["twin_cpu_per_round_s"]
    n = result["round_candidates"]
    lines += [
        "",
        f"Twin CPU time (one core, this machine): per candidate median {per['median']} s, "
        f"max {per['max']} s; per full round (the chooser's grid at the middle round of "
        f"each tuned run, median {n['median']:g} candidates) median {rounds['median']} s, "
        f"max {rounds['max']} s.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/predictor_twin.py", description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} scenarios")
    args = ap.parse_args(argv)
    curve = llm.llm_curve(StepCurve.load())
    reference = reference_plane(curve)
    runs: dict[str, dict[str, dict[str, Any]]] = {group: {} for group in GROUPS}
    for workload in llm.WORKLOADS:
        setup = llm.LlmSetup.of(workload, curve)
        for scenario in llm.scenarios(setup, DURATION_S):
            if args.quick and (workload, scenario.name) not in QUICK:
                continue
            started = time.monotonic()
            key = f"{workload}/{scenario.name}"
            runs["tuned"][key] = tuned = play(setup, scenario, curve)
            if tuned["model"] is not None:  # a tuned run that never trusted a fit: none
                runs["fixed"][key] = play(setup, scenario, curve, tuned["model"], tuned=False)
            runs["tuned, ref"][key] = play(setup, scenario, curve, reference)
            runs["fixed, ref"][key] = play(setup, scenario, curve, reference, tuned=False)
            print(f"{key}: {time.monotonic() - started:.0f} s", file=sys.stderr)
    result = summary(runs)
    text = markdown(result, list(runs["tuned"]), DURATION_S)
    replace_section(BENCHMARKS_MD, "predictor-twin", text)
    print(json.dumps({"bench": "predictor_twin", "quick": args.quick, **result}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
