"""The tuner benchmark's fleet part: knobs and replicas in one loop, against an HPA-like rule.

Scenarios beyond one pod (continuous mode, the default): a 5x load step and back, a
diurnal day and a flash crowd. Each is played by
- batchpilot: the tuning loop deciding the knobs and, after them, the replicas
  (`spec.autoscale` 1..MAX_REPLICAS, HPA's 300 s scale-down stabilization);
- two HPA-like rules (bench/hpa.py), on p99 and on utilisation, knobs at the default;
- the oracle: the best static (replicas, batch, timeout) of a grid, the fewest
  replicas whose run p99 meets the SLO, then the most goodput; its replica-seconds are
  what a fleet sized for the peak costs.
Reported per scenario and rule: goodput and replica-seconds over the oracle's, the
share of intervals within the SLO, the intervals to meet the SLO again after the
step (3 in a row, target <= 4), and reversals of the replica count where the load is
steady (target 0).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from batchpilot_operator.policy.types import Cadence, Goal, ReplicaBounds
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import (
    Scenario,
    SimOptions,
    SimResult,
    StepCurve,
    simulate,
    static,
)
from hpa import HpaRule

# Longer answers than the knob scenarios' (chat-length): a pod then carries fewer
# requests per second, so a fleet of several plays in the time budget.
OUTPUT_TOKENS = 192
PROMPT_TOKENS = (8, 32)
PEAK = 5.0  # the step's and the flash crowd's load over the base
MAX_REPLICAS = 8
GRID_REPLICAS = (2, 3, 4, 5, 6)  # one pod cannot carry any scenario's peak
GRID_BATCHES = (8, 32, 64)
GRID_TIMEOUT_MS = 10.0  # continuous mode: the timeout only delays an idle engine's first step
HPA_P99_TARGET_SHARE = 0.8  # of the SLO: the tuner's own band edge
HPA_UTILISATION_TARGET = 0.8  # batchpilot's scale-out utilisation
RECOVER_TARGET = 4
STABLE_INTERVALS = 3
RULES = ("batchpilot", "hpa_p99", "hpa_utilisation")


@dataclass(frozen=True)
class FleetSetup:
    slo_s: float
    pod_rps: float  # what one pod serves at the default config

    @classmethod
    def from_curve(cls, curve: StepCurve) -> FleetSetup:
        # As the knob scenarios' Setup: three times the longest output at batch 16.
        slo_s = round(3.0 * OUTPUT_TOKENS * 1.75 * curve.step_s(16), 2)
        n = BatchingConfig().max_batch_size
        prefill_s = sum(PROMPT_TOKENS) / 2 * curve.per_token_s
        return cls(slo_s, n / (n * prefill_s + OUTPUT_TOKENS * curve.step_s(n)))


def fleet_scenarios(setup: FleetSetup, duration_s: float) -> list[Scenario]:
    base = round(setup.pod_rps, 2)
    quarter = duration_s / 4
    return [
        Scenario(
            "step", duration_s, base, OUTPUT_TOKENS, PROMPT_TOKENS, quarter, PEAK,
            back_at_s=2 * quarter,
        ),
        # diurnal: 0.4x to 1.6x its base; peak at four pods' default capacity
        Scenario("diurnal", duration_s, round(2.5 * base, 2), OUTPUT_TOKENS, PROMPT_TOKENS),
        Scenario("flash_crowd", duration_s, base, OUTPUT_TOKENS, PROMPT_TOKENS, quarter, PEAK),
    ]  # fmt: skip


def rule_options(rule: str, setup: FleetSetup, cadence: Cadence) -> SimOptions:
    bounds = ReplicaBounds(1, MAX_REPLICAS)
    slo = Slo(e2e_s=setup.slo_s)
    base = SimOptions(mode="continuous", config=BatchingConfig(), goal=Goal(slo), cadence=cadence)
    if rule == "batchpilot":
        return replace(base, goal=Goal(slo, replicas=bounds))
    metric, target = (
        ("p99", HPA_P99_TARGET_SHARE * setup.slo_s)
        if rule == "hpa_p99"
        else ("utilisation", HPA_UTILISATION_TARGET)
    )
    return replace(base, tune=False, controller=HpaRule(metric, target, bounds))  # type: ignore[arg-type]


def grid(setup: FleetSetup, cadence: Cadence) -> list[SimOptions]:
    base = rule_options("hpa_p99", setup, cadence)
    return [
        replace(
            static(base, BatchingConfig(max_batch_size=b, batch_timeout_ms=GRID_TIMEOUT_MS)),
            replicas=n,
            controller=None,
        )
        for n in GRID_REPLICAS
        for b in GRID_BATCHES
    ]


@dataclass
class FleetResult:
    scenario: Scenario
    runs: dict[str, SimResult]  # per rule
    oracle: SimResult
    oracle_label: str
    slo_s: float
    interval_s: float

    def row(self, rule: str) -> dict[str, Any]:
        run = self.runs[rule]
        judged = [iv.p99_s for iv in run.intervals if iv.p99_s is not None]
        return {
            "scenario": self.scenario.name,
            "rule": rule,
            "oracle": self.oracle_label,
            "goodput_ratio": round(run.goodput / self.oracle.goodput, 3),
            "replica_seconds_ratio": round(run.replica_seconds / self.oracle.replica_seconds, 3),
            "replica_seconds": round(run.replica_seconds),
            "within_slo": round(sum(p <= self.slo_s for p in judged) / len(judged), 3),
            "p99_s": None if run.p99_s is None else round(run.p99_s, 3),
            "recover_intervals": self._recover(run),
            "reversals_steady": self._reversals(run),
            "max_replicas": max(iv.replicas for iv in run.intervals),
            "rejected": run.rejected,
        }

    def _recover(self, run: SimResult) -> int | None:
        at = self.scenario.step_at_s
        if at is None:
            return None
        start = int(at // self.interval_s)
        ivs = run.intervals
        for i in range(start, len(ivs) - STABLE_INTERVALS + 1):
            window = ivs[i : i + STABLE_INTERVALS]
            if all(iv.p99_s is None or iv.p99_s <= self.slo_s for iv in window):
                return i - start
        return None

    def _reversals(self, run: SimResult) -> int | None:
        """Direction reversals of the replica count inside stretches of constant load,
        from the stretch's first interval after the fleet first settled (the step only)."""
        sc = self.scenario
        if sc.name != "step" or sc.step_at_s is None or sc.back_at_s is None:
            return None
        edges = [0.0, sc.step_at_s, sc.back_at_s, sc.duration_s]
        total = 0
        for low, high in itertools.pairwise(edges):
            counts = [iv.replicas for iv in run.intervals if low < iv.end_s <= high]
            moves = [b - a for a, b in itertools.pairwise(counts) if b != a]
            total += sum(1 for a, b in itertools.pairwise(moves) if (a > 0) != (b > 0))
        return total


