"""SLO classes on shared pods against a pool per class, on real local servers (issue 44).

bench/slo_classes.py's question (simulated there) asked of real `batchpilot serve`
processes of the `tiny` preset, in a quick form for a 2-core machine. Two classes of
traffic to one model:
- interactive: chat lengths (prompts and answers of 16..48 tokens), a TTFT target of 1 s
  and a TPOT target of `TPOT_MULTIPLE` x the p90 inter-token gap measured at the
  initial batch, high priority;
- batch: long prompts (`BATCH_PROMPT`, within the model's 1024-token context), short
  answers, an end-to-end target of `BATCH_E2E_S`, low priority.
Played two ways, each pool a fleet of 1..MAX_REPLICAS servers (tools/demo/fleet.py's
`ProcessFleet`, one server at the start) tuned by batchpilot's tuning loop
(`tune_local.tune_loop`: knobs and replicas):
- shared: one fleet whose policy (given to the servers and to the loop) states both
  classes, its top-level targets the interactive class's; two Poisson loads at once, each
  naming its class (the `x-gateway-inference-objective` header, LoadSpec.objective);
- separate: a fleet per class, each with its class's targets alone and its own loop,
  each receiving its class's load with no header (the pool's default class).
The shared run goes first, then each separate pool, one after the other: each run has the
machine to itself (separate pools are separate pods). The loads are sized from one
server's measured capacity (closed loop at the initial batch, one per class's lengths),
so that the bench fits any CPU.

Reported per class and pool: judged windows meeting the class's attainment (windows of
the tuning window's length, by the requests' end, after the first; a window is judged
when at least `MIN_JUDGED` of the class's requests ended in it; a request is good when it
answered and met every target of its class, as the load generator saw it), goodput
(good requests per second of load), and per pool the replica-seconds (server processes
alive: starting, serving or draining, sampled every second), with the ratio separate /
shared (the simulated bench's target: >= 1.3). Writes the `slo-classes-real` section of
docs/benchmarks.md (unless --no-write); prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import tuner
from batchpilot_operator.actuators import put_batching, write_config_file
from batchpilot_operator.policy.types import Bounds, Cadence, Goal, ReplicaBounds
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_operator.tune_local import TuneOptions, tune_loop
from batchpilot_operator.tuning_loop import TuneStep
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.demo.fleet import ProcessFleet
from batchpilot_tools.demo.options import ADMIN_TOKEN
from batchpilot_tools.loadgen import LengthDist, LoadSpec, run_load
from numpy import percentile
from planners_real import (
    CADENCES,
    READY_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    Tally,
    count_replicas,
    moves,
)
from sections import replace_section
from slo_classes import BATCH, INTERACTIVE, ClassPair

SECTION = "slo-classes-real"
MODEL = "tiny"
MAX_REPLICAS = 3
BOUNDS = ReplicaBounds(1, MAX_REPLICAS)
INITIAL = BatchingConfig()
CHAT_PROMPT = LengthDist("uniform", 16, 48)
CHAT_OUTPUT = LengthDist("uniform", 16, 48)
BATCH_PROMPT = LengthDist("uniform", 384, 768)
BATCH_OUTPUT = LengthDist("uniform", 16, 64)
INTERACTIVE_TTFT_S = 1.0
TPOT_MULTIPLE = 2.0
BATCH_E2E_S = 30.0
ATTAINMENT = 0.9
# Each class's load: this share of what one server carries of that class alone (closed
# loop at the initial batch): together a little under one server's work.
INTERACTIVE_SHARE = 0.5
BATCH_SHARE = 0.3
CADENCE = CADENCES[MODEL]  # planners_real.py's tiny rounds: 5-s rounds, 15-s windows
QUICK_CADENCE = Cadence(5.0, 10.0)
MIN_REQUESTS = 10  # per tuning window, over the pool's classes
MIN_JUDGED = 5  # a class's requests in a window for it to be judged
SECONDS = 90.0
QUICK_SECONDS = 30.0
CALIBRATION_S = 8.0
QUICK_CALIBRATION_S = 4.0
RATIO_TARGET = 1.3
SEED = 11
FIGURES = ("windows_met", "windows_judged", "goodput")  # per class, in the last line


@dataclass(frozen=True)
class Calibration:
    chat_rps: float
    batch_rps: float
    chat_tpot_p90_s: float

    def classes(self) -> ClassPair:
        tpot = round(TPOT_MULTIPLE * self.chat_tpot_p90_s, 4)
        return ClassPair(
            SloClass(INTERACTIVE, 10, INTERACTIVE_TTFT_S, tpot, None, ATTAINMENT),
            SloClass(BATCH, 0, e2e_s=BATCH_E2E_S, attainment=ATTAINMENT),
        )

    def rates(self) -> dict[str, float]:
        return {
            INTERACTIVE: round(INTERACTIVE_SHARE * self.chat_rps, 2),
            BATCH: round(BATCH_SHARE * self.batch_rps, 2),
        }


LENGTHS = {INTERACTIVE: (CHAT_PROMPT, CHAT_OUTPUT), BATCH: (BATCH_PROMPT, BATCH_OUTPUT)}


async def calibrate(url: str, seconds: float) -> Calibration:
    """One server alone, closed loop at the initial batch, each class's lengths."""
    reports = {}
    for name, (prompt, output) in LENGTHS.items():
        reports[name] = await run_load(LoadSpec(
            urls=[url], arrival="concurrency", concurrency=INITIAL.max_batch_size,
            duration_s=seconds, prompt_len=prompt, output_len=output,
            timeout_s=REQUEST_TIMEOUT_S, seed=SEED,
        ))  # fmt: skip
    # a request's TPOT as its targets judge it: its mean gap between tokens
    tpots = [r.tpot_s for r in reports[INTERACTIVE].results if r.ok and r.tpot_s is not None]
    tpot = float(percentile(tpots, 90)) if tpots else 0.05
    return Calibration(reports[INTERACTIVE].requests_per_s, reports[BATCH].requests_per_s, tpot)


