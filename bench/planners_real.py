"""batchpilot against replicas-only controllers on real local servers (issue 41).

Two fleets of `batchpilot serve` processes side by side (tools/demo/fleet.py's
`ProcessFleet`: 1..MAX_REPLICAS servers, one at the start, a new one a real process start
away, a retiring one drained first), the same Poisson load with a step up (same seed)
through bench/loadgen.py's generator on each:
- fleet A: batchpilot's tuning loop (`tune_local.tune_loop`: knobs and replicas);
- fleet B: knobs fixed at the policy's initial config, its replica count decided every
  interval by a baseline of bench/planner_baselines.py from the servers' own `/metrics`
  (`real_tick`, `waiting_signals`): KEDA's rule on the waiting queue, or NVIDIA Dynamo's
  planner (its own code, in its own virtualenv) at its default `throughput` target.
Three fleets at once (up to nine servers) do not fit two cores, so each baseline runs in
its own pair against a fresh batchpilot fleet, one pair after the other.

Goodput and attainment are the load generator's: a request is good when it answered and
met every target (end to end, and TTFT/TPOT where the SLO states them), counted over the
requests sent. Replica-seconds: server processes alive (starting, serving or draining),
sampled every second over the load. Writes the `planners-real` section of
docs/benchmarks.md (unless --no-write); prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import model_refs
import tuner
from batchpilot_operator.actuators import put_batching, write_config_file
from batchpilot_operator.policy.types import (
    Bounds,
    Cadence,
    Fleet,
    Goal,
    ReplicaBounds,
    ReplicaState,
)
from batchpilot_operator.signals import Signals
from batchpilot_operator.signals_scrape import Totals, parse_metrics
from batchpilot_operator.slo import Slo
from batchpilot_operator.tune_local import TuneOptions, tune_loop
from batchpilot_operator.tuning_loop import TuneStep
from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.demo.fleet import ProcessFleet
from batchpilot_tools.demo.options import ADMIN_TOKEN
from batchpilot_tools.loadgen import LengthDist, LoadSpec, RequestResult, run_load
from planner_baselines import (
    DynamoPlanner,
    KedaRule,
    StepShape,
    dynamo_capabilities,
    dynamo_config,
    dynamo_installed,
    fpm,
    tick,
    traffic,
    workers,
)
from prometheus_client.parser import text_string_to_metric_families
from sections import replace_section

SECTION = "planners-real"
MAX_REPLICAS = 3
BOUNDS = ReplicaBounds(1, MAX_REPLICAS)
INITIAL = BatchingConfig()  # the policy's initial config: what fleet B keeps
# The demo's tiny profile (tools/demo/options.py): a 1-s end-to-end target, 5-s rounds
# over 15-s windows, answers of 16..48 tokens; SmolLM2 gets its real-model profile.
SLOS = {
    "tiny": Slo(e2e_s=1.0, attainment=0.9),
    model_refs.SMOLLM2: Slo(ttft_s=5.0, tpot_s=0.4, e2e_s=25.0, attainment=0.9),
}
CADENCES = {"tiny": Cadence(5.0, 15.0), model_refs.SMOLLM2: Cadence(15.0, 45.0)}
MIN_REQUESTS = {"tiny": 30, model_refs.SMOLLM2: 5}
PROMPT_LEN = LengthDist("uniform", 16, 48)
OUTPUT_LEN = LengthDist("uniform", 16, 48)
READY_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 60.0
CALIBRATION_S = 10.0
# The load: BASE_SHARE of one server's measured capacity (closed loop at the initial
# batch) for the first third, then STEP_SHARE of it: past one server, within three.
BASE_SHARE = 0.25
STEP_SHARE = 0.9
SAMPLE_S = 1.0
BASELINES = ("keda", "dynamo_throughput")
SEED = 7


# -- a real fleet's tick, from its servers' /metrics ----------------------------------


@dataclass(frozen=True)
class Scrape:
    """One server's `/metrics` at a moment: its totals and its gauges now."""

    totals: Totals

    @classmethod
    def of(cls, text: str) -> Scrape:
        return cls(parse_metrics(text))

    def gauge(self, name: str) -> float:
        return self.totals.gauges.get(name, 0.0)