def meets_slo(result: SimResult | None, slo_s: float) -> bool:
    return result is not None and result.p99_s is not None and result.p99_s <= slo_s


def pick_oracle(configs: list[SimOptions], results: list[SimResult | None], slo_s: float) -> int:
    """The fewest replicas whose run p99 meets the SLO, then the most goodput (none
    meets it: the most goodput); configs whose run is None were not played."""
    played = [i for i, r in enumerate(results) if r is not None]
    meeting = [i for i in played if meets_slo(results[i], slo_s)]
    pool = meeting or played
    fewest = min(configs[i].replicas for i in pool)
    return max(
        (i for i in pool if configs[i].replicas == fewest),
        key=lambda i: results[i].goodput,  # type: ignore[union-attr]
    )


@dataclass(frozen=True)
class OracleSearch:
    """The oracle's grid (`grid`), played fewest replicas first: every batch at one
    replica count, and no larger count once one of them meets the SLO. The oracle
    (`pick_oracle`) is the fewest replicas that meet it, so a larger count is never it:
    the result is the full grid's, without the runs that cost the most (more pods, more
    steps)."""

    scenario: Scenario
    configs: tuple[SimOptions, ...]
    curve: StepCurve
    seed: int
    slo_s: float

    def play(self) -> list[SimResult | None]:
        """Each config's run, None for those not played."""
        results: list[SimResult | None] = [None] * len(self.configs)
        for replicas in sorted({c.replicas for c in self.configs}):
            at = [i for i, c in enumerate(self.configs) if c.replicas == replicas]
            for i in at:
                results[i] = simulate(self.scenario, self.configs[i], self.curve, self.seed)
            if any(meets_slo(results[i], self.slo_s) for i in at):
                break
        return results


