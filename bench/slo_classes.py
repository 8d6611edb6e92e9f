"""SLO classes on shared pods against a pool per class (simulated).

Two classes of traffic to one model (tools/simulator.py: the real schedulers, which
serve the higher class first with the age bound `--class-max-wait-s`):
- interactive: chat (bench/tuner_llm.py's lengths), TTFT 1 s and chat's TPOT from the
  step curve, high priority;
- batch: long prompts, short-to-medium answers, an end-to-end target of minutes, low
  priority.
Each is played two ways, tuned by the current tuner (the tuning loop with
bench/tuner_llm.py's options: knobs and replicas 1..MAX_REPLICAS):
- shared: one pool serving both classes; the policy states both classes, its top-level
  targets are the interactive class's;
- separate: a pool per class, each with its class's targets alone.
Under two loads: steady, and a 10x burst of the batch class (`BURST_S` long, a third in).
Reported per class: the share of steady windows (after the warm-up) meeting the class's
attainment, and the interactive class's windows missed from the burst's start to the
load's end (the cold start's before it are the steady share's); every batch request
answered or not (refused, still held, lost) after a drain, and the longest a batch
request waited to start against the age bound; replica-seconds over the load, shared
against separate (their ratio: separate / shared). Targets: each share
>= 0.95, ratio >= 1.3, <= 1 interactive window missed in the burst, no batch request
lost, none refused.

The tuner's window reads the classes (docs/tuning.md "SLO classes"): the fallback
table's pressure is the binding class's, each class's p99s against its own targets,
and its queue symptom the queue that class waits behind (the classes of its priority or
higher): the batch class's queue in a burst does not make the interactive class's TPOT
miss `overloaded`.
The predicted choice judges each class's tails on its own lengths (the pods' length
histograms by class) against its own targets, every class within the margin of its own
attainment, on the totals' queue (predictor.py). On the simulator as it was when that
came in (a mixed step timed as two forwards) it did not move this bench: the
steady shared pool's scale-out to 4 pods at 1020 s was the KV watermark's, not the
margin's (every 3-pod candidate with batch >= 8 was predicted at 1.15 of the pool, the
pool's size read as the window's mean KV tokens a step over its fullest pod's peak
usage, 8071 tokens for 65536; the 3-pod batch 4 waits for a slot). Read at the pool's
true size, that run's steady ratio was 1.258 with classes judged apart or not.

Writes the `slo-classes` section of docs/benchmarks.md (full mode only); prints one JSON
line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import tuner_llm as llm
from batchpilot_operator.policy.types import Cadence
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_server.batching_config import DEFAULT_CLASS
from batchpilot_server.engine_api import CLASS_MAX_WAIT_S, LOWER_CLASS_PREFILL_TOKENS
from batchpilot_tools.simulator import (
    Scenario,
    SimOptions,
    SimResult,
    StepCurve,
    Workload,
    make_workload,
    merge_workloads,
    simulate_workload,
)
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = ROOT / "docs" / "benchmarks.md"
SECTION = "slo-classes"

CADENCE = Cadence()  # the CRD's defaults
DURATION_S = 1800.0
QUICK_DURATION_S = 600.0
DRAIN_S = 900.0  # after the load: every batch request held is answered by then
BURST_S = 120.0  # the batch class's burst: 10x for this long, a third into the run
BURST = 10.0
INTERACTIVE, BATCH = "interactive", "batch"
INTERACTIVE_TTFT_S = 1.0
BATCH_E2E_S = 300.0
BATCH_LENGTHS = llm.Lengths(prompt=(2000, 6000), output=(50, 300))
INTERACTIVE_RPS_PODS = llm.LOAD_SHARE  # the interactive load, in pods at the default config
BATCH_RPS = 0.1  # the batch class's steady load (requests/s)
SHARE_TARGET = 0.95
RATIO_TARGET = 1.3
BURST_MISSES_TARGET = 1


@dataclass(frozen=True)
class ClassPair:
    """An interactive and a batch class, and the policy each pool states."""

    interactive: SloClass
    batch: SloClass

    def of_name(self, name: str) -> SloClass:
        return self.interactive if name == INTERACTIVE else self.batch

    def shared_slo(self) -> Slo:
        """The shared pool's policy: both classes; the top-level targets (the tuner's, and
        those of a request naming no class) are the interactive class's."""
        i = self.interactive
        return Slo(i.ttft_s, i.tpot_s, i.e2e_s, i.attainment, classes=(i, self.batch))

    def pool_slo(self, name: str) -> Slo:
        """A separate pool's policy: its class's targets alone."""
        c = self.of_name(name)
        return Slo(c.ttft_s, c.tpot_s, c.e2e_s, c.attainment)


