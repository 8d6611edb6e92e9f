"""Speculative decoding's k under a load ramp: fixed k = 0, fixed k = 4 and the tuned k.

Simulated (tools/simulator.py: the real continuous scheduler under the measured step
curve; a verify row's newest token and draft are timed as prompt tokens, and each draft
token is accepted with the workload's chance until the first rejection). One pod, batch
32, the load climbing from near idle to past saturation in steps of `level_s` each; the
tuning loop moves k alone (bounds 0..4, every other knob's bounds pinned to the config),
from k = 4 (the pods measure acceptance only while they speculate; the rule remembers
the last one measured). Two workloads: copy-heavy answers (acceptance 0.7) and
free-form chat (0.2). Per level: goodput (requests per second finished within the SLO,
by the interval they finished in) of each arm, and the k the tuned arm ran.

The bar (issue 43): at every level the tuned k's goodput is at least the better fixed
k's (`TOLERANCE` below it counts as equal: a level's first interval runs the k chosen
for the level before), and at some level at least 1.2x the worse one's.

Usage: bench/spec_ramp.py [--quick] (quick: shorter levels, nothing written to docs/).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from batchpilot_operator.policy.types import Bounds, Cadence, Goal
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import (
    Scenario,
    SimOptions,
    SimResult,
    StepCurve,
    Workload,
    make_workload,
    simulate_workload,
)
from sections import replace_section

BENCHMARKS_MD = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
SECTION = "spec-ramp"
RATES = (0.5, 2.0, 5.0, 10.0, 20.0, 30.0, 40.0)  # req/s per level: idle to saturation
LEVEL_S = 300.0
QUICK_LEVEL_S = 150.0
CADENCE = Cadence(interval_s=30.0, window_s=60.0)
ACCEPTANCE = {"copy-heavy": 0.7, "free-form": 0.2}
PROMPT_TOKENS = (16, 128)
OUTPUT_TOKENS = 64
SLO = Slo(ttft_s=1.0, tpot_s=0.003)
BATCH = 32
K_MAX = 4
TOLERANCE = 0.02  # of the better arm's goodput: a level's first interval is a transition
GAIN = 1.2  # the tuned arm over the worse fixed one, at some level


@dataclass(frozen=True)
class Level:
    rate: float
    goodput: dict[str, float]  # arm -> requests/s within the SLO
    tuned_k: list[int]  # the k in force in each of the level's intervals (tuned arm)
    why: list[str]  # the tuned arm's decisions in the level, each by its reason's head

    def holds(self) -> bool:
        better = max(self.goodput["k=0"], self.goodput["k=4"])
        return self.goodput["tuned"] >= better * (1 - TOLERANCE)

    def gain(self) -> float | None:
        """The tuned arm over the worse fixed arm (None where that one served nothing)."""
        worse = min(self.goodput["k=0"], self.goodput["k=4"])
        return self.goodput["tuned"] / worse if worse > 0 else None


def ramp(acceptance: float, level_s: float, seed: int) -> Workload:
    """Steady Poisson levels back to back, each `level_s` long."""
    parts = [
        make_workload(
            Scenario("steady", level_s, rate, output_tokens=OUTPUT_TOKENS,
                     prompt_tokens=PROMPT_TOKENS, acceptance=acceptance),
            seed + i,
        )
        for i, rate in enumerate(RATES)
    ]  # fmt: skip
    return Workload(
        arrivals=np.concatenate([p.arrivals + i * level_s for i, p in enumerate(parts)]),
        prompts=np.concatenate([p.prompts for p in parts]),
        outputs=np.concatenate([p.outputs for p in parts]),
        acceptance=acceptance,
    )


def options(k: int, tune: bool) -> SimOptions:
    config = BatchingConfig(max_batch_size=BATCH, batch_timeout_ms=0.0, num_speculative_tokens=k)
    bounds = Bounds(
        min_batch=BATCH, max_batch=BATCH, min_timeout_ms=0.0, max_timeout_ms=0.0,
        min_prefill_budget=config.prefill_token_budget,
        max_prefill_budget=config.prefill_token_budget,
        min_speculative_tokens=0, max_speculative_tokens=K_MAX if tune else k,
    )  # fmt: skip
    return SimOptions(
        mode="continuous", config=config, goal=Goal(SLO, bounds), cadence=CADENCE, tune=tune
    )


def levels(results: dict[str, SimResult], level_s: float) -> list[Level]:
    """Each level's goodput per arm, from the intervals that ended within it."""
    per_level = round(level_s / CADENCE.interval_s)
    out = []
    for i, rate in enumerate(RATES):
        span = slice(i * per_level, (i + 1) * per_level)
        goodput = {
            arm: sum(iv.good for iv in r.intervals[span]) / level_s for arm, r in results.items()
        }
        ks = [
            iv.config.num_speculative_tokens if iv.config is not None else -1
            for iv in results["tuned"].intervals[span]
        ]
        heads = [
            _head(iv.decision.reason)
            for iv in results["tuned"].intervals[span]
            if iv.decision is not None
        ]
        out.append(Level(rate, goodput, ks, list(dict.fromkeys(heads))))
    return out


