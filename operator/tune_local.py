"""`batchpilot tune`: the operator's tuner against plain local servers.

    batchpilot tune --server http://127.0.0.1:8000 --slo-p99-ms 500 --token-file token

Every interval it reads signals (from Prometheus with `--prometheus`, else by
scraping the servers' `/metrics`), runs the same `tuner.decide` as the Kopf
timer, pushes a changed config to every server and prints the decision.
`tune_loop` is the reusable part: the demo calls it with a callback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from batchpilot_operator.actuators import ActuationReport, LocalActuator, get_batching
from batchpilot_operator.signals import Signals
from batchpilot_operator.signals_prometheus import PrometheusSource, selector_for_instances
from batchpilot_operator.signals_scrape import ScrapeSource
from batchpilot_operator.tuner import (
    Bounds,
    Decision,
    Slo,
    TunerParams,
    TunerState,
    decide,
    signal_window_s,
)
from batchpilot_server.batching_config import BatchingConfig, ConfigError


@dataclass(frozen=True)
class TuneOptions:
    servers: tuple[str, ...]
    slo: Slo
    bounds: Bounds = field(default_factory=Bounds)
    prometheus_url: str | None = None
    interval_s: float = 30.0
    window_s: float = 60.0
    token: str | None = None
    iterations: int | None = None  # None: until stopped
    min_requests: int = 50
    params: TunerParams = field(default_factory=TunerParams)

    def __post_init__(self) -> None:
        if not self.servers:
            raise ValueError("give at least one --server URL")
        if self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("--interval and --window must be positive")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"--window ({self.window_s:g} s) must be at least --interval "
                f"({self.interval_s:g} s): each decision needs a full interval of data"
            )


@dataclass(frozen=True)
class TuneStep:
    """One interval of the loop: what was seen, decided and done."""

    index: int
    at: float  # time.time()
    signals: Signals
    before: BatchingConfig
    decision: Decision
    report: ActuationReport | None  # None when nothing changed

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "time": round(self.at, 3),
            "action": self.decision.action,
            "reason": self.decision.reason,
            "max_batch_size": self.decision.config.max_batch_size,
            "batch_timeout_ms": self.decision.config.batch_timeout_ms,
            "before": {
                "max_batch_size": self.before.max_batch_size,
                "batch_timeout_ms": self.before.batch_timeout_ms,
            },
            "signals": self.signals.to_dict(),
            "refused": [] if self.report is None else [asdict(r) for r in self.report.refused],
        }

    def line(self) -> str:
        s = self.signals
        p99 = "-" if s.p99_latency_s is None else f"{s.p99_latency_s * 1000:.0f}ms"
        kv = "-" if s.kv_usage is None else f"{s.kv_usage:.2f}"
        cfg = self.decision.config
        text = (
            f"[{time.strftime('%H:%M:%S', time.localtime(self.at))}] {self.decision.action:<14} "
            f"batch={cfg.max_batch_size:<3} timeout={cfg.batch_timeout_ms:g}ms  "
            f"p99={p99} rate={s.request_rate:.1f}/s kv={kv}  {self.decision.reason}"
        )
        if self.report is not None and self.report.refused:
            text += f"  [{self.report.summary()}]"
        return text


OnStep = Callable[[TuneStep], Awaitable[None] | None]


class TuneError(RuntimeError):
    """The loop cannot start: the message says why and what to do."""


async def tune_loop(
    options: TuneOptions,
    on_step: OnStep | None = None,
    stop: asyncio.Event | None = None,
) -> list[TuneStep]:
    """Run the tuner against `options.servers` until `stop` is set or the iterations end.

    `on_step` is called (and awaited, if it returns an awaitable) after each
    decision was actuated. Returns every step.
    """
    stop = stop or asyncio.Event()
    steps: list[TuneStep] = []
    async with aiohttp.ClientSession() as session:
        current = await _config_in_force(session, options.servers)
        source = _source(options, session)
        actuator = LocalActuator(options.servers, options.token, session)
        if isinstance(source, ScrapeSource):
            await source.scrape()  # the baseline the first window is measured from
        state = TunerState()
        while options.iterations is None or len(steps) < options.iterations:
            if await _stopped_within(stop, options.interval_s):
                break
            window = signal_window_s(state, options.interval_s, options.window_s)
            signals = await source.read(window)
            decision = decide(signals, current, options.bounds, options.slo, state, options.params)
            before, report = current, None
            if decision.config != current:
                report = await actuator.apply(decision.config)
                # A config nobody took is not in force: judge the next window against the old.
                if report.applied:
                    current = decision.config
            if report is None or report.applied:
                state = decision.state
            step = TuneStep(len(steps), time.time(), signals, before, decision, report)
            steps.append(step)
            if on_step is not None:
                result = on_step(step)
                if result is not None:
                    await result
    return steps


async def _stopped_within(stop: asyncio.Event, seconds: float) -> bool:
    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
    except TimeoutError:
        return False
    return True


async def _config_in_force(
    session: aiohttp.ClientSession, servers: Sequence[str]
) -> BatchingConfig:
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
        )
    return ScrapeSource(options.servers, session, min_requests=options.min_requests)


# -- command line ---------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="batchpilot tune",
        description="Tune local servers' batching toward the most throughput within a p99 SLO.",
    )
    ap.add_argument("--server", action="append", required=True, metavar="URL",
                    help="a server's base URL (repeat for several)")
    ap.add_argument("--slo-p99-ms", type=float, required=True, help="p99 latency SLO, ms")
    ap.add_argument("--prometheus", metavar="URL",
                    help="read signals from this Prometheus (else scrape the servers)")
    ap.add_argument("--interval", type=float, default=30.0, help="seconds between decisions")
    ap.add_argument("--window", type=float, default=60.0, help="seconds of data per decision")
    ap.add_argument("--token-file", type=Path, help="file holding the servers' admin token")
    ap.add_argument("--min-batch", type=int, default=1)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--min-timeout-ms", type=float, default=0.0)
    ap.add_argument("--max-timeout-ms", type=float, default=200.0)
    ap.add_argument("--kv-high-watermark", type=float, default=0.9)
    ap.add_argument("--min-requests", type=int, default=50,
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
    return TuneOptions(
        servers=tuple(args.server),
        slo=Slo(args.slo_p99_ms / 1000.0, args.kv_high_watermark),
        bounds=Bounds(args.min_batch, args.max_batch, args.min_timeout_ms, args.max_timeout_ms),
        prometheus_url=args.prometheus,
        interval_s=args.interval,
        window_s=args.window,
        token=token,
        iterations=args.iterations,
        min_requests=args.min_requests,
    )


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        options = options_from_args(args)
    except (ValueError, ConfigError) as exc:
        print(f"batchpilot tune: {exc}", file=sys.stderr)
        return 2

    def show(step: TuneStep) -> None:
        print(json.dumps(step.to_dict()) if args.json else step.line(), flush=True)

    try:
        asyncio.run(tune_loop(options, show))
    except TuneError as exc:
        print(f"batchpilot tune: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