@dataclass(frozen=True)
class Classes(ClassPair):
    """Both classes' targets and their interactive load, from the step curve."""

    interactive_rps: float

    @classmethod
    def of(cls, curve: StepCurve) -> Classes:
        chat = llm.LlmSetup.of("chat", curve)
        return cls(
            SloClass(INTERACTIVE, 10, INTERACTIVE_TTFT_S, chat.slo.tpot_s, None, llm.ATTAINMENT),
            SloClass(BATCH, 0, e2e_s=BATCH_E2E_S, attainment=llm.ATTAINMENT),
            round(INTERACTIVE_RPS_PODS * chat.pod_rps, 3),
        )


def loads(classes: Classes, duration_s: float) -> dict[str, dict[str, Scenario]]:
    """Per load, each class's traffic."""
    chat = llm.WORKLOADS["chat"]

    def scenario(lengths: llm.Lengths, rate: float, **kw: Any) -> Scenario:
        return Scenario(
            kw.pop("name", "steady"), duration_s, rate, round(lengths.mean_output),
            lengths.prompt, output_range=lengths.output, **kw,
        )  # fmt: skip

    interactive = scenario(chat, classes.interactive_rps)
    at = burst_start_s(duration_s)
    burst = scenario(BATCH_LENGTHS, BATCH_RPS, name="step", step_at_s=at, peak=BURST,
                     back_at_s=at + BURST_S)  # fmt: skip
    return {
        "steady": {INTERACTIVE: interactive, BATCH: scenario(BATCH_LENGTHS, BATCH_RPS)},
        "burst": {INTERACTIVE: interactive, BATCH: burst},
    }


def burst_start_s(duration_s: float) -> float:
    """When the batch class's burst starts: a third into the load."""
    return round(duration_s / 3)


def options(slo: Slo, curve: StepCurve) -> SimOptions:
    """bench/tuner_llm.py's tuner options for a policy of `slo`."""
    setup = replace(llm.LlmSetup.of("chat", curve), slo=slo)
    return llm.tuner_options(setup, CADENCE)


Job = tuple[Workload, SimOptions, StepCurve, float, float]


def _run(job: Job) -> SimResult:
    work, opts, curve, run_s, cost_until_s = job
    return simulate_workload(work, opts, curve, run_s, cost_until_s)


def jobs(
    classes: Classes, curve: StepCurve, duration_s: float, seed: int, max_wait_s: float
) -> dict[str, Job]:
    """The runs by name: `<load>/shared`, `<load>/<class>` (the separate pools); the
    shared pool's pods rank by class with the age bound `max_wait_s`."""
    run_s = duration_s + DRAIN_S
    out: dict[str, Job] = {}
    for load, parts in loads(classes, duration_s).items():
        works = {name: make_workload(sc, seed + i) for i, (name, sc) in enumerate(parts.items())}
        shared = replace(options(classes.shared_slo(), curve), class_max_wait_s=max_wait_s)
        out[f"{load}/shared"] = (merge_workloads(works), shared, curve, run_s, duration_s)
        for name, work in works.items():
            if load != "steady" and name == INTERACTIVE:
                continue  # the same traffic as in the steady load: that run serves both
            pool = options(classes.pool_slo(name), curve)
            # its requests in the pool's default class: kept by class like the shared ones
            alone = replace(work, classes=(DEFAULT_CLASS,) * len(work.arrivals))
            out[f"{load}/{name}"] = (alone, pool, curve, run_s, duration_s)
    return out