async def push(fleet: ProcessFleet, config: BatchingConfig) -> None:
    """`config` (its SLO with it) to the fleet's servers and its record, which servers
    started later read: the classes are known before the first request names one."""
    write_config_file(fleet.config_file, config)
    async with aiohttp.ClientSession() as session:
        for url in fleet.serving():
            await put_batching(session, url, ADMIN_TOKEN, config, url)


@dataclass
class Stream:
    """One class's load on one pool."""

    name: str  # the class
    rate: float
    objective: str | None  # the header it sends, None: the pool's default class
    tally: Tally

    def spec(self, fleet: ProcessFleet, seconds: float) -> LoadSpec:
        # a class's arrivals and lengths are the same in the shared pool and in its own
        seed = SEED + list(LENGTHS).index(self.name)
        prompt, output = LENGTHS[self.name]
        return LoadSpec(
            urls=fleet.serving(), arrival="poisson", rate=self.rate, duration_s=seconds,
            prompt_len=prompt, output_len=output, timeout_s=REQUEST_TIMEOUT_S, seed=seed,
            objective=self.objective,
        )  # fmt: skip


@dataclass
class Pool:
    name: str
    fleet: ProcessFleet
    slo: Slo
    streams: list[Stream]
    counted: Tally = field(init=False)  # its processes alive (the Tally's replica count)
    steps: list[TuneStep] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counted = Tally(self.slo)


def tune_options(pool: Pool, cadence: Cadence) -> TuneOptions:
    return TuneOptions(
        servers=tuple(pool.fleet.serving()),
        goal=Goal(pool.slo, Bounds(), replicas=BOUNDS),
        cadence=cadence,
        token=ADMIN_TOKEN,
        min_requests=MIN_REQUESTS,
        config_file=pool.fleet.config_file,
    )


async def run_pool(pool: Pool, seconds: float, cadence: Cadence) -> None:
    """The pool's loads at once (one per class it serves), the pool tuned by its loop."""
    stop = asyncio.Event()
    tuning = asyncio.create_task(tune_loop(tune_options(pool, cadence), stop=stop,
                                           scaler=pool.fleet))  # fmt: skip
    counting = asyncio.create_task(count_replicas(pool.fleet, pool.counted, stop))
    try:
        await asyncio.gather(*(
            run_load(s.spec(pool.fleet, seconds), s.tally.results.append,
                     targets=pool.fleet.load)
            for s in pool.streams
        ))  # fmt: skip
    finally:
        stop.set()
        pool.steps = await tuning
        await counting