def step_shape(delta: Totals) -> StepShape:
    """The interval's mean step (the step counters' increases over the steps'): a real
    server exports counters, not its last step, so Dynamo's FPM gets their mean."""
    steps = delta.counts.get(names.STEP_DURATION, 0.0)
    if not steps:
        return StepShape()

    def per_step(counter: str) -> int:
        return round(delta.counts.get(counter, 0.0) / steps)

    prefill_tokens = per_step(names.STEP_PREFILL_TOKENS_TOTAL)
    prompts = delta.counts.get(names.REQUEST_PROMPT_TOKENS, 0.0)
    mean_prompt = delta.sums.get(names.REQUEST_PROMPT_TOKENS, 0.0) / prompts if prompts else 0.0
    return StepShape(
        seconds=delta.sums.get(names.STEP_DURATION, 0.0) / steps,
        # prompts a step prefilled: its prompt tokens over the interval's mean prompt
        prefill_requests=math.ceil(prefill_tokens / mean_prompt) if mean_prompt else 0,
        prefill_tokens=prefill_tokens,
        decode_requests=per_step(names.STEP_DECODE_ROWS_TOTAL),
        kv_tokens=per_step(names.STEP_KV_TOKENS_TOTAL),
    )


@dataclass(frozen=True)
class FleetState:
    """What the fleet's own bookkeeping says: the count of record and its processes."""

    desired: int
    serving: int
    alive: int  # processes not exited: starting, serving or draining

    @property
    def starting(self) -> int:
        return max(0, self.desired - self.serving)

    @property
    def draining(self) -> bool:
        return self.alive > self.serving + self.starting


def real_tick(
    now_s: float,
    interval_s: float,
    before: Mapping[str, Scrape],
    now: Mapping[str, Scrape],
    state: FleetState,
) -> dict[str, Any]:
    """Dynamo's tick request for a real fleet: the serving servers' scrapes now against
    the interval's start (a server new since then counts from zero)."""
    deltas = {
        url: s.totals.minus(before[url].totals) if url in before else s.totals
        for url, s in now.items()
    }

    def total(name: str, sums: bool = False) -> float:
        return sum((d.sums if sums else d.counts).get(name, 0.0) for d in deltas.values())

    seen = total(names.REQUEST_PROMPT_TOKENS)
    # a queued prompt's tokens are not exported: the interval's mean prompt stands in
    mean_prompt = total(names.REQUEST_PROMPT_TOKENS, sums=True) / seen if seen else 0.0
    fpms = []
    for url, delta in deltas.items():
        waiting = now[url].gauge(names.REQUESTS_WAITING)
        fpms.append(fpm(url, step_shape(delta), round(waiting), round(waiting * mean_prompt)))
    return tick(
        now_s,
        traffic(
            interval_s,
            total(names.REQUESTS_ARRIVED_TOTAL),
            total(names.REQUEST_PROMPT_TOKENS, sums=True),
            total(names.REQUEST_GENERATION_TOKENS, sums=True),
            seen,
        ),
        workers(state.serving, state.desired, state.starting, state.draining),
        fpms,
    )


def waiting_signals(now: Mapping[str, Scrape], window_s: float) -> Signals:
    """KEDA's input: `vllm:num_requests_waiting` summed over the serving servers."""
    waiting = sum(s.gauge(names.REQUESTS_WAITING) for s in now.values())
    return Signals(status="ok", window_s=window_s, waiting=waiting, pods=len(now))