def label(options: SimOptions) -> str:
    c = options.config
    return f"{options.replicas}x {c.max_batch_size}/{c.batch_timeout_ms:g}"


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """batchpilot against each HPA rule, per scenario: fewer replica-seconds for at least
    the same share of intervals within the SLO."""
    by = {(r["scenario"], r["rule"]): r for r in rows}
    scenarios = sorted({r["scenario"] for r in rows})
    wins = {
        f"{s}/{hpa}": by[(s, "batchpilot")]["replica_seconds"] < by[(s, hpa)]["replica_seconds"]
        and by[(s, "batchpilot")]["within_slo"] >= by[(s, hpa)]["within_slo"]
        for s in scenarios
        for hpa in RULES[1:]
    }
    ours = [by[(s, "batchpilot")] for s in scenarios]
    recover = [r["recover_intervals"] for r in ours if r["scenario"] != "diurnal"]
    reversals = [r["reversals_steady"] for r in ours if r["reversals_steady"] is not None]
    return {
        "fleet_beats_hpa": wins,
        "fleet_max_recover_intervals": None if None in recover else max(recover, default=None),
        "fleet_reversals_steady": sum(reversals),
        "fleet_targets_met": bool(
            all(wins.values())
            and None not in recover
            and max(recover, default=0) <= RECOVER_TARGET
            and sum(reversals) == 0
        ),
    }


def plot(results: list[FleetResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, len(results), figsize=(4.5 * len(results), 8), sharex=True)
    for col, r in enumerate(results):
        for rule, style in zip(RULES, ("-", "--", ":"), strict=True):
            ivs = r.runs[rule].intervals
            minutes = np.array([iv.end_s for iv in ivs]) / 60
            p99 = [np.nan if iv.p99_s is None else iv.p99_s for iv in ivs]
            axes[0, col].plot(minutes, p99, style, label=rule)
            axes[1, col].step(minutes, [iv.replicas for iv in ivs], style, where="post", label=rule)
            if rule == "batchpilot":
                batch = [iv.config.max_batch_size if iv.config else np.nan for iv in ivs]
                axes[2, col].step(minutes, batch, where="post")
        axes[0, col].axhline(r.slo_s, color="red", linewidth=0.8)
        axes[0, col].set_yscale("log")
        axes[0, col].set_title(f"{r.scenario.name} (oracle {r.oracle_label})")
        axes[2, col].set_xlabel("minutes")
    axes[0, 0].set_ylabel("interval p99 (s)")
    axes[1, 0].set_ylabel("replicas")
    axes[2, 0].set_ylabel("batchpilot max_batch_size")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("fleet: p99 per 30 s interval (red: SLO), replicas, and batchpilot's batch")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(setup: FleetSetup, rows: list[dict[str, Any]], duration_s: float) -> list[str]:
    lines = [
        "### Knobs and replicas (fleet)",
        "",
        f"Continuous mode, {duration_s / 60:g} simulated minutes per scenario, outputs of "
        f"{OUTPUT_TOKENS} tokens on average, p99 SLO {setup.slo_s:g} s; one pod serves "
        f"{setup.pod_rps:.1f} req/s at the default config. Scenarios: a {PEAK:g}x step "
        "for the second quarter and back, a diurnal day (0.4x to 1.6x of 2.5 pods' worth), "
        f"a flash crowd ({PEAK:g}x at a quarter, fading with a 300 s time constant). A new "
        "pod serves 30 s after the decision; least-outstanding balancing. batchpilot: "
        f"`autoscale` 1..{MAX_REPLICAS}, 300 s scale-down stabilization. HPA-like: "
        f"knobs at the default, `ceil(current * metric / target)` on p99 (target "
        f"{HPA_P99_TARGET_SHARE:g}x SLO) or on utilisation (target {HPA_UTILISATION_TARGET:g}), "
        "10% tolerance, 300 s down, 0 s up. Oracle: the fewest replicas of a "
        f"{len(GRID_REPLICAS)}x{len(GRID_BATCHES)} grid (replicas x batch, timeout "
        f"{GRID_TIMEOUT_MS:g} ms) whose run p99 meets the SLO, then the most goodput. "
        "Targets: recover <= 4 intervals, 0 reversals in steady load, fewer replica-seconds "
        "than HPA at no lower SLO attainment.",
        "",
        "| scenario | rule | oracle | goodput/oracle | replica-s/oracle | replica-s | within SLO "
        "| p99 s | recover | reversals | max replicas | rejected |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['rule']} | {r['oracle']} | {r['goodput_ratio']} | "
            f"{r['replica_seconds_ratio']} | {r['replica_seconds']} | {r['within_slo']} | "
            f"{r['p99_s']} | {_dash(r['recover_intervals'])} | {_dash(r['reversals_steady'])} | "
            f"{r['max_replicas']} | {r['rejected']} |"
        )
    lines += ["", "![fleet](tuner_fleet.png)", ""]
    return lines


def _dash(value: int | None) -> str:
    return "-" if value is None else str(value)