def windows(tally: Tally, seconds: float, window_s: float) -> list[float]:
    """Each judged window's attainment: windows of `window_s` by the requests' end,
    after the first (the start on one server), up to the load's end; judged with at
    least MIN_JUDGED requests in it."""
    out = []
    for k in range(1, math.floor(seconds / window_s)):
        lo, hi = k * window_s, (k + 1) * window_s
        ended = [r for r in tally.results if lo <= r.end_s < hi]
        if len(ended) >= MIN_JUDGED:
            out.append(sum(tally.good(r) for r in ended) / len(ended))
    return out


def class_figures(tally: Tally, seconds: float, window_s: float) -> dict[str, Any]:
    judged = windows(tally, seconds, window_s)
    good = sum(tally.good(r) for r in tally.results)
    failed = sum(not r.ok for r in tally.results)
    return {
        "sent": len(tally.results),
        "failed": failed,
        "windows_met": sum(a >= tally.slo.attainment for a in judged),
        "windows_judged": len(judged),
        "attainment": round(good / len(tally.results), 3) if tally.results else None,
        "goodput": round(good / seconds, 3),
    }


def pool_figures(pool: Pool, seconds: float, window_s: float) -> dict[str, Any]:
    return {
        "classes": {s.name: class_figures(s.tally, seconds, window_s) for s in pool.streams},
        "replica_seconds": round(pool.counted.replica_seconds),
        "peak_replicas": pool.counted.peak,
        "moves": moves(pool.steps),
        "scale_reasons": [
            f"round {step.index}: {step.scale.reason}"
            for step in pool.steps
            if step.scale is not None and step.scale.action != "hold"
        ],
    }


async def bench(seconds: float, calibration_s: float, cadence: Cadence, workdir: Path) -> dict:
    source = MODEL
    out: dict[str, Any] = {}
    (workdir / "shared").mkdir()
    async with ProcessFleet(source, workdir / "shared", READY_TIMEOUT_S) as fleet:
        began = time.monotonic()
        await fleet.start(1)
        startup_s = time.monotonic() - began
        cal = await calibrate(fleet.serving()[0], calibration_s)
        classes, rates = cal.classes(), cal.rates()
        slo = classes.shared_slo()
        await push(fleet, replace(INITIAL, slo=slo.targets()))
        shared = Pool("shared", fleet, slo, [
            Stream(name, rates[name], name, Tally(classes.pool_slo(name)))
            for name in (INTERACTIVE, BATCH)
        ])  # fmt: skip
        await run_pool(shared, seconds, cadence)
    out["shared"] = pool_figures(shared, seconds, cadence.window_s)
    # a pool per class, one after the other: each has the machine to itself
    for name in (INTERACTIVE, BATCH):
        (workdir / name).mkdir()
        async with ProcessFleet(source, workdir / name, READY_TIMEOUT_S) as fleet:
            await fleet.start(1)
            slo = classes.pool_slo(name)
            await push(fleet, replace(INITIAL, slo=slo.targets()))
            pool = Pool(name, fleet, slo, [Stream(name, rates[name], None, Tally(slo))])
            await run_pool(pool, seconds, cadence)
        out[f"separate/{name}"] = pool_figures(pool, seconds, cadence.window_s)
    separate_s = sum(out[f"separate/{n}"]["replica_seconds"] for n in (INTERACTIVE, BATCH))
    shared_s = out["shared"]["replica_seconds"]
    return {
        "startup_s": round(startup_s, 1),
        "capacity_rps": {INTERACTIVE: round(cal.chat_rps, 2), BATCH: round(cal.batch_rps, 2)},
        "rates_rps": rates,
        "targets": {
            INTERACTIVE: {"ttft_s": INTERACTIVE_TTFT_S, "tpot_s": classes.interactive.tpot_s},
            BATCH: {"e2e_s": BATCH_E2E_S},
        },
        "pools": out,
        "replica_seconds_shared": shared_s,
        "replica_seconds_separate": separate_s,
        "replica_seconds_ratio": round(separate_s / shared_s, 3) if shared_s else None,
    }


