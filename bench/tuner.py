"""Tuner benchmark: the tuner against the best static config, per scenario and mode.

Simulated part (tools/simulator.py: the engine's real schedulers and KV block
pool under a virtual clock, the tuning loop in the loop, an hour of traffic per
run): for each scenario and engine mode,
- the oracle: the best static config of a grid (most goodput with the run's
  p99 within the SLO), found by simulating every grid config;
- the static default (BatchingConfig()'s batch 8, timeout 10 ms);
- the tuner, starting from the default.
Reported: goodput ratio tuner/oracle, the share of post-convergence
intervals whose p99 meets the SLO, and the intervals the tuner needs to
re-converge after the 3x load step. Targets: >= 0.95, >= 99%, <= 5.

Real part (unless --skip-real): two `batchpilot serve` processes with the
tiny model under the same time-varying load from the load generator, one
left at the default config, one tuned live by the local tuner with scrape
signals; their goodput and p99 side by side.

Writes docs/tuner_<mode>.png and the `## Tuning (bench/tuner.py)` section of
docs/benchmarks.md; prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from batchpilot_operator.actuators import get_batching
from batchpilot_operator.tune_local import TuneOptions, tune_loop
from batchpilot_operator.tuner import Cadence, Goal, Slo
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_tools.demo.supervisor import ServerProcess, stop_process, wait_ready
from batchpilot_tools.loadgen import LengthDist, LoadReport, LoadSpec, run_load
from batchpilot_tools.prometheus_local import free_port
from batchpilot_tools.simulator import (
    Scenario,
    SimOptions,
    SimResult,
    StepCurve,
    simulate,
    static,
)
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
BENCHMARKS_MD = DOCS / "benchmarks.md"

CADENCE = Cadence()  # the CRD's defaults
DURATION_S = 3600.0
GRID_BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64)
GRID_TIMEOUTS_MS = (0.0, 10.0, 50.0)
OUTPUT_TOKENS = 64  # mean; the simulator draws uniform [16, 112]
PROMPT_TOKENS = (8, 32)
STABLE_INTERVALS = 3  # p99 within SLO this many intervals in a row = converged
RECONVERGE_GRACE = 5  # the target; intervals after a disturbance not held against the SLO share
# The modes the tuner is judged in, as in every earlier run of this benchmark.
MODES: tuple[Mode, ...] = ("dynamic", "continuous")
TARGETS = {"goodput_ratio": 0.95, "within_slo": 0.99, "reconverge_intervals": 5}


@dataclass(frozen=True)
class Setup:
    """Workload scale derived from the step-time curve, so any curve gives a fair test."""

    slo_s: float
    default_capacity_rps: dict[str, float]  # per mode, at the default config's batch

    @classmethod
    def from_curve(cls, curve: StepCurve) -> Setup:
        longest = OUTPUT_TOKENS * 1.75
        # SLO: three times what the longest output takes at batch 16: room for
        # dynamic mode's wait behind a running batch, tight enough that the
        # best batch lies inside the grid rather than at either end.
        slo_s = round(3.0 * longest * curve.step_s(16), 2)
        prefill_s = sum(PROMPT_TOKENS) / 2 * curve.per_token_s
        n = BatchingConfig().max_batch_size
        # continuous: n sequences decode together, each admitted with its prefill.
        continuous = n / (n * prefill_s + OUTPUT_TOKENS * curve.step_s(n))
        # dynamic: a batch of n lasts until its longest member ends; for outputs
        # uniform on [lo, hi] that is lo + (hi - lo) * n / (n + 1) tokens on average.
        low, high = OUTPUT_TOKENS / 4, OUTPUT_TOKENS * 1.75
        batch_longest = low + (high - low) * n / (n + 1)
        dynamic = n / (n * prefill_s + batch_longest * curve.step_s(n))
        return cls(slo_s=slo_s, default_capacity_rps={"continuous": continuous, "dynamic": dynamic})


# Peak loads sit just above what the default config serves, and below what a
# larger batch serves: the default must fail there and a good config must not.
PEAK = 1.1


def scenarios(setup: Setup, mode: Mode) -> list[Scenario]:
    cap = setup.default_capacity_rps[mode]

    def rate(share: float) -> float:
        return round(share * cap, 2)

    third = DURATION_S / 3
    return [
        Scenario("steady", DURATION_S, rate(PEAK), OUTPUT_TOKENS, PROMPT_TOKENS),
        Scenario("step", DURATION_S, rate(PEAK / 3), OUTPUT_TOKENS, PROMPT_TOKENS, third),
        Scenario("diurnal", DURATION_S, rate(PEAK / 1.6), OUTPUT_TOKENS, PROMPT_TOKENS),
        Scenario("bursts", DURATION_S, rate(PEAK / 2.5), OUTPUT_TOKENS, PROMPT_TOKENS),
        Scenario(
            "longer_outputs", DURATION_S, rate(PEAK / 1.5), OUTPUT_TOKENS, PROMPT_TOKENS,
            DURATION_S / 2,
        ),
    ]


def grid() -> list[BatchingConfig]:
    return [
        BatchingConfig(max_batch_size=b, batch_timeout_ms=t)
        for b in GRID_BATCHES
        for t in GRID_TIMEOUTS_MS
    ]


def _run(args: tuple[Scenario, SimOptions, StepCurve, int]) -> SimResult:
    return simulate(*args)


@dataclass
class ScenarioResult:
    scenario: Scenario
    mode: Mode
    oracle_config: BatchingConfig
    oracle: SimResult
    default: SimResult
    tuner: SimResult
    slo_s: float

    def disturbance_index(self) -> int | None:
        at = self.scenario.step_at_s
        return None if at is None else int(at // CADENCE.interval_s)

    def converged_index(self) -> int | None:
        return _first_stable(self.tuner, self.slo_s, 0)

    def reconverge_intervals(self) -> int | None:
        start = self.disturbance_index()
        if start is None:
            return None
        stable = _first_stable(self.tuner, self.slo_s, start)
        return None if stable is None else stable - start

    def within_slo_share(self) -> float | None:
        start = self.converged_index()
        if start is None:
            return None
        grace = self.disturbance_index()
        judged = [
            iv
            for i, iv in enumerate(self.tuner.intervals)
            if i >= start
            and iv.p99_s is not None
            and not (grace is not None and grace <= i < grace + RECONVERGE_GRACE)
        ]
        if not judged:
            return None
        return sum(iv.p99_s <= self.slo_s for iv in judged if iv.p99_s is not None) / len(judged)

    def row(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario.name,
            "mode": self.mode,
            "oracle": _label(self.oracle_config),
            "goodput_oracle": round(self.oracle.goodput, 2),
            "goodput_default": round(self.default.goodput, 2),
            "goodput_tuner": round(self.tuner.goodput, 2),
            "ratio_tuner": round(self.tuner.goodput / self.oracle.goodput, 3),
            "ratio_default": round(self.default.goodput / self.oracle.goodput, 3),
            "p99_oracle_s": _round(self.oracle.p99_s),
            "p99_default_s": _round(self.default.p99_s),
            "p99_tuner_s": _round(self.tuner.p99_s),
            "within_slo": _round(self.within_slo_share()),
            "converged_at": self.converged_index(),
            "reconverge_intervals": self.reconverge_intervals(),
            "changes": sum(
                1 for iv in self.tuner.intervals if iv.decision and iv.decision.action != "hold"
            ),
        }


def _label(config: BatchingConfig) -> str:
    return f"{config.max_batch_size}/{config.batch_timeout_ms:g}"


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _first_stable(result: SimResult, slo_s: float, start: int) -> int | None:
    """First interval from `start` that opens STABLE_INTERVALS in a row within the SLO."""
    ivs = result.intervals
    for i in range(start, len(ivs) - STABLE_INTERVALS + 1):
        window = ivs[i : i + STABLE_INTERVALS]
        if all(iv.p99_s is None or iv.p99_s <= slo_s for iv in window):
            return i
    return None


def pick_oracle(
    configs: Sequence[BatchingConfig], results: Sequence[SimResult], slo_s: float
) -> int:
    """Index of the most goodput among configs whose run p99 meets the SLO (any, if none do)."""
    meeting = [i for i, r in enumerate(results) if r.p99_s is not None and r.p99_s <= slo_s]
    pool = meeting or list(range(len(results)))
    return max(pool, key=lambda i: results[i].goodput)


def run_simulated(curve: StepCurve, setup: Setup, seed: int, workers: int) -> list[ScenarioResult]:
    slo = Slo(p99_latency_s=setup.slo_s)
    configs = grid()
    # The static default is a grid point: its run is the grid's.
    default = configs.index(BatchingConfig())
    jobs: list[tuple[Scenario, SimOptions, StepCurve, int]] = []
    plan = [(s, m) for m in MODES for s in scenarios(setup, m)]
    for scenario, mode in plan:
        base = SimOptions(mode=mode, config=BatchingConfig(), goal=Goal(slo), cadence=CADENCE)
        jobs.append((scenario, base, curve, seed))  # the tuner's, the longest: first
        jobs += [(scenario, static(base, c), curve, seed) for c in configs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(_run, jobs, chunksize=1))
    out: list[ScenarioResult] = []
    per = len(configs) + 1
    for k, (scenario, mode) in enumerate(plan):
        tuner, *static_runs = results[k * per : (k + 1) * per]
        best = pick_oracle(configs, static_runs, setup.slo_s)
        out.append(
            ScenarioResult(
                scenario, mode, configs[best], static_runs[best], static_runs[default], tuner,
                setup.slo_s,
            )
        )
    return out


def plot(results: list[ScenarioResult], mode: Mode, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if r.mode == mode]
    fig, axes = plt.subplots(3, len(rows), figsize=(4 * len(rows), 8), sharex=True)
    for col, r in enumerate(rows):
        minutes = np.array([iv.end_s for iv in r.tuner.intervals]) / 60
        for label, result, style in (
            ("tuner", r.tuner, "-"),
            ("default", r.default, ":"),
            ("oracle", r.oracle, "--"),
        ):
            p99 = [np.nan if iv.p99_s is None else iv.p99_s for iv in result.intervals]
            axes[0, col].plot(minutes[: len(p99)], p99[: len(minutes)], style, label=label)
        axes[0, col].axhline(r.slo_s, color="red", linewidth=0.8)
        axes[0, col].set_yscale("log")
        axes[0, col].set_title(r.scenario.name)
        cfgs = [iv.config for iv in r.tuner.intervals if iv.config is not None]
        axes[1, col].step(minutes[: len(cfgs)], [c.max_batch_size for c in cfgs], where="post")
        axes[2, col].step(minutes[: len(cfgs)], [c.batch_timeout_ms for c in cfgs], where="post")
        axes[2, col].set_xlabel("minutes")
    axes[0, 0].set_ylabel("interval p99 (s)")
    axes[1, 0].set_ylabel("tuner max_batch_size")
    axes[2, 0].set_ylabel("tuner timeout (ms)")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{mode} mode: p99 per 30 s interval (red: SLO) and the tuner's knobs")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def markdown(
    curve: StepCurve, setup: Setup, rows: list[dict[str, Any]], real: dict[str, Any] | None
) -> str:
    lines = [
        "## Tuning (bench/tuner.py)",
        "",
        f"Simulated: one hour per scenario, interval {CADENCE.interval_s:g} s, "
        f"window {CADENCE.window_s:g} s, p99 SLO {setup.slo_s:g} s, step-time curve "
        f"{curve.source}; each scenario peaks at "
        f"{PEAK:g}x what the default config serves "
        f"({setup.default_capacity_rps['continuous']:.1f} req/s continuous, "
        f"{setup.default_capacity_rps['dynamic']:.1f} req/s dynamic). "
        "Oracle: best static `batch/timeout_ms` of a "
        f"{len(GRID_BATCHES)}x{len(GRID_TIMEOUTS_MS)} grid (most goodput with the run's p99 "
        "within the SLO). Goodput: requests/s finished within the SLO. `within_slo`: share of "
        "the tuner's intervals meeting the SLO after it first converged (3 intervals in a row "
        f"within SLO), not counting the {RECONVERGE_GRACE}-interval allowance after the load "
        "step. Targets: ratio >= 0.95, within_slo >= 0.99, re-convergence <= 5 intervals.",
        "",
        "| scenario | mode | oracle | goodput oracle | default/oracle | tuner/oracle "
        "| p99 default | p99 tuner | within SLO | re-converge | changes |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['scenario']} | {r['mode']} | {r['oracle']} | {r['goodput_oracle']} | "
            f"{r['ratio_default']} | {r['ratio_tuner']} | {r['p99_default_s']} | "
            f"{r['p99_tuner_s']} | {r['within_slo']} | {r['reconverge_intervals'] or '-'} | "
            f"{r['changes']} |"
        )
    lines += [
        "",
        "![continuous](tuner_continuous.png)",
        "![dynamic](tuner_dynamic.png)",
        "",
    ]
    if real is not None:
        lines += [
            f"Real servers (tiny model, continuous mode, {REAL_SLO_S:g} s p99 SLO, both started "
            "at the default config, the same load against each, a 3x step a third of the way "
            f"in; the tuner decides every {REAL_INTERVAL_S:g} s from scrape signals): "
            f"goodput tuned/default {real['summary']['goodput_ratio_tuned_over_default']}.",
            "",
            "| server | config at end | goodput req/s | p99 s | ok | errors |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("default", "tuned"):
            side = real[name]
            lines.append(
                f"| {name} | {side['config']} | {side['goodput_rps']} | {side['p99_s']} | "
                f"{side['ok']} | {side['errors']} |"
            )
        changes = [d for d in real["decisions"] if not d.startswith("hold")]
        lines += ["", f"The tuned server's changes ({len(changes)} of {len(real['decisions'])} "
                  "decisions):", ""]
        lines += [f"- {d}" for d in changes] or ["- none"]
        lines.append("")
    return "\n".join(lines)


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["ratio_tuner"] for r in rows]
    shares = [r["within_slo"] for r in rows if r["within_slo"] is not None]
    recon = [r["reconverge_intervals"] for r in rows if r["scenario"] == "step"]
    return {
        "min_goodput_ratio": min(ratios),
        "min_within_slo": min(shares) if shares else None,
        "max_reconverge_intervals": None if None in recon else max(recon),
        "targets_met": bool(
            min(ratios) >= TARGETS["goodput_ratio"]
            and shares
            and min(shares) >= TARGETS["within_slo"]
            and None not in recon
            and max(recon) <= TARGETS["reconverge_intervals"]
        ),
    }


# -- the real-server run -------------------------------------------------------------------

REAL_SLO_S = 1.0
REAL_INTERVAL_S, REAL_WINDOW_S = 10.0, 20.0
REAL_TOKEN = "bench-tuner-token"
REAL_READY_TIMEOUT_S = 90.0  # the tiny model is built in seconds; the machine may be busy


def real_rate(seconds: float) -> Callable[[float], float]:
    """Moderate load for the first third, then three times as much."""
    return lambda t: 5.0 if t < seconds / 3 else 15.0


def start_real_server(name: str, workdir: Path, token_file: Path) -> ServerProcess:
    port = free_port()
    log_path = workdir / f"{name}.log"
    default = BatchingConfig()
    command = [
        sys.executable, "-m", "batchpilot_server.cli", "serve",
        "--model", "tiny", "--mode", "continuous", "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port), "--threads", "1",
        "--max-batch-size", str(default.max_batch_size),
        "--batch-timeout-ms", str(default.batch_timeout_ms),
        "--max-queue-size", str(default.max_queue_size),
        "--admin-token-file", str(token_file),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    return ServerProcess(name, port, process, log_path)


def side(report: LoadReport, config: BatchingConfig, seconds: float) -> dict[str, Any]:
    good = sum(1 for r in report.results if r.ok and r.latency_s <= REAL_SLO_S)
    errors = sum(report.errors_by_status.values())
    return {
        "config": f"{config.max_batch_size}/{config.batch_timeout_ms:g}",
        "goodput_rps": round(good / seconds, 2),
        "p99_s": report.latency_s["p99"],
        "ok": report.ok,
        "errors": errors,
    }


async def _real(seconds: float, workdir: Path) -> dict[str, Any]:
    token_file = workdir / "token"
    token_file.write_text(REAL_TOKEN + "\n")
    servers = [start_real_server(n, workdir, token_file) for n in ("default", "tuned")]
    try:
        async with aiohttp.ClientSession() as session:
            for server in servers:
                await wait_ready(server, session, REAL_READY_TIMEOUT_S)
            load = [
                LoadSpec(
                    urls=[server.url], rate_schedule=real_rate(seconds), duration_s=seconds,
                    prompt_len=LengthDist("uniform", 8, 32),
                    output_len=LengthDist("uniform", 16, 112), seed=11,
                )
                for server in servers
            ]
            stop = asyncio.Event()
            options = TuneOptions(
                servers=(servers[1].url,), goal=Goal(Slo(REAL_SLO_S)),
                cadence=Cadence(REAL_INTERVAL_S, REAL_WINDOW_S), token=REAL_TOKEN,
                min_requests=30,
            )
            tuning = asyncio.create_task(tune_loop(options, None, stop))
            reports = await asyncio.gather(*(run_load(spec) for spec in load))
            stop.set()
            steps = await tuning
            configs = [await get_batching(session, server.url) for server in servers]
    finally:
        for server in servers:
            stop_process(server.process)
    default, tuned = (side(r, c, seconds) for r, c in zip(reports, configs, strict=True))
    ratio = tuned["goodput_rps"] / default["goodput_rps"] if default["goodput_rps"] else None
    return {
        "default": default,
        "tuned": tuned,
        "decisions": [f"{s.decision.action}: {s.decision.reason}" for s in steps],
        "summary": {
            "goodput_ratio_tuned_over_default": None if ratio is None else round(ratio, 3),
            "p99_default_s": default["p99_s"],
            "p99_tuned_s": tuned["p99_s"],
            "tuned_config": tuned["config"],
        },
    }


def run_real(seconds: float) -> dict[str, Any]:
    """Two real servers at the default config, the same load on each, one tuned live."""
    with tempfile.TemporaryDirectory(prefix="bench-tuner-") as workdir:
        return asyncio.run(_real(seconds, Path(workdir)))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/tuner.py", description=__doc__.split("\n")[0])
    ap.add_argument("--skip-real", action="store_true", help="only the simulated part")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--real-seconds", type=float, default=150.0)
    args = ap.parse_args(argv)
    started = time.monotonic()
    curve = StepCurve.load()
    setup = Setup.from_curve(curve)
    results = run_simulated(curve, setup, args.seed, args.workers)
    rows = [r.row() for r in results]
    for row in rows:
        print(json.dumps(row), file=sys.stderr)
    DOCS.mkdir(exist_ok=True)
    for mode in MODES:
        plot(results, mode, DOCS / f"tuner_{mode}.png")
    real = None
    if not args.skip_real:
        real = run_real(args.real_seconds)
    replace_section(BENCHMARKS_MD, "tuner", markdown(curve, setup, rows, real))
    summary = {
        "bench": "tuner",
        "slo_s": setup.slo_s,
        "curve": curve.source,
        **verdict(rows),
        "scenarios": {f"{r['scenario']}/{r['mode']}": r["ratio_tuner"] for r in rows},
        "real": None if real is None else real["summary"],
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