def kv_config(text: str) -> tuple[int, int]:
    """(blocks, block size) from a server's `vllm:cache_config_info` labels."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith(names.VLLM_CACHE_CONFIG_INFO):
                return int(sample.labels["num_gpu_blocks"]), int(sample.labels["block_size"])
    raise ValueError(f"no {names.VLLM_CACHE_CONFIG_INFO} on the server's /metrics")


# -- the fleets -------------------------------------------------------------------------


Controller = KedaRule | DynamoPlanner


async def scrape_all(session: aiohttp.ClientSession, urls: list[str]) -> dict[str, Scrape]:
    async def one(url: str) -> tuple[str, Scrape]:
        async with session.get(f"{url}/metrics") as response:
            return url, Scrape.of(await response.text())

    return dict(await asyncio.gather(*(one(url) for url in urls)))


def fleet_state(fleet: ProcessFleet) -> FleetState:
    alive = sum(s.process.poll() is None for s in fleet.started)
    return FleetState(fleet.desired, len(fleet.servers), alive)


async def baseline_loop(
    fleet: ProcessFleet, controller: Controller, cadence: Cadence, stop: asyncio.Event
) -> list[str]:
    """Fleet B's replica count, decided every interval from its scraped servers, as the
    tuning loop's replica rule does for fleet A. Returns each change, for the text."""
    changes: list[str] = []
    state, started = ReplicaState(), time.monotonic()
    async with aiohttp.ClientSession() as session:
        before = await scrape_all(session, fleet.serving())
        while not await _stopped_within(stop, cadence.interval_s):
            now_s = time.monotonic() - started
            now = await scrape_all(session, fleet.serving())
            fleet_now = fleet_state(fleet)
            if isinstance(controller, DynamoPlanner):
                request = real_tick(now_s, cadence.interval_s, before, now, fleet_now)
                controller.observe_tick(id(fleet), request)
            signals = waiting_signals(now, cadence.window_s)
            current = Fleet(fleet_now.desired, fleet_now.serving)
            decision = controller.decide(signals, current, state, now_s)
            state, before = decision.state, now
            if decision.replicas != fleet_now.desired:
                changes.append(f"{now_s:.0f} s: {decision.reason}")
                await fleet.scale(decision)
    return changes


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout=seconds)
        return True
    return False


@dataclass
class Tally:
    """One fleet's load results and the processes it kept alive."""

    slo: Slo
    results: list[RequestResult] = field(default_factory=list)
    replica_seconds: float = 0.0
    peak: int = 0

    def good(self, r: RequestResult) -> bool:
        checks = (
            (self.slo.e2e_s, r.latency_s), (self.slo.ttft_s, r.ttft_s), (self.slo.tpot_s, r.tpot_s)
        )  # fmt: skip
        return r.ok and all(
            target is None or (value is not None and value <= target) for target, value in checks
        )

    def figures(self, seconds: float) -> dict[str, Any]:
        good = sum(self.good(r) for r in self.results)
        return {
            "sent": len(self.results),
            "goodput": round(good / seconds, 3),
            "attainment": round(good / len(self.results), 3) if self.results else None,
            "replica_seconds": round(self.replica_seconds),
            "peak_replicas": self.peak,
            "goodput_per_replica_s": round(good / self.replica_seconds, 4)
            if self.replica_seconds
            else 0.0,
        }


async def count_replicas(fleet: ProcessFleet, tally: Tally, stop: asyncio.Event) -> None:
    while not await _stopped_within(stop, SAMPLE_S):
        alive = fleet_state(fleet).alive
        tally.replica_seconds += alive * SAMPLE_S
        tally.peak = max(tally.peak, alive)


@dataclass(frozen=True)
class Load:
    base_rps: float
    step_rps: float
    seconds: float

    def rate(self, t: float) -> float:
        return self.base_rps if t < self.seconds / 3 else self.step_rps

    def spec(self, fleet: ProcessFleet) -> LoadSpec:
        return LoadSpec(
            urls=fleet.serving(), arrival="poisson", rate_schedule=self.rate,
            duration_s=self.seconds, prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN,
            timeout_s=REQUEST_TIMEOUT_S, seed=SEED,
        )  # fmt: skip


async def capacity_rps(url: str) -> float:
    """One server's requests per second, closed loop at the initial batch, alone."""
    report = await run_load(LoadSpec(
        urls=[url], arrival="concurrency", concurrency=INITIAL.max_batch_size,
        duration_s=CALIBRATION_S, prompt_len=PROMPT_LEN, output_len=OUTPUT_LEN,
        timeout_s=REQUEST_TIMEOUT_S, seed=SEED,
    ))  # fmt: skip
    return report.requests_per_s


async def start_fleet(fleet: ProcessFleet, config: BatchingConfig) -> float:
    """One server at `config`, which servers started later read too; the seconds it took
    to start (a real process start: the start-up delay every new server pays)."""
    began = time.monotonic()
    await fleet.start(1)
    took = time.monotonic() - began
    write_config_file(fleet.config_file, config)
    async with aiohttp.ClientSession() as session:
        for url in fleet.serving():
            await put_batching(session, url, ADMIN_TOKEN, config, url)
    return took