def _head(reason: str) -> str:
    """Which way a round decided and why not by the fit: `fallback (the step fit not
    trusted yet)`, `predicted`, `hold`."""
    head = reason.split(":")[0]
    if head.startswith("predicted"):
        return "predicted"  # the fit's description differs every round
    return head + ")" if head.count("(") > head.count(")") else head


def run(acceptance: float, level_s: float, seed: int, curve: StepCurve) -> list[Level]:
    work = ramp(acceptance, level_s, seed)
    run_s = level_s * len(RATES)
    arms = {"k=0": options(0, False), "k=4": options(K_MAX, False), "tuned": options(K_MAX, True)}
    results = {arm: simulate_workload(work, o, curve, run_s) for arm, o in arms.items()}
    return levels(results, level_s)


def verdict(table: dict[str, list[Level]]) -> dict[str, bool]:
    every = all(level.holds() for rows in table.values() for level in rows)
    gains = [g for rows in table.values() for level in rows if (g := level.gain()) is not None]
    return {"tuned_at_least_better": every, "tuned_gain_met": max(gains, default=0.0) >= GAIN}


def markdown(table: dict[str, list[Level]], level_s: float, seed: int, curve: StepCurve) -> str:
    lines = [
        "## Speculative decoding's k under a load ramp (bench/spec_ramp.py)",
        "",
        f"Simulated (tools/simulator.py), one pod, continuous, batch {BATCH}, step curve "
        f"{curve.source}; prompts {PROMPT_TOKENS[0]}-{PROMPT_TOKENS[1]} tokens, answers "
        f"around {OUTPUT_TOKENS}; SLO TTFT {SLO.ttft_s:g} s, TPOT {SLO.tpot_s * 1000:g} ms; "
        f"levels of {level_s:g} s, seed {seed}. Each draft token is accepted with the "
        "workload's chance until the first rejection; a verify row's tokens are timed as "
        "prompt tokens. The tuned arm moves k alone (0..4, starting at 4), every "
        f"{CADENCE.interval_s:g} s. Goodput: requests/s finished within the SLO.",
        "",
        "| workload | req/s | k=0 | k=4 | tuned | tuned k by interval | holds |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, rows in table.items():
        for level in rows:
            g = level.goodput
            lines.append(
                f"| {name} | {level.rate:g} | {g['k=0']:.2f} | {g['k=4']:.2f} | "
                f"{g['tuned']:.2f} | {' '.join(map(str, level.tuned_k))} | "
                f"{'yes' if level.holds() else 'no'} |"
            )
    misses = [
        f"- {name} at {level.rate:g} req/s: {'; '.join(level.why)}"
        for name, rows in table.items()
        for level in rows
        if not level.holds()
    ]
    if misses:
        head = "Where it does not hold, the tuned arm's decisions in the level:"
        lines += ["", head, "", *misses]
    v = verdict(table)
    lines += [
        "",
        f"Bar: tuned >= the better fixed k at every level (within {TOLERANCE:.0%}): "
        f"{'holds' if v['tuned_at_least_better'] else 'does not hold'}; tuned >= {GAIN:g}x "
        f"the worse at some level: {'holds' if v['tuned_gain_met'] else 'does not hold'}.",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/spec_ramp.py", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument(
        "--quick", action="store_true",
        help=f"levels of {QUICK_LEVEL_S:g} s, nothing written to docs/",
    )  # fmt: skip
    args = ap.parse_args(argv)
    started = time.monotonic()
    curve = StepCurve.load()
    level_s = QUICK_LEVEL_S if args.quick else LEVEL_S
    table = {name: run(a, level_s, args.seed, curve) for name, a in ACCEPTANCE.items()}
    for name, rows in table.items():
        for level in rows:
            print(json.dumps({"workload": name, "rate": level.rate, **level.goodput,
                              "tuned_k": level.tuned_k}), file=sys.stderr)  # fmt: skip
    if not args.quick:
        replace_section(BENCHMARKS_MD, SECTION, markdown(table, level_s, args.seed, curve))
    summary = {
        "bench": "spec_ramp",
        "level_s": level_s,
        "seed": args.seed,
        **verdict(table),
        "best_gain": round(
            max((g for rows in table.values() for lv in rows if (g := lv.gain())), default=0.0), 3
        ),
        "wall_s": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
