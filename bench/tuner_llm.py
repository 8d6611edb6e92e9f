"""The tuner benchmark's LLM part: TTFT+TPOT targets, the prefill budget as a knob.

Three workloads, each with its own prompt and answer lengths and its own TTFT and TPOT
targets (derived from the step-time curve, so any curve gives a fair test):
- chat: prompts 200-2,000 tokens, answers 20-500;
- rag (retrieval-augmented): long prompts (1,500-4,000), short answers (10-80);
- code (completion): short prompts (20-300), long answers (150-700);
each under steady, 3x step, diurnal and bursty load, one pod's worth and more
(continuous mode; attention costs `KV_TOKEN_S` per KV token attended, so long
contexts slow every step they share). Each scenario is played by
- the tuner (the tuning loop: knobs and replicas, `autoscale` 1..MAX_REPLICAS);
- the oracle: the best fixed (batch, timeout, budget, replicas) in hindsight, from a
  coarse grid: the fewest replica-seconds whose run attainment meets the target, then
  the most goodput (none meets it: the most goodput). The grid is pruned with a cheap
  bound: replica counts below what the load needs at the largest batch's throughput,
  and above two more than that, are not played.
- the cold start: the oracle's own config reached from one pod at the first round (the
  step's round for the 3x step), as early as a rule that starts from one pod (or sees
  the step at a round) can reach it (`cold_start`): what the oracle's config costs
  such a rule, shown beside the tuner's figures.
Reported per scenario: tuner goodput (requests meeting every target per second) over
the oracle's (target >= 0.95) and the cold start's over the oracle's, the share of
steady-load intervals whose attainment met the target (>= 0.95), intervals after the
3x step until the attainment is met again (<= 2; and the cold start's),
replica-seconds over the oracle's, and, where a predictor is hooked (`predictor()`), its
error per interval: predicted vs measured p99 TTFT, p99 TPOT and attainment (median and
worst).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np
from batchpilot_operator.policy.predictor import Prediction, predict_config
from batchpilot_operator.policy.types import (
    Bounds,
    Cadence,
    Fleet,
    Goal,
    ReplicaBounds,
    ReplicaState,
    ScaleDecision,
)
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import (
    Interval,
    Predictor,
    Scenario,
    SimOptions,
    SimResult,
    StepCurve,
    static,
)

# Attention's cost per KV token a step's rows attend to: 64 rows at 1,000 tokens of
# context add about what the decode step of 64 rows costs on the tiny model's curve.
KV_TOKEN_S = 1.5e-7
ATTAINMENT = 0.95  # per window: the bench's SLO, and the oracle's bar over the run
MAX_REPLICAS = 4
LOADS = ("steady", "step", "diurnal", "bursts")
LOAD_SHARE = 1.5  # the peak, over what one pod serves at the default config
BUDGETS = (256, 2048)  # the tuner's prefill budget bounds and the oracle's grid
GRID_BATCHES = (8, 32, 64)
GRID_TIMEOUT_MS = 10.0  # continuous: only delays an idle engine's first step
SHARE_TARGET = 0.95
RECOVER_TARGET = 2
GOODPUT_TARGET = 0.95
WARMUP_INTERVALS = 3  # steady windows before these are not judged (the tuner starts cold)


@dataclass(frozen=True)
class Lengths:
    prompt: tuple[int, int]
    output: tuple[int, int]

    @property
    def mean_prompt(self) -> float:
        return sum(self.prompt) / 2

    @property
    def mean_output(self) -> float:
        return sum(self.output) / 2


WORKLOADS = {
    "chat": Lengths(prompt=(200, 2000), output=(20, 500)),
    "rag": Lengths(prompt=(1500, 4000), output=(10, 80)),
    "code": Lengths(prompt=(20, 300), output=(150, 700)),
}


@dataclass(frozen=True)
class LlmSetup:
    """A workload's targets and one pod's capacity at the default config."""

    workload: str
    lengths: Lengths
    slo: Slo
    pod_rps: float

    @classmethod
    def of(cls, workload: str, curve: StepCurve, lengths: Lengths | None = None) -> LlmSetup:
        """`lengths` None: the workload's own (WORKLOADS); else a workload defined
        elsewhere (bench/planners.py's production-trace one)."""
        lengths = WORKLOADS[workload] if lengths is None else lengths
        n = BatchingConfig().max_batch_size
        context = lengths.mean_prompt + lengths.mean_output / 2
        decode_s = curve.step_s(n) + curve.kv_token_s * n * context
        prefill_s = curve.step_s(round(lengths.mean_prompt))  # one prompt, its own step
        pod_rps = n / (n * prefill_s + lengths.mean_output * decode_s)
        # TTFT: three prefills of the longest prompt (room to queue behind two);
        # TPOT: twice a decode step of 16 rows at the mean context plus one chunk of prompt
        ttft_s = round(3.0 * curve.step_s(lengths.prompt[1]), 3)
        tpot_s = round(2.0 * (curve.step_s(16) + curve.kv_token_s * 16 * context), 4)
        slo = Slo(ttft_s=ttft_s, tpot_s=tpot_s, attainment=ATTAINMENT)
        return cls(workload, lengths, slo, pod_rps)


def llm_curve(curve: StepCurve) -> StepCurve:
    return curve.with_kv_cost(KV_TOKEN_S)


def scenarios(setup: LlmSetup, duration_s: float) -> list[Scenario]:
    peak = LOAD_SHARE * setup.pod_rps
    lengths = setup.lengths
    mean_out = round(lengths.mean_output)

    def scenario(name: str, base: float, step_at_s: float | None = None) -> Scenario:
        return Scenario(
            name, duration_s, round(base, 3), mean_out, lengths.prompt, step_at_s,  # type: ignore[arg-type]
            output_range=lengths.output,
        )  # fmt: skip

    return [
        scenario("steady", peak),
        scenario("step", peak / 3, duration_s / 3),
        scenario("diurnal", peak / 1.6),
        scenario("bursts", peak / 2.5),
    ]


def goal(setup: LlmSetup) -> Goal:
    bounds = Bounds(min_prefill_budget=min(BUDGETS), max_prefill_budget=max(BUDGETS))
    return Goal(setup.slo, bounds, replicas=ReplicaBounds(1, MAX_REPLICAS))


def predictor() -> Predictor:
    """The policy package's own prediction: what the rule expects of the config in force
    (None until its step fit exists: those intervals' error columns read '-')."""
    return predict_config


def tuner_options(setup: LlmSetup, cadence: Cadence) -> SimOptions:
    return SimOptions(
        mode="continuous", config=BatchingConfig(), goal=goal(setup), cadence=cadence,
        predictor=predictor(),
    )  # fmt: skip


def replica_range(setup: LlmSetup, scenario: Scenario, curve: StepCurve) -> range:
    """The cheap bound: from the pods the peak needs at the largest batch's throughput (an
    upper bound on a pod's) to two more (queueing and long contexts cost more)."""
    lengths = setup.lengths
    n = max(GRID_BATCHES)
    context = lengths.mean_prompt + lengths.mean_output / 2
    decode_s = curve.step_s(n) + curve.kv_token_s * n * context
    prefill_s = lengths.mean_prompt * curve.per_token_s
    best_rps = n / (n * prefill_s + lengths.mean_output * decode_s)
    low = min(MAX_REPLICAS, max(1, math.ceil(scenario.rate_max / best_rps)))
    return range(low, min(MAX_REPLICAS, low + 2) + 1)


def grid(
    setup: LlmSetup, scenario: Scenario, curve: StepCurve, cadence: Cadence
) -> list[SimOptions]:
    base = replace(tuner_options(setup, cadence), goal=Goal(setup.slo), predictor=None)
    return [
        replace(
            static(base, BatchingConfig(b, GRID_TIMEOUT_MS, prefill_token_budget=budget)),
            replicas=r,
        )
        for r in replica_range(setup, scenario, curve)
        for b in GRID_BATCHES
        for budget in BUDGETS
    ]


@dataclass(frozen=True)
class ScaleAtOnce:
    """The fastest reaction a replica rule can have: one pod until `at_s` (the start, or
    the 3x step, whose base load is half of what one pod serves), `replicas` from the
    first round after it; the pods serve `startup_s` later."""

    at_s: float
    replicas: int

    def decide(
        self, signals: Signals, fleet: Fleet, state: ReplicaState, now: float
    ) -> ScaleDecision:
        replicas = self.replicas if now >= self.at_s else 1
        action = "scale_out" if replicas > fleet.desired else "hold"
        return ScaleDecision(replicas, action, "the reference's reaction", state)


def cold_start(oracle: SimOptions, scenario: Scenario) -> SimOptions:
    """The oracle's config reached as early as a rule can: on one pod until the first round
    (the step's, for the 3x step), the oracle's pods from then on. Requests queued before
    those pods serve miss as they finish: what a cold start costs the oracle's config."""
    replicas = MAX_REPLICAS if scenario.step_at_s is not None else oracle.replicas
    return replace(
        oracle, replicas=1, controller=ScaleAtOnce(scenario.step_at_s or 0.0, replicas)
    )


def recover_of(
    result: SimResult, setup: LlmSetup, scenario: Scenario, interval_s: float
) -> int | None:
    """Intervals after the one the step lands in until one meets the attainment again."""
    at = scenario.step_at_s
    if at is None:
        return None
    for i, iv in enumerate(result.intervals[int(at // interval_s) :]):
        if iv.attainment is not None and iv.attainment >= setup.slo.attainment:
            return i
    return None


def attainment(result: SimResult) -> float | None:
    judged = sum(iv.slo_judged for iv in result.intervals)
    return sum(iv.slo_met for iv in result.intervals) / judged if judged else None


def pick_oracle(runs: list[SimResult]) -> int:
    meeting = [i for i, r in enumerate(runs) if (attainment(r) or 0.0) >= ATTAINMENT]
    if not meeting:
        return max(range(len(runs)), key=lambda i: runs[i].goodput)
    return min(meeting, key=lambda i: (round(runs[i].replica_seconds), -runs[i].goodput))


def label(options: SimOptions) -> str:
    c = options.config
    return f"{options.replicas}x {c.max_batch_size}/{c.batch_timeout_ms:g}/{c.prefill_token_budget}"


@dataclass
class LlmResult:
    setup: LlmSetup
    scenario: Scenario
    oracle: SimResult
    oracle_label: str
    tuner: SimResult | None  # None: the tuning loop cannot take these targets
    tuner_error: str
    interval_s: float
    cold: SimResult | None = None  # `cold_start`'s run

    def _met(self, iv: Interval) -> bool:
        return iv.attainment is not None and iv.attainment >= self.setup.slo.attainment

    def steady_share(self) -> float | None:
        if self.tuner is None or self.scenario.name != "steady":
            return None
        judged = [iv for iv in self.tuner.intervals[WARMUP_INTERVALS:] if iv.slo_judged]
        return sum(self._met(iv) for iv in judged) / len(judged) if judged else None

    def recover_intervals(self) -> int | None:
        if self.tuner is None:
            return None
        return recover_of(self.tuner, self.setup, self.scenario, self.interval_s)

    def prediction_errors(self) -> dict[str, dict[str, float] | None]:
        return prediction_errors([] if self.tuner is None else self.tuner.intervals)

    def row(self) -> dict[str, Any]:
        tuner = self.tuner
        ratio = (
            None
            if tuner is None or not self.oracle.goodput
            else tuner.goodput / self.oracle.goodput
        )
        cost = None if tuner is None else tuner.replica_seconds / self.oracle.replica_seconds
        ref = self.cold
        return {
            "workload": self.setup.workload,
            "scenario": self.scenario.name,
            "ttft_ms": round(self.setup.slo.ttft_s * 1000, 1),  # type: ignore[operator]
            "tpot_ms": round(self.setup.slo.tpot_s * 1000, 2),  # type: ignore[operator]
            "oracle": self.oracle_label,
            "goodput_oracle": round(self.oracle.goodput, 3),
            "attainment_oracle": _round(attainment(self.oracle)),
            "goodput_tuner": None if tuner is None else round(tuner.goodput, 3),
            "attainment_tuner": None if tuner is None else _round(attainment(tuner)),
            "goodput_ratio": _round(ratio),
            "steady_share": _round(self.steady_share()),
            "recover_intervals": self.recover_intervals(),
            "recover_cold_start": None if ref is None else recover_of(
                ref, self.setup, self.scenario, self.interval_s
            ),
            "goodput_cold_start": None if ref is None or not self.oracle.goodput
            else _round(ref.goodput / self.oracle.goodput),
            "replica_seconds_ratio": _round(cost),
            "prediction_error": self.prediction_errors(),
            "tuner_error": self.tuner_error,
        }


class PredictedWindow(Protocol):
    """A window with what was predicted for it and what it measured (a simulated
    interval; bench/tuner_real_llm.py's real windows)."""

    @property
    def prediction(self) -> Prediction | None: ...

    @property
    def ttft_p99_s(self) -> float | None: ...

    @property
    def tpot_p99_s(self) -> float | None: ...

    @property
    def attainment(self) -> float | None: ...


def prediction_errors(windows: Iterable[PredictedWindow]) -> dict[str, dict[str, float] | None]:
    """Per quantity: median and worst |predicted - measured| / measured (attainment:
    absolute), over the windows that both predicted and measured it."""
    pairs: dict[str, list[float]] = {"ttft_p99": [], "tpot_p99": [], "attainment": []}
    for window in windows:
        p = window.prediction
        if p is None:
            continue
        for name, predicted, measured, relative in (
            ("ttft_p99", p.ttft_p99_s, window.ttft_p99_s, True),
            ("tpot_p99", p.tpot_p99_s, window.tpot_p99_s, True),
            ("attainment", p.attainment, window.attainment, False),
        ):
            # an attainment of 0 is a measurement (every request missed); a p99 of 0 has
            # no relative error
            if predicted is not None and measured is not None and (measured or not relative):
                error = abs(predicted - measured)
                pairs[name].append(error / measured if relative else error)
    return {
        name: {"median": round(float(np.median(v)), 3), "worst": round(max(v), 3)} if v else None
        for name, v in pairs.items()
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["goodput_ratio"] for r in rows if r["goodput_ratio"] is not None]
    shares = [r["steady_share"] for r in rows if r["steady_share"] is not None]
    recovers = [r["recover_intervals"] for r in rows if r["scenario"] == "step"]
    colds = [r["recover_cold_start"] for r in rows if r["scenario"] == "step"]
    tuned = len(ratios) == len(rows)
    return {
        "llm_min_goodput_ratio": min(ratios) if ratios else None,
        "llm_min_steady_share": min(shares) if shares else None,
        "llm_max_recover_intervals": None if None in recovers or not recovers else max(recovers),
        "llm_max_recover_cold_start": None if None in colds or not colds else max(colds),
        "llm_min_goodput_cold_start": min(
            (r["goodput_cold_start"] for r in rows if r["goodput_cold_start"] is not None),
            default=None,
        ),
        "llm_targets_met": bool(
            tuned
            and min(ratios) >= GOODPUT_TARGET
            and shares
            and min(shares) >= SHARE_TARGET
            and None not in recovers
            and max(recovers) <= RECOVER_TARGET
        ),
        "llm_tuned": tuned,
    }


def markdown(rows: list[dict[str, Any]], curve: StepCurve, duration_s: float) -> list[str]:
    lines = [
        "### LLM SLOs: TTFT + TPOT (bench/tuner_llm.py)",
        "",
        f"Simulated, continuous mode, {duration_s / 60:g} minutes per scenario, step-time "
        f"curve {curve.source} ({KV_TOKEN_S:g} s per KV token attended). Attainment target "
        f"{ATTAINMENT:g} per window. Oracle: best fixed `replicas x batch/timeout_ms/budget` "
        f"of batches {GRID_BATCHES}, budgets {BUDGETS}, replicas from the cheap bound "
        "(fewest replica-seconds meeting the attainment over the run, then most goodput). "
        f"Targets: goodput ratio >= {GOODPUT_TARGET}, steady share >= {SHARE_TARGET}, "
        f"recover <= {RECOVER_TARGET} intervals. Cold start: the oracle's own config "
        "reached as early as a rule can, on one pod until the first round (the step's, for "
        f"the 3x step) and the oracle's pods ({MAX_REPLICAS} after the step) from it; they "
        "serve `startup_s` later, and requests queued meanwhile miss as they finish: its "
        "goodput over the oracle's, and its intervals to meet the attainment after the "
        "step. Prediction error: |predicted - measured| / measured for the p99s, absolute "
        "for attainment, median/worst over the intervals.",
        "",
        "| workload | load | TTFT ms | TPOT ms | oracle | goodput oracle | attain. oracle "
        "| tuner/oracle | cold start/oracle | attain. tuner | steady share | recover "
        "| recover cold start | replica-s ratio | pred. err TTFT | pred. err TPOT "
        "| pred. err attain. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        errors = r["prediction_error"]

        def err(name: str, errors: dict[str, Any] = errors) -> str:
            e = errors[name]
            return "-" if e is None else f"{e['median']}/{e['worst']}"

        lines.append(
            f"| {r['workload']} | {r['scenario']} | {r['ttft_ms']} | {r['tpot_ms']} | "
            f"{r['oracle']} | {r['goodput_oracle']} | {_dash(r['attainment_oracle'])} | "
            f"{_dash(r['goodput_ratio'])} | {_dash(r['goodput_cold_start'])} | "
            f"{_dash(r['attainment_tuner'])} | "
            f"{_dash(r['steady_share'])} | {_dash(r['recover_intervals'])} | "
            f"{_dash(r['recover_cold_start'])} | {_dash(r['replica_seconds_ratio'])} | "
            f"{err('ttft_p99')} | {err('tpot_p99')} | {err('attainment')} |"
        )
    failed = sorted({r["tuner_error"] for r in rows if r["tuner_error"]})
    if failed:
        lines += ["", "The tuning loop could not run these scenarios: " + "; ".join(failed)]
    return [*lines, ""]


def _dash(value: object) -> str:
    return "-" if value is None else str(value)