def run_all(named: dict[str, Job], workers: int) -> dict[str, SimResult]:
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return dict(zip(named, pool.map(_run, named.values()), strict=True))


def window_range(duration_s: float) -> slice:
    """The windows judged: after the warm-up, up to the load's end (not the drain)."""
    return slice(llm.WARMUP_INTERVALS, round(duration_s / CADENCE.interval_s))


def class_windows(
    result: SimResult, name: str, duration_s: float, from_s: float = 0.0
) -> list[float]:
    """Each judged window's attainment for class `name`, of those ending after `from_s`."""
    parts = [
        iv.classes.get(name)
        for iv in result.intervals[window_range(duration_s)]
        if iv.end_s > from_s
    ]
    return [p.attainment for p in parts if p is not None and p.attainment is not None]


def class_stats(
    result: SimResult, name: str, kept_as: str, classes: Classes, duration_s: float
) -> dict[str, Any]:
    """Class `name` in one run, whose simulator kept it as `kept_as` (a separate pool's
    requests are in its default class): windows meeting its attainment and the misses by
    target in the judged windows, goodput, what became of its requests, the longest wait
    to start."""
    target = classes.of_name(name).attainment
    windows = class_windows(result, kept_as, duration_s)
    met = sum(a >= target for a in windows)
    # the windows from the burst's start to the load's end (under a steady load: the
    # same stretch), which a burst may cost, apart from the cold start's
    since_burst = class_windows(result, kept_as, duration_s, burst_start_s(duration_s))
    missed: dict[str, int] = {}
    for iv in result.intervals[window_range(duration_s)]:
        for reason, n in getattr(iv.classes.get(kept_as), "slo_missed", {}).items():
            missed[reason] = missed.get(reason, 0) + n
    t = result.classes[kept_as]
    return {
        "windows": len(windows),
        "windows_met": met,
        "share": _round(met / len(windows)) if windows else None,
        "windows_missed": len(windows) - met,
        "windows_missed_since_burst": sum(a < target for a in since_burst),
        "missed_by_target": {k: v for k, v in sorted(missed.items()) if k != "all"},
        "goodput": round(t.good / duration_s, 3),
        "arrived": t.arrived,
        "answered": t.completed,
        "refused": t.rejected,
        "unfinished": t.unfinished,
        "lost": t.lost,
        "max_wait_s": round(t.max_wait_s, 1),
        "replica_seconds": round(result.replica_seconds),
    }