def baseline(name: str, model: str, first_metrics: str) -> Controller:
    if name == "keda":
        return KedaRule(BOUNDS)
    blocks, block_size = kv_config(first_metrics)
    context = int(PROMPT_LEN.b + OUTPUT_LEN.b)  # the longest prompt and answer
    return DynamoPlanner(
        "throughput",
        dynamo_config("throughput", SLOS[model], BOUNDS, CADENCES[model].interval_s),
        dynamo_capabilities(INITIAL, blocks, block_size, context),
        BOUNDS,
    )


async def run_pair(model: str, name: str, seconds: float, workdir: Path) -> dict[str, Any]:
    """batchpilot's fleet and one baseline's, side by side under the same load."""
    slo, cadence = SLOS[model], CADENCES[model]
    judged = replace(INITIAL, slo=slo.targets())
    source = model_refs.resolve(model).source
    (workdir / "a").mkdir()
    (workdir / "b").mkdir()
    async with (
        ProcessFleet(source, workdir / "a", READY_TIMEOUT_S) as ours,
        ProcessFleet(source, workdir / "b", READY_TIMEOUT_S) as theirs,
    ):
        startup = [await start_fleet(f, judged) for f in (ours, theirs)]
        capacity = await capacity_rps(theirs.serving()[0])
        load = Load(round(BASE_SHARE * capacity, 2), round(STEP_SHARE * capacity, 2), seconds)
        first = theirs.serving()[0]
        async with aiohttp.ClientSession() as session, session.get(f"{first}/metrics") as page:
            controller = baseline(name, model, await page.text())
        tallies = {"batchpilot": Tally(slo), name: Tally(slo)}
        stop = asyncio.Event()
        options = TuneOptions(
            servers=tuple(ours.serving()),
            goal=Goal(slo, Bounds(), replicas=BOUNDS),
            cadence=cadence,
            token=ADMIN_TOKEN,
            min_requests=MIN_REQUESTS[model],
            config_file=ours.config_file,
        )
        tuning = asyncio.create_task(tune_loop(options, stop=stop, scaler=ours))
        deciding = asyncio.create_task(baseline_loop(theirs, controller, cadence, stop))
        counting = [
            asyncio.create_task(count_replicas(f, tallies[n], stop))
            for f, n in ((ours, "batchpilot"), (theirs, name))
        ]
        try:
            await asyncio.gather(*(
                run_load(load.spec(f), tallies[n].results.append, targets=f.load)
                for f, n in ((ours, "batchpilot"), (theirs, name))
            ))  # fmt: skip
        finally:
            stop.set()
            steps = await tuning
            changes = await deciding
            await asyncio.gather(*counting)
            if isinstance(controller, DynamoPlanner):
                controller.close()
    figures = {n: t.figures(seconds) for n, t in tallies.items()}
    ours_f, theirs_f = figures["batchpilot"], figures[name]
    ratio = (
        ours_f["goodput_per_replica_s"] / theirs_f["goodput_per_replica_s"]
        if theirs_f["goodput_per_replica_s"]
        else None
    )
    return {
        "model": model,
        "baseline": name,
        "startup_s": [round(s, 1) for s in startup],
        "capacity_rps": round(capacity, 2),
        "rates_rps": [load.base_rps, load.step_rps],
        "figures": figures,
        "batchpilot_ratio": None if ratio is None else round(ratio, 3),
        "batchpilot_changes": moves(steps),
        "baseline_changes": changes,
    }


def moves(steps: list[TuneStep]) -> list[str]:
    """batchpilot's rounds that moved a knob or the replica count, in short."""
    out = []
    for step in steps:
        parts = []
        if step.changed:
            c = step.decision.config
            parts.append(f"batch {c.max_batch_size}, budget {c.prefill_token_budget}")
        scale = step.scale
        if scale is not None and scale.action != "hold":
            parts.append(f"{scale.replicas} replicas")
        if parts:
            out.append(f"round {step.index}: {', '.join(parts)}")
    return out


