"""`batchpilot tune`: the tuning loop against plain local servers.

    batchpilot tune --server http://127.0.0.1:8000 --slo-p99-ms 500 --token-file token
    batchpilot tune --server http://127.0.0.1:8000 --slo-ttft-ms 800 --slo-tpot-ms 60

Every interval it runs one round of `tuning_loop.TuningLoop` with signals from
Prometheus (`--prometheus`) or from a scrape of the servers' `/metrics`, the
servers' URLs as actuator, and prints the round. `tune_loop` is the reusable
driver: the demo calls it with a callback, and with a `LocalScaler` (its
`batchpilot serve` processes) when the goal has replica bounds: each round
then reads and tunes exactly the servers the scaler says take load.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from batchpilot_operator.actuators import LocalActuator, get_batching
from batchpilot_operator.policy.types import Bounds, Cadence, Goal
from batchpilot_operator.signals import MIN_REQUESTS_PER_WINDOW
from batchpilot_operator.signals_prometheus import PrometheusSource, selector_for_instances
from batchpilot_operator.signals_scrape import ScrapeSource
from batchpilot_operator.slo import DEFAULT_ATTAINMENT, KV_HIGH_WATERMARK, Slo
from batchpilot_operator.tuning_loop import PlugPoints, Scaler, TuneStep, TuningLoop
from batchpilot_server.batching_config import BatchingConfig, ConfigError


@dataclass(frozen=True)
class TuneOptions:
    servers: tuple[str, ...]
    goal: Goal
    cadence: Cadence = field(default_factory=Cadence)
    prometheus_url: str | None = None
    token: str | None = None
    iterations: int | None = None  # None: until stopped
    min_requests: int = MIN_REQUESTS_PER_WINDOW
    # Where the config of record is also written, for servers started later to read.
    config_file: Path | None = None
    # True: the goal's bounds for k become the k the first server runs (the rule keeps k
    # where it is, and the default bounds, 0..0, would turn a server's speculation off).
    follow_servers_k: bool = False

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("give at least one --server URL")


OnStep = Callable[[TuneStep], Awaitable[None] | None]


class LocalScaler(Scaler, Protocol):
    """A scaler of local servers: it starts and stops them, and says which take load."""

    def serving(self) -> Sequence[str]:
        """The URLs of the servers that take load now: the next round reads and tunes
        exactly these (a server joins once it runs the config in force)."""
        ...


class TuneError(RuntimeError):
    """The loop cannot start: the message says why and what to do."""


async def tune_loop(
    options: TuneOptions,
    on_step: OnStep | None = None,
    stop: asyncio.Event | None = None,
    scaler: LocalScaler | None = None,
) -> list[TuneStep]:
    """Run the tuning loop on `options.servers` until `stop` is set or the iterations end.

    `on_step` is the recorder: called (and awaited, if it returns an awaitable)
    after each round. With a `scaler`, the servers are the scaler's, round by
    round, and `options.goal.replicas` lets the replica rule move their number.
    Returns every round.
    """
    stop = stop or asyncio.Event()
    steps: list[TuneStep] = []

    def record(step: TuneStep) -> Awaitable[None] | None:
        steps.append(step)
        return None if on_step is None else on_step(step)

    async with aiohttp.ClientSession() as session:
        # The servers judge each request against the targets they hold: the record
        # carries the goal's, so the first round's resync hands them over.
        held = await _config_in_force(session, options.servers)
        in_force = replace(held, slo=options.goal.slo.targets())
        goal = _holding_k(options.goal, held) if options.follow_servers_k else options.goal
        source = _source(options, session)
        if isinstance(source, ScrapeSource):
            await source.scrape()  # the baseline the first window is measured from
        actuator = LocalActuator(
            options.servers, options.token, session, in_force, options.config_file
        )
        plugs = PlugPoints(source, actuator, record, scaler)
        loop = TuningLoop()
        while options.iterations is None or len(steps) < options.iterations:
            if await _stopped_within(stop, options.cadence.interval_s):
                break
            if scaler is not None:
                _follow(scaler.serving(), source, actuator)
            await loop.round(goal, options.cadence, plugs)
    return steps


def _holding_k(goal: Goal, held: BatchingConfig) -> Goal:
    k = held.num_speculative_tokens
    return replace(
        goal, bounds=replace(goal.bounds, min_speculative_tokens=k, max_speculative_tokens=k)
    )


def _follow(urls: Sequence[str], source: Source, actuator: LocalActuator) -> None:
    """The round reads and tunes these servers. A server new to the scrape has no
    baseline yet, so its first window leaves it out (`Signals.pods` says so)."""
    actuator.follow(urls)
    if isinstance(source, ScrapeSource):
        source.urls = [url.rstrip("/") for url in urls]
    else:
        source.selector = selector_for_instances(urls)


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


async def _config_in_force(
    session: aiohttp.ClientSession, servers: Sequence[str]
) -> BatchingConfig:
    """Where the record starts: what the first server holds."""
    try:
        return await get_batching(session, servers[0])
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise TuneError(
            f"cannot read the batching config of {servers[0]} (GET /admin/batching): "
            f"{exc or type(exc).__name__}; is `batchpilot serve` running there?"
        ) from exc


Source = ScrapeSource | PrometheusSource


def _source(options: TuneOptions, session: aiohttp.ClientSession) -> Source:
    if options.prometheus_url:
        return PrometheusSource(
            options.prometheus_url,
            selector_for_instances(options.servers),
            session,
            min_requests=options.min_requests,
            budget_window_s=options.goal.slo.budget_window_s,
        )
    return ScrapeSource(
        options.servers, session, min_requests=options.min_requests,
        budget_window_s=options.goal.slo.budget_window_s,
    )  # fmt: skip


# -- what a round prints --------------------------------------------------------------------


def step_dict(step: TuneStep) -> dict[str, Any]:
    return {
        "index": step.index,
        "time": round(step.at, 3),
        "action": step.decision.action,
        "reason": step.decision.reason,
        "max_batch_size": step.decision.config.max_batch_size,
        "batch_timeout_ms": step.decision.config.batch_timeout_ms,
        "prefill_token_budget": step.decision.config.prefill_token_budget,
        "before": {
            "max_batch_size": step.before.max_batch_size,
            "batch_timeout_ms": step.before.batch_timeout_ms,
            "prefill_token_budget": step.before.prefill_token_budget,
        },
        "signals": step.signals.to_dict(),
        "refused": [asdict(r) for r in step.report.refused],
    }


def step_line(step: TuneStep) -> str:
    s = step.signals
    p99 = "-" if s.p99_latency_s is None else f"{s.p99_latency_s * 1000:.0f}ms"
    kv = "-" if s.kv_usage is None else f"{s.kv_usage:.2f}"
    cfg = step.decision.config
    text = (
        f"[{time.strftime('%H:%M:%S', time.localtime(step.at))}] {step.decision.action:<14} "
        f"batch={cfg.max_batch_size:<3} timeout={cfg.batch_timeout_ms:g}ms  "
        f"p99={p99} rate={s.request_rate:.1f}/s kv={kv}  {step.decision.reason}"
    )
    if step.report.applied and not step.changed:
        text += f"  [resynced {', '.join(a.target for a in step.report.applied)}]"
    if step.report.refused:
        text += f"  [{step.report.summary()}]"
    return text


# -- command line ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="batchpilot tune",
        description="Tune local servers' batching toward the most throughput within an SLO "
        "(any of TTFT, TPOT and end-to-end targets, met by --slo-attainment of the requests).",
    )
    ap.add_argument("--server", action="append", required=True, metavar="URL",
                    help="a server's base URL (repeat for several)")
    slo = ap.add_argument_group("SLO (state at least one target)")
    slo.add_argument("--slo-ttft-ms", type=float, help="time to first token target, ms")
    slo.add_argument("--slo-tpot-ms", type=float,
                     help="time per output token target (each request's mean after the first), ms")
    slo.add_argument("--slo-e2e-ms", "--slo-p99-ms", dest="slo_e2e_ms", type=float,
                     help="end-to-end (arrival to last byte) target, ms; --slo-p99-ms is its "
                     "older name")
    slo.add_argument("--slo-attainment", type=float, default=DEFAULT_ATTAINMENT,
                     help="share of requests that must meet every stated target "
                     f"(default {DEFAULT_ATTAINMENT:g})")
    ap.add_argument("--prometheus", metavar="URL",
                    help="read signals from this Prometheus (else scrape the servers)")
    cadence, bounds = Cadence(), Bounds()
    ap.add_argument("--interval", type=float, default=cadence.interval_s,
                    help="seconds between decisions")
    ap.add_argument("--window", type=float, default=cadence.window_s,
                    help="seconds of data per decision")
    ap.add_argument("--token-file", type=Path, help="file holding the servers' admin token")
    ap.add_argument("--min-batch", type=int, default=bounds.min_batch)
    ap.add_argument("--max-batch", type=int, default=bounds.max_batch)
    ap.add_argument("--min-timeout-ms", type=float, default=bounds.min_timeout_ms)
    ap.add_argument("--max-timeout-ms", type=float, default=bounds.max_timeout_ms)
    ap.add_argument("--min-prefill-budget", type=int, default=bounds.min_prefill_budget,
                    help="continuous mode: fewest prompt tokens computed per step")
    ap.add_argument("--max-prefill-budget", type=int, default=bounds.max_prefill_budget,
                    help="continuous mode: most prompt tokens computed per step")
    ap.add_argument("--min-speculative-tokens", type=int,
                    help="continuous mode: the least k (speculative decoding's draft tokens "
                    "per row) the tuner keeps; neither bound given: the k the servers run")
    ap.add_argument("--max-speculative-tokens", type=int,
                    help="continuous mode: the most k the tuner keeps (default: "
                    "--min-speculative-tokens)")
    ap.add_argument("--kv-high-watermark", type=float, default=KV_HIGH_WATERMARK)
    ap.add_argument("--min-requests", type=int, default=MIN_REQUESTS_PER_WINDOW,
                    help="fewest finished requests in a window to judge its p99")
    ap.add_argument("--iterations", type=int, help="stop after this many decisions")
    ap.add_argument("--json", action="store_true", help="print each decision as a JSON line")
    return ap


def options_from_args(args: argparse.Namespace) -> TuneOptions:
    """Checked options; raises ValueError with a message fit for the user."""
    token = None
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --token-file {args.token_file}: {exc.strerror}") from exc
        if not token:
            raise ValueError(f"--token-file {args.token_file} is empty")
    if args.iterations is not None and args.iterations < 1:
        raise ValueError("--iterations must be at least 1")
    given = (args.min_speculative_tokens, args.max_speculative_tokens)
    low = args.min_speculative_tokens or 0
    speculative = (low, low if args.max_speculative_tokens is None else args.max_speculative_tokens)
    return TuneOptions(
        servers=tuple(args.server),
        goal=Goal(
            slo_from_args(args),
            Bounds(
                args.min_batch, args.max_batch, args.min_timeout_ms, args.max_timeout_ms,
                args.min_prefill_budget, args.max_prefill_budget, *speculative,
            ),
        ),
        cadence=Cadence(args.interval, args.window),
        prometheus_url=args.prometheus,
        token=token,
        iterations=args.iterations,
        min_requests=args.min_requests,
        follow_servers_k=given == (None, None),
    )


SLO_FLAGS = {"ttft": "--slo-ttft-ms", "tpot": "--slo-tpot-ms", "e2e": "--slo-e2e-ms"}


def slo_from_args(args: argparse.Namespace) -> Slo:
    """The SLO the flags state; raises ValueError naming the flag at fault."""
    targets = {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms, "e2e": args.slo_e2e_ms}
    stated = {name: ms for name, ms in targets.items() if ms is not None}
    if not stated:
        raise ValueError(
            "state at least one SLO target: --slo-ttft-ms, --slo-tpot-ms or --slo-e2e-ms "
            "(--slo-p99-ms)"
        )
    for name, ms in stated.items():
        if ms <= 0:
            raise ValueError(f"{SLO_FLAGS[name]}: the SLO must be positive, got {ms:g}")
    if not 0 < args.slo_attainment < 1:
        raise ValueError(f"--slo-attainment must be in (0, 1), got {args.slo_attainment:g}")

    def seconds(ms: float | None) -> float | None:
        return None if ms is None else ms / 1000.0

    return Slo(
        ttft_s=seconds(args.slo_ttft_ms), tpot_s=seconds(args.slo_tpot_ms),
        e2e_s=seconds(args.slo_e2e_ms), attainment=args.slo_attainment,
        kv_high_watermark=args.kv_high_watermark,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        options = options_from_args(args)
    except (ValueError, ConfigError) as exc:
        print(f"batchpilot tune: {exc}", file=sys.stderr)
        return 2

    def show(step: TuneStep) -> None:
        print(json.dumps(step_dict(step)) if args.json else step_line(step), flush=True)

    try:
        asyncio.run(tune_loop(options, show))
    except TuneError as exc:
        print(f"batchpilot tune: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