def summarize(results: dict[str, SimResult], classes: Classes, duration_s: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for load in ("steady", "burst"):
        shared = results[f"{load}/shared"]
        pools = {
            INTERACTIVE: results[f"steady/{INTERACTIVE}"],
            BATCH: results[f"{load}/{BATCH}"],
        }
        separate_s = sum(r.replica_seconds for r in pools.values())
        out[load] = {
            "shared": {
                name: class_stats(shared, name, name, classes, duration_s)
                for name in (INTERACTIVE, BATCH)
            },
            "separate": {
                name: class_stats(r, name, DEFAULT_CLASS, classes, duration_s)
                for name, r in pools.items()
            },
            "replica_seconds_shared": round(shared.replica_seconds),
            "replica_seconds_separate": round(separate_s),
            "replica_seconds_ratio": _round(separate_s / shared.replica_seconds),
        }
    return out


def verdict(summary: dict[str, Any]) -> dict[str, Any]:
    steady, burst = summary["steady"]["shared"], summary["burst"]["shared"]
    shares = {name: steady[name]["share"] for name in (INTERACTIVE, BATCH)}
    batch = burst[BATCH]
    checks = {
        "steady_shares_met": all(s is not None and s >= SHARE_TARGET for s in shares.values()),
        "replica_ratio_met": (summary["steady"]["replica_seconds_ratio"] or 0) >= RATIO_TARGET,
        "burst_interactive_met": (
            burst[INTERACTIVE]["windows_missed_since_burst"] <= BURST_MISSES_TARGET
        ),
        "burst_batch_none_lost": batch["lost"] == 0 and batch["unfinished"] == 0,
        "burst_batch_none_refused": batch["refused"] == 0,
    }
    return {
        "failed": [name for name, ok in checks.items() if not ok],
        "steady_share_interactive": shares[INTERACTIVE],
        "steady_share_batch": shares[BATCH],
        "replica_seconds_ratio": summary["steady"]["replica_seconds_ratio"],
        "burst_replica_seconds_ratio": summary["burst"]["replica_seconds_ratio"],
        "burst_interactive_windows_missed": burst[INTERACTIVE]["windows_missed_since_burst"],
        "burst_interactive_windows_missed_whole_run": burst[INTERACTIVE]["windows_missed"],
        "steady_interactive_windows_missed_since_burst_start": (
            steady[INTERACTIVE]["windows_missed_since_burst"]
        ),
        "burst_batch_max_wait_s": batch["max_wait_s"],
        **checks,
        "targets_met": all(checks.values()),
    }


SIDE_BY_SIDE = ("share", "windows_missed", "missed_by_target", "goodput", "max_wait_s")


def side_by_side(summary: dict[str, Any]) -> dict[str, Any]:
    """Per load, per pool: each class's steady share, goodput and longest wait to start,
    and the pool's replica-seconds."""
    return {
        load: {
            pool: {
                "replica_seconds": s[f"replica_seconds_{pool}"],
                **{name: {k: c[k] for k in SIDE_BY_SIDE} for name, c in s[pool].items()},
            }
            for pool in ("shared", "separate")
        }
        for load, s in summary.items()
    }


def markdown(
    summary: dict[str, Any],
    classes: Classes,
    curve: StepCurve,
    duration_s: float,
    seed: int,
    max_wait_s: float,
) -> str:
    i, b = classes.interactive, classes.batch
    lines = [
        "## SLO classes: shared pods against a pool per class (bench/slo_classes.py)",
        "",
        f"Simulated (tools/simulator.py, the real schedulers), continuous mode, "
        f"{duration_s / 60:g} minutes of load then a {DRAIN_S / 60:g}-minute drain, seed "
        f"{seed}, step-time curve {curve.source}. Classes: **{i.name}** (priority "
        f"{i.priority}; chat's lengths; TTFT {i.ttft_s:g} s, TPOT {i.tpot_s:g} s; "
        f"{classes.interactive_rps:g} req/s) and **{b.name}** (priority {b.priority}; prompts "
        f"{BATCH_LENGTHS.prompt[0]}-{BATCH_LENGTHS.prompt[1]} tokens, answers "
        f"{BATCH_LENGTHS.output[0]}-{BATCH_LENGTHS.output[1]}; e2e {b.e2e_s:g} s; "
        f"{BATCH_RPS:g} req/s, {BURST:g}x for {BURST_S:g} s a third in under the burst), "
        f"both at attainment {i.attainment:g} per window. Age bound (`--class-max-wait-s`): "
        f"{max_wait_s:g} s; a step that decodes interactive requests computes at most "
        f"{LOWER_CLASS_PREFILL_TOKENS} batch prompt tokens (`--lower-class-prefill-tokens`). "
        "Shared: one pool, the policy states both classes, its "
        "top-level targets are the interactive one's. Separate: a pool per class with its "
        "targets alone (the interactive pool's traffic is the same under both loads: one "
        f"run). Every pool tuned by the tuning loop (knobs and 1..{llm.MAX_REPLICAS} "
        "replicas, bench/tuner_llm.py's options).",
        "",
        "**The tuner judges each class on its own**: the predicted choice judges each "
        "class's tails by its own lengths against its own targets (the queue, the "
        "steps and the KV pool, the pods' own size, are the totals'); the fallback "
        "table reads the binding class's pressure and the queue it waits behind. The "
        "pods order service by class (priority first, the age bound). Replica-seconds "
        "are counted "
        "over the load, not the drain. Steady windows: those after the first "
        f"{llm.WARMUP_INTERVALS} ({CADENCE.interval_s:g} s each) that judged a request of "
        "the class. Misses by target: the class's requests that missed each target in "
        "those windows. Every pool keeps at least one pod (the tuner's lower bound), so "
        "sharing saves at most the batch pool's pods, less what the batch work adds to the "
        "shared pool; and a batch prompt's chunks still share the steps of the "
        "interactive requests running beside it (small ones, the flag's), as do the "
        "batch requests' decode rows with their long contexts, which an interactive "
        "class's TPOT pays.",
        "",
        "| load | pool | class | windows met | share | misses by target | goodput req/s "
        "| answered | refused | unfinished | lost | max wait to start s | pool replica-s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for load in ("steady", "burst"):
        s = summary[load]
        for pool in ("shared", "separate"):
            for name, c in s[pool].items():
                misses = ", ".join(f"{k} {n}" for k, n in c["missed_by_target"].items())
                cost = (
                    c["replica_seconds"] if pool == "separate" else f"{c['replica_seconds']} (both)"
                )
                lines.append(
                    f"| {load} | {pool} | {name} | {c['windows_met']}/{c['windows']} | "
                    f"{_dash(c['share'])} | {misses or '-'} | {c['goodput']} | "
                    f"{c['answered']}/{c['arrived']} | {c['refused']} | {c['unfinished']} | "
                    f"{c['lost']} | {c['max_wait_s']} | {cost} |"
                )
    v = verdict(summary)
    lines += [
        "",
        f"Replica-seconds, separate over shared: {v['replica_seconds_ratio']} steady, "
        f"{v['burst_replica_seconds_ratio']} under the burst (target >= {RATIO_TARGET:g}). "
        f"Interactive windows missed from the burst's start ({burst_start_s(duration_s):g} s) "
        f"to the load's end: {v['burst_interactive_windows_missed']} under the burst, "
        f"{v['steady_interactive_windows_missed_since_burst_start']} under the steady load "
        f"over the same stretch ({v['burst_interactive_windows_missed_whole_run']} in the "
        "burst's whole run, its cold start's included). "
        f"Targets: each class's steady share >= {SHARE_TARGET:g}, <= "
        f"{BURST_MISSES_TARGET} interactive window missed from the burst's start on, every "
        "batch request "
        f"answered, none refused: {'all met' if v['targets_met'] else 'not all met'}"
        f"{'' if v['targets_met'] else ' (failed: ' + ', '.join(v['failed']) + ')'}.",
    ]
    return "\n".join(lines) + "\n"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/slo_classes.py", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--quick", action="store_true",
        help=f"{QUICK_DURATION_S / 60:g} minutes of load, nothing written to docs/",
    )  # fmt: skip
    ap.add_argument("--duration-s", type=float, help="the load's length (tests); implies --quick")
    ap.add_argument(
        "--class-max-wait-s", type=float, default=CLASS_MAX_WAIT_S,
        help="the shared pods' age bound (the server's flag; default its default)",
    )  # fmt: skip
    args = ap.parse_args(argv)
    started = time.monotonic()
    curve = llm.llm_curve(StepCurve.load())
    classes = Classes.of(curve)
    quick = args.quick or args.duration_s is not None
    duration_s = args.duration_s or (QUICK_DURATION_S if quick else DURATION_S)
    max_wait_s = args.class_max_wait_s
    results = run_all(jobs(classes, curve, duration_s, args.seed, max_wait_s), args.workers)
    summary = summarize(results, classes, duration_s)
    for load, s in summary.items():
        print(json.dumps({"load": load, **s}), file=sys.stderr)
    if not quick:
        replace_section(
            BENCHMARKS_MD,
            SECTION,
            markdown(summary, classes, curve, duration_s, args.seed, max_wait_s),
        )
    print(
        json.dumps(
            {
                "bench": "slo_classes",
                "curve": curve.source,
                "duration_s": duration_s,
                "seed": args.seed,
                **verdict(summary),
                "class_max_wait_s": max_wait_s,
                "side_by_side": side_by_side(summary),
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