def run(model: str, name: str, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-planners-real-") as workdir:
        return asyncio.run(run_pair(model, name, seconds, Path(workdir)))


# -- the text ---------------------------------------------------------------------------


def markdown(rows: list[dict[str, Any]], seconds: float, notes: list[str]) -> str:
    lines = [
        "## Against replicas-only controllers on real servers (bench/planners_real.py)",
        "",
        f"One run. Per model and baseline, two fleets of local `batchpilot serve` processes "
        f"(continuous mode, one torch thread each) side by side, each 1..{MAX_REPLICAS} "
        "servers from one, under the same Poisson load (same seed) for "
        f"{seconds:g} s: a third at {BASE_SHARE:g}x one server's measured capacity (closed "
        f"loop at the initial batch, {CALIBRATION_S:g} s), then {STEP_SHARE:g}x. "
        "**batchpilot**: the tuning loop (`tune_local.tune_loop`, knobs and replicas). "
        f"**Baselines**, knobs fixed at the policy's initial config (batch "
        f"{INITIAL.max_batch_size}, budget {INITIAL.prefill_token_budget}), replicas decided "
        "each round from the servers' own `/metrics`: **keda** (`ceil(sum(waiting) / 5)` "
        "through HPA's defaults) and **dynamo_throughput** (NVIDIA Dynamo's planner, its "
        "own code at its default `throughput` target, fed traffic, worker counts and "
        "forward-pass metrics built from the scrape: the interval's mean step stands in "
        "for the last step a real server does not export). A new server in either fleet "
        "is a real process start (measured: the `start-up s` column). The three fleets "
        "do not fit two cores at once, so each baseline has its own pair, one after the "
        "other, each against a fresh batchpilot fleet. Goodput: requests meeting every "
        "target per second, judged by the load generator; attainment over the requests "
        "sent; replica-seconds: server processes alive (starting, serving, draining). "
        "The machine (2 cores) is shared with other work: figures move between runs.",
        "",
        "| model | pair | controller | targets | rates req/s | start-up s | goodput "
        "| attainment | replica-s | peak replicas | goodput/replica-s | batchpilot ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        targets = _targets(SLOS[r["model"]])
        for controller, f in r["figures"].items():
            ratio = "-" if controller == "batchpilot" else _dash(r["batchpilot_ratio"])
            lines.append(
                f"| {r['model']} | vs {r['baseline']} | {controller} | {targets} | "
                f"{r['rates_rps'][0]} then {r['rates_rps'][1]} | "
                f"{' / '.join(map(str, r['startup_s']))} | {f['goodput']} | "
                f"{_dash(f['attainment'])} | {f['replica_seconds']} | {f['peak_replicas']} | "
                f"{f['goodput_per_replica_s']} | {ratio} |"
            )
    lines += [""]
    for r in rows:
        lines.append(
            f"- {r['model']} vs {r['baseline']}: batchpilot moved at "
            + ("; ".join(r["batchpilot_changes"]) or "no round")
            + f". {r['baseline']} (seconds into the load): "
            + ("; ".join(r["baseline_changes"]) or "no change")
            + "."
        )
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _targets(slo: Slo) -> str:
    stated = (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s), ("e2e", slo.e2e_s))
    return ", ".join(f"{n} {1000 * s:g} ms" for n, s in stated if s is not None)


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/planners_real.py", description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=150.0, help="load per pair")
    ap.add_argument("--model", action="append",
                    help=f"tiny or {model_refs.SMOLLM2} (repeat; default tiny)")  # fmt: skip
    ap.add_argument("--baseline", action="append", choices=BASELINES,
                    help="a baseline to pair (repeat; default every one installed)")  # fmt: skip
    ap.add_argument("--no-write", action="store_true", help="leave docs/benchmarks.md alone")
    args = ap.parse_args(argv)
    started = time.monotonic()
    names_ = [b for b in args.baseline or BASELINES if b == "keda" or dynamo_installed()]
    notes = []
    if "dynamo_throughput" not in names_:
        notes.append("Dynamo's planner is not installed here (bench/peers/install_dynamo.sh): "
                     "only KEDA's rule ran.")  # fmt: skip
    rows = []
    for model in args.model or ["tiny"]:
        for name in names_:
            rows.append(run(model, name, args.seconds))
            print(json.dumps(rows[-1]), file=sys.stderr)
    if not args.no_write:
        replace_section(tuner.BENCHMARKS_MD, SECTION, markdown(rows, args.seconds, notes))
    summary = {
        "bench": "planners_real",
        "seconds_per_pair": args.seconds,
        "ratios": {f"{r['model']}/{r['baseline']}": r["batchpilot_ratio"] for r in rows},
        "figures": {f"{r['model']}/{r['baseline']}": r["figures"] for r in rows},
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