# -- the text ---------------------------------------------------------------------------


def markdown(r: dict[str, Any], seconds: float, cadence: Cadence, calibration_s: float) -> str:
    t = r["targets"]
    lines = [
        "## SLO classes on real servers (bench/slo_classes_real.py)",
        "",
        "bench/slo_classes.py's question on real local `batchpilot serve` processes of the "
        "`tiny` preset (continuous mode, one torch thread each, 2 cores shared with other "
        "work), in a quick form. One run. **interactive**: prompts and answers of 16..48 "
        f"tokens, TTFT {t[INTERACTIVE]['ttft_s'] * 1000:g} ms and TPOT "
        f"{t[INTERACTIVE]['tpot_s'] * 1000:.1f} ms ({TPOT_MULTIPLE:g}x the p90 inter-token "
        "gap measured at the initial batch: p90 over requests of each one's mean gap), "
        "priority 10; **batch**: prompts of "
        f"{BATCH_PROMPT.a:g}..{BATCH_PROMPT.b:g} tokens, answers of {BATCH_OUTPUT.a:g}.."
        f"{BATCH_OUTPUT.b:g}, e2e {t[BATCH]['e2e_s']:g} s, priority 0; attainment "
        f"{ATTAINMENT:g} each. Loads: Poisson, {INTERACTIVE_SHARE:g}x and {BATCH_SHARE:g}x "
        "one server's measured capacity for the class's lengths alone (closed loop at the "
        f"initial batch, {calibration_s:g} s each): {r['rates_rps'][INTERACTIVE]} and "
        f"{r['rates_rps'][BATCH]} req/s (capacity {r['capacity_rps'][INTERACTIVE]} and "
        f"{r['capacity_rps'][BATCH]}), {seconds:g} s. Each pool 1..{MAX_REPLICAS} servers "
        "from one, tuned by the tuning loop (`tune_local.tune_loop`, knobs and replicas, "
        f"{cadence.interval_s:g}-s rounds over {cadence.window_s:g}-s windows). **shared**: "
        "one fleet whose policy states both classes (top-level targets the interactive "
        "class's), each load naming its class with the `x-gateway-inference-objective` "
        "header; **separate**: a fleet per class with its class's targets alone, its load "
        "with no header. The shared run first, then each separate pool, one after the "
        "other: each run has the machine to itself. Windows: "
        f"{cadence.window_s:g} s by the requests' end, after the first, judged with >= "
        f"{MIN_JUDGED} of the class's requests; a request is good when it answered and met "
        "every target of its class, as the load generator saw it. Replica-seconds: server "
        "processes alive (starting, serving, draining), sampled every second over the load.",
        "",
        "| pool | class | rate req/s | sent | failed | windows met / judged | attainment "
        "| goodput req/s | pool replica-s | peak replicas |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for pool_name, p in r["pools"].items():
        for cls, f in p["classes"].items():
            lines.append(
                f"| {pool_name} | {cls} | {r['rates_rps'][cls]} | {f['sent']} | {f['failed']} "
                f"| {f['windows_met']} / {f['windows_judged']} | {f['attainment']} "
                f"| {f['goodput']} | {p['replica_seconds']} | {p['peak_replicas']} |"
            )
    ratio = r["replica_seconds_ratio"]
    lines += [
        "",
        f"Replica-seconds separate / shared: {r['replica_seconds_separate']} / "
        f"{r['replica_seconds_shared']} = **{ratio}** (the simulated bench's target: >= "
        f"{RATIO_TARGET:g}).",
        "",
    ]
    lines += [f"- {line}" for line in findings(r, seconds)]
    for pool_name, p in r["pools"].items():
        lines.append(f"- {pool_name}: the loop moved at " + ("; ".join(p["moves"]) or "no round")
                     + ".")  # fmt: skip
    return "\n".join(lines) + "\n"


def findings(r: dict[str, Any], seconds: float) -> list[str]:
    """What the run shows, read off its numbers."""
    pools, ratio = r["pools"], r["replica_seconds_ratio"]
    out = []
    for cls in (INTERACTIVE, BATCH):
        shared, alone = pools["shared"]["classes"][cls], pools[f"separate/{cls}"]["classes"][cls]
        out.append(
            f"{cls}: shared {shared['windows_met']} / {shared['windows_judged']} windows met, "
            f"goodput {shared['goodput']}; its own pool {alone['windows_met']} / "
            f"{alone['windows_judged']}, goodput {alone['goodput']}."
        )
    reached = ratio is not None and ratio >= RATIO_TARGET
    above_shared = r["replica_seconds_shared"] - seconds
    above_separate = r["replica_seconds_separate"] - 2 * seconds
    out.append(
        f"The ratio {ratio} {'reaches' if reached else 'does not reach'} {RATIO_TARGET:g}. "
        "Both loads together are under one server's measured work, and a pool never goes "
        f"below one server: the two separate pools hold at least {2 * seconds:g} "
        f"replica-seconds between them, the shared one {seconds:g}. Above those floors the "
        f"shared pool spent {above_shared:g} replica-seconds, the separate pools "
        f"{above_separate:g} together."
        + (
            " Here sharing cost replica-seconds rather than saving them."
            if ratio and ratio < 1
            else ""
        )
    )
    out.append(
        "Caveats: the interactive TPOT target comes from the calibration on this machine, "
        "which other work shares, so it moves from run to run, and with it how hard the "
        "shared pool is pressed; each server runs one torch thread on 2 cores, so a third "
        "server (and the load generator) share the cores rather than adding compute; one "
        f"run of {seconds:g} s judges few windows a class."
    )
    peak = pools["shared"]["peak_replicas"]
    alone = [pools[f"separate/{c}"]["peak_replicas"] for c in (INTERACTIVE, BATCH)]
    if peak > 1:
        reasons = "; ".join(pools["shared"]["scale_reasons"]) or "none recorded"
        out.append(
            f"The shared pool went to {peak} servers while its classes, each alone in its "
            f"own pool, peaked at {alone[0]} and {alone[1]}; the loop's reasons for its "
            f"replica moves: {reasons}."
        )
    return out


def write_section(path: Path, text: str) -> None:
    """The section, placed right after the simulated bench's the first time."""
    after = "<!-- slo-classes:end -->"
    current = path.read_text()
    if f"<!-- {SECTION}:start -->" not in current and after in current:
        empty = f"<!-- {SECTION}:start -->\n<!-- {SECTION}:end -->"
        path.write_text(current.replace(after, f"{after}\n\n{empty}", 1))
    replace_section(path, SECTION, text)


def run(seconds: float, calibration_s: float, cadence: Cadence) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-slo-classes-real-") as workdir:
        return asyncio.run(bench(seconds, calibration_s, cadence, Path(workdir)))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/slo_classes_real.py",
                                 description=__doc__.split("\n")[0])  # fmt: skip
    ap.add_argument("--seconds", type=float, help=f"load per run (default {SECONDS:g})")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK_SECONDS:g}-s loads, 10-s windows (a smoke test)")  # fmt: skip
    ap.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    started = time.monotonic()
    seconds = args.seconds or (QUICK_SECONDS if args.quick else SECONDS)
    cadence = QUICK_CADENCE if args.quick else CADENCE
    calibration_s = QUICK_CALIBRATION_S if args.quick else CALIBRATION_S
    result = run(seconds, calibration_s, cadence)
    print(json.dumps(result), file=sys.stderr)
    if not args.no_write:
        write_section(tuner.BENCHMARKS_MD, markdown(result, seconds, cadence, calibration_s))
    summary = {
        "bench": "slo_classes_real",
        "seconds_per_run": seconds,
        "window_s": cadence.window_s,
        "rates_rps": result["rates_rps"],
        "classes": {
            f"{pool.split('/')[0]}/{cls}": {k: f[k] for k in FIGURES}
            for pool, p in result["pools"].items() for cls, f in p["classes"].items()
        },
        "replica_seconds_shared": result["replica_seconds_shared"],
        "replica_seconds_separate": result["replica_seconds_separate"],
        "replica_seconds_ratio": result["replica_seconds_ratio"],
        "seconds": round(time.monotonic() - started, 1),
    }  # fmt: skip
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
