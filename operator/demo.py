"""`batchpilot demo` (what `make demo` runs): watch the tuner work, with no cluster.

Two `batchpilot serve` processes (continuous batching, a deliberately poor
start config) form one local "policy"; Prometheus scrapes them when its
binary is installed (otherwise the tuner scrapes `/metrics` itself); the load
generator offers a steady rate that steps up midway; the local tuning loop
moves both knobs. A live view shows what happens; at the end the run is
plotted to `docs/demo.png` and summarised.

`--model DIR|FILE.gguf` runs it on a real model instead of `tiny`, with a load
scaled down to what a real model serves on a few CPU cores.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO, TypeVar

import aiohttp
from batchpilot_operator.policy_metrics import PolicyMetrics
from batchpilot_operator.prometheus_local import (
    LocalPrometheus,
    PrometheusError,
    find_binary,
    free_port,
    scrape_config,
)
from batchpilot_operator.tune_local import TuneError, TuneOptions, tune_loop
from batchpilot_operator.tuner import KV_HIGH_WATERMARK, Cadence, Goal, Slo
from batchpilot_operator.tuning_loop import TuneStep
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.loadgen import LengthDist, LoadReport, LoadSpec, run_load
from batchpilot_server.model_presets import PRESET_NAMES

NAMESPACE = "local"
POLICY = "demo"
SERVERS = 2
# Poor on purpose: a small batch and a long idle wait before the first step, so
# the tuner has visible work to do before the load even steps up.
INITIAL = BatchingConfig(max_batch_size=1, batch_timeout_ms=100.0, max_queue_size=512)
ADMIN_TOKEN = "batchpilot-demo"
STOP_TIMEOUT_S = 15.0
SHUTDOWN_GRACE_S = 3.0
VIEW_REFRESH_S = 1.0
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}
# Each decision reads the last few intervals (trimmed at a change by the tuner).
WINDOW_INTERVALS = 3
# Fewer than the operator's default: the demo's intervals are short, and seeing
# the tuner act beats a statistically careful p99 here.
MIN_REQUESTS = 30


@dataclass(frozen=True)
class LoadProfile:
    """Defaults that fit a model: the offered load, its SLO and how long a server may load."""

    rate: float
    step_factor: float
    slo_p99_ms: float
    output_len: LengthDist
    ready_timeout_s: float


TINY_PROFILE = LoadProfile(
    rate=8.0, step_factor=6.0, slo_p99_ms=1000.0,
    output_len=LengthDist("uniform", 32, 96), ready_timeout_s=90.0,
)
# A 135M-parameter model decodes some 50x slower than tiny on one core per server:
# a fraction of a request per second, shorter answers and a SLO of seconds keep the
# step near capacity, so the tuner still has a visible decision to make. These are
# starting points, not measurements of every model: --rate and --slo-p99-ms override.
REAL_MODEL_PROFILE = LoadProfile(
    rate=0.5, step_factor=4.0, slo_p99_ms=10000.0,
    output_len=LengthDist("uniform", 16, 48), ready_timeout_s=600.0,
)


def profile_for(model: str) -> LoadProfile:
    return TINY_PROFILE if model in PRESET_NAMES else REAL_MODEL_PROFILE


@dataclass(frozen=True)
class DemoOptions:
    duration_s: float
    slo_p99_ms: float
    out: Path
    interval_s: float
    base_rate: float
    step_factor: float
    use_prometheus: bool
    model: str = "tiny"

    @property
    def profile(self) -> LoadProfile:
        return profile_for(self.model)

    @property
    def step_at_s(self) -> float:
        return self.duration_s / 2

    def offered_rate(self, elapsed_s: float) -> float:
        """Requests/s the load generator offers at `elapsed_s`: one step up, midway."""
        if elapsed_s < self.step_at_s:
            return self.base_rate
        return self.base_rate * self.step_factor


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchpilot demo", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    p.add_argument(
        "--model",
        default="tiny",
        help="what the servers serve: a preset, a Hugging Face model directory or a .gguf "
        "file (default tiny; a real model gets the smaller load and longer SLO below)",
    )
    tiny, real = TINY_PROFILE, REAL_MODEL_PROFILE
    p.add_argument(
        "--slo-p99-ms", type=float,
        help=f"p99 latency SLO (ms; default {tiny.slo_p99_ms:g}, {real.slo_p99_ms:g} for a "
        "real model)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("docs/demo.png"), help="plot to write")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between tuner decisions")
    p.add_argument(
        "--rate", type=float,
        help=f"requests/s before the load step (default {tiny.rate:g}, {real.rate:g} for a "
        "real model)",
    )  # fmt: skip
    p.add_argument(
        "--step-factor", type=float,
        help=f"load multiplier at the step (default {tiny.step_factor:g}, "
        f"{real.step_factor:g} for a real model)",
    )  # fmt: skip
    p.add_argument(
        "--no-prometheus",
        action="store_true",
        help="scrape the servers directly even when a prometheus binary is installed",
    )
    return p


def options_from(argv: list[str]) -> DemoOptions:
    p = parser()
    args = p.parse_args(argv)
    profile = profile_for(args.model)
    slo_p99_ms = profile.slo_p99_ms if args.slo_p99_ms is None else args.slo_p99_ms
    rate = profile.rate if args.rate is None else args.rate
    step_factor = profile.step_factor if args.step_factor is None else args.step_factor
    for flag, value in (
        ("--duration", args.duration),
        ("--slo-p99-ms", slo_p99_ms),
        ("--interval", args.interval),
        ("--rate", rate),
        ("--step-factor", step_factor),
    ):
        if value <= 0:
            p.error(f"{flag} must be positive, got {value:g}")
    if args.duration < 4 * args.interval:
        p.error(
            f"--duration {args.duration:g} is too short for --interval {args.interval:g}: "
            "the tuner needs at least 4 intervals"
        )
    return DemoOptions(
        duration_s=args.duration,
        slo_p99_ms=slo_p99_ms,
        out=args.out,
        interval_s=args.interval,
        base_rate=rate,
        step_factor=step_factor,
        use_prometheus=not args.no_prometheus,
        model=args.model,
    )


# --- processes ---------------------------------------------------------------------------


@dataclass
class ServerProcess:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_server(name: str, model: str, workdir: Path, token_file: Path) -> ServerProcess:
    port = free_port()
    log_path = workdir / f"{name}.log"
    command = [
        sys.executable, "-m", "batchpilot_server.cli", "serve",
        "--model", model, "--mode", "continuous", "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-batch-size", str(INITIAL.max_batch_size),
        "--batch-timeout-ms", str(INITIAL.batch_timeout_ms),
        "--max-queue-size", str(INITIAL.max_queue_size),
        "--admin-token-file", str(token_file),
        # One torch thread each: two servers, the load and the tuner share the cores.
        "--threads", "1",
        # Ctrl-C should not wait long for requests the stopped load abandoned.
        "--shutdown-grace-s", str(SHUTDOWN_GRACE_S),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        # Own session: a terminal's Ctrl-C reaches only the demo, which stops us in order.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return ServerProcess(name, port, process, log_path)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


async def wait_ready(
    server: ServerProcess, session: aiohttp.ClientSession, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise DemoError(
                f"{server.name} exited with {server.process.returncode} while starting:\n"
                f"{server.log_tail()}"
            )
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(f"{server.url}/readyz") as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise DemoError(
                f"{server.name} not ready after {timeout_s:.0f}s:\n"
                f"{server.log_tail()}"
            )
        await asyncio.sleep(0.2)


class DemoError(RuntimeError):
    """Something the demo started did not come up; the message says what and why."""


@contextlib.contextmanager
def servers_running(model: str, workdir: Path) -> Iterator[list[ServerProcess]]:
    token_file = workdir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    servers: list[ServerProcess] = []
    try:
        for index in range(SERVERS):
            servers.append(start_server(f"server-{index}", model, workdir, token_file))
        yield servers
    finally:
        for server in servers:
            stop_process(server.process)


@contextlib.contextmanager
def policy_exporter(options: DemoOptions) -> Iterator[str]:
    """The SLO and watermark gauges the operator would publish; yields host:port."""
    metrics = PolicyMetrics()
    metrics.publish(
        NAMESPACE, POLICY, slo_p99_ms=options.slo_p99_ms, kv_high_watermark=KV_HIGH_WATERMARK
    )
    http, thread = metrics.serve(0, addr="127.0.0.1")
    try:
        yield f"127.0.0.1:{http.server_port}"
    finally:
        http.shutdown()
        thread.join(timeout=5)


@contextlib.contextmanager
def prometheus_running(
    workdir: Path, servers: list[ServerProcess], exporter: str
) -> Iterator[LocalPrometheus]:
    targets = [f"127.0.0.1:{server.port}" for server in servers]
    config = scrape_config(
        [*targets, exporter],
        scrape_interval="1s",
        target_labels={
            target: {"namespace": NAMESPACE, "policy": POLICY, "pod": server.name}
            for target, server in zip(targets, servers, strict=True)
        },
    )
    with LocalPrometheus(workdir / "prometheus", config) as prometheus:
        yield prometheus


# --- what the run records -----------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One tuner interval as the view and the plot show it."""

    t_s: float
    offered_rps: float
    p99_ms: float | None
    kv_usage: float | None
    max_batch_size: int
    batch_timeout_ms: float
    action: str
    reason: str


@dataclass
class Recording:
    options: DemoOptions
    started: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    config: BatchingConfig = INITIAL
    signal_source: str = ""

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None


# --- live view -----------------------------------------------------------------------------


def _ms(value: float | None) -> str:
    return "   n/a" if value is None else f"{value:6.0f}"


def view_lines(recording: Recording) -> list[str]:
    options, last = recording.options, recording.last
    elapsed = min(recording.elapsed(), options.duration_s)
    lines = [
        f"batchpilot demo  {elapsed:5.0f}/{options.duration_s:.0f} s  "
        f"offered {options.offered_rate(elapsed):5.1f} req/s  "
        f"(x{options.step_factor:g} step at {options.step_at_s:.0f} s)  "
        f"signals: {recording.signal_source}",
    ]
    if last is None:
        lines.append("waiting for the first tuner interval...")
        return lines
    met = last.p99_ms is not None and last.p99_ms <= options.slo_p99_ms
    verdict = "n/a" if last.p99_ms is None else ("met" if met else "BREACH")
    kv = "n/a" if last.kv_usage is None else f"{last.kv_usage:.0%}"
    lines += [
        f"p99 {_ms(last.p99_ms)} ms  SLO {options.slo_p99_ms:.0f} ms  {verdict:<6}  "
        f"batch {last.max_batch_size:3d}  timeout {last.batch_timeout_ms:6.1f} ms  KV {kv}",
        f"last decision @{last.t_s:5.0f} s: {last.action}: {last.reason}",
    ]
    return lines


class LiveView:
    """Redraws in place on a terminal; elsewhere prints one line per tuner interval."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self._drawn = 0
        self._printed = 0

    def refresh(self, recording: Recording) -> None:
        if self.tty:
            self._redraw(view_lines(recording))
            return
        for sample in recording.samples[self._printed :]:
            self.stream.write(plain_line(sample, recording.options) + "\n")
        self._printed = len(recording.samples)
        self.stream.flush()

    def _redraw(self, lines: list[str]) -> None:
        # A wrapped line would break the cursor arithmetic below: cut to the width.
        width = shutil.get_terminal_size().columns
        lines = [line[: width - 1] for line in lines]
        # Up to the first line we drew, clear to the end of the screen, draw again.
        prefix = f"\x1b[{self._drawn}F\x1b[J" if self._drawn else ""
        self.stream.write(prefix + "\n".join(lines) + "\n")
        self.stream.flush()
        self._drawn = len(lines)


def plain_line(sample: Sample, options: DemoOptions) -> str:
    kv = "n/a" if sample.kv_usage is None else f"{sample.kv_usage:.0%}"
    return (
        f"t={sample.t_s:5.0f}s offered={sample.offered_rps:5.1f}/s "
        f"p99={_ms(sample.p99_ms).strip()}ms slo={options.slo_p99_ms:.0f}ms "
        f"batch={sample.max_batch_size} timeout={sample.batch_timeout_ms:.1f}ms kv={kv} "
        f"{sample.action}: {sample.reason}"
    )


async def keep_view_fresh(view: LiveView, recording: Recording) -> None:
    while True:
        view.refresh(recording)
        await asyncio.sleep(VIEW_REFRESH_S)


# --- plot and summary ----------------------------------------------------------------------


def write_plot(recording: Recording, path: Path) -> None:
    """p99 against the SLO, and both knobs, over time; the load step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    options, samples = recording.options, recording.samples
    times = [s.t_s for s in samples]
    # The knobs start at the initial config, before the first decision.
    knob_times = [0.0, *times]
    batches = [INITIAL.max_batch_size, *(s.max_batch_size for s in samples)]
    timeouts = [INITIAL.batch_timeout_ms, *(s.batch_timeout_ms for s in samples)]
    fig, (ax_p99, ax_batch, ax_timeout) = plt.subplots(
        3, 1, figsize=(10, 8), sharex=True, height_ratios=(2, 1, 1)
    )
    ax_p99.plot(
        times, [s.p99_ms if s.p99_ms is not None else float("nan") for s in samples],
        marker="o", markersize=3, label="p99 latency",
    )  # fmt: skip
    ax_p99.axhline(options.slo_p99_ms, color="tab:red", linestyle="--", label="p99 SLO")
    ax_p99.set_ylabel("p99 latency (ms)")
    ax_p99.set_ylim(bottom=0)
    ax_load = ax_p99.twinx()
    load_t = [0.0, options.step_at_s, options.step_at_s, options.duration_s]
    load_r = [options.base_rate, options.base_rate, *[options.offered_rate(options.step_at_s)] * 2]
    ax_load.plot(load_t, load_r, color="tab:gray", alpha=0.6, label="offered load")
    ax_load.set_ylabel("offered load (req/s)")
    ax_load.set_ylim(bottom=0)
    handles = ax_p99.get_legend_handles_labels()[0] + ax_load.get_legend_handles_labels()[0]
    ax_p99.legend(handles=handles, loc="upper left", fontsize=8)

    ax_batch.step(knob_times, batches, where="post", color="tab:green")
    ax_batch.set_ylabel("max_batch_size")
    ax_batch.set_ylim(bottom=0)
    ax_timeout.step(knob_times, timeouts, where="post", color="tab:purple")
    ax_timeout.set_ylabel("batch timeout (ms)")
    ax_timeout.set_ylim(bottom=0)
    ax_timeout.set_xlabel("time since load start (s)")
    for ax in (ax_p99, ax_batch, ax_timeout):
        ax.axvline(options.step_at_s, color="black", linestyle=":", linewidth=1)
        ax.grid(alpha=0.3)
    ax_p99.annotate(
        f"load x{options.step_factor:g}", (options.step_at_s, 0), xytext=(4, 4),
        textcoords="offset points", fontsize=8,
    )  # fmt: skip
    fig.suptitle(
        f"batchpilot demo: {SERVERS} continuous-batching servers, tiny model, "
        f"SLO p99 {options.slo_p99_ms:.0f} ms"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_lines(recording: Recording, report: LoadReport | None, interrupted: bool) -> list[str]:
    options, samples = recording.options, recording.samples
    judged = [s for s in samples if s.p99_ms is not None]
    met = [s for s in judged if s.p99_ms is not None and s.p99_ms <= options.slo_p99_ms]
    changes = [s for s in samples if s.action not in ("hold",)]
    lines = ["", "batchpilot demo summary" + (" (interrupted)" if interrupted else "")]
    if report is not None:
        lines.append(
            f"  load: {report.sent} requests sent, {report.ok} ok, "
            f"{report.requests_per_s:.1f} req/s, {report.tokens_per_s:.0f} tokens/s"
        )
    lines += [
        f"  tuner: {len(samples)} intervals, {len(changes)} changes, "
        f"p99 within the {options.slo_p99_ms:.0f} ms SLO in {len(met)}/{len(judged)} judged",
        f"  config: batch {INITIAL.max_batch_size} -> {recording.config.max_batch_size}, "
        f"timeout {INITIAL.batch_timeout_ms:g} -> {recording.config.batch_timeout_ms:g} ms",
    ]
    if samples:
        lines.append(f"  plot: {options.out}")
    return lines


# --- the run -------------------------------------------------------------------------------


T = TypeVar("T")


class Stopped(Exception):
    """SIGINT or SIGTERM arrived while the demo was starting up."""


async def unless_stopped(awaitable: Awaitable[T], stop: asyncio.Event) -> T:
    """Await `awaitable`, or raise Stopped (cancelling it) as soon as `stop` is set."""
    work = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        stopper.cancel()
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    raise Stopped


def load_spec(options: DemoOptions, servers: list[ServerProcess]) -> LoadSpec:
    return LoadSpec(
        urls=[server.url for server in servers],
        arrival="poisson",
        rate_schedule=options.offered_rate,
        duration_s=options.duration_s,
        prompt_len=LengthDist("uniform", 16, 48),
        output_len=options.profile.output_len,
        timeout_s=60.0,
    )


def tune_options(
    options: DemoOptions, servers: list[ServerProcess], prometheus_url: str | None
) -> TuneOptions:
    return TuneOptions(
        servers=tuple(server.url for server in servers),
        goal=Goal(Slo(options.slo_p99_ms / 1000.0)),
        cadence=Cadence(options.interval_s, WINDOW_INTERVALS * options.interval_s),
        prometheus_url=prometheus_url,
        token=ADMIN_TOKEN,
        min_requests=MIN_REQUESTS,
    )


def record_step(recording: Recording, step: TuneStep) -> None:
    signals = step.signals
    recording.config = step.decision.config
    elapsed = recording.elapsed()
    recording.samples.append(
        Sample(
            t_s=elapsed,
            offered_rps=recording.options.offered_rate(elapsed),
            p99_ms=None if signals.p99_latency_s is None else signals.p99_latency_s * 1000.0,
            kv_usage=signals.kv_usage,
            max_batch_size=recording.config.max_batch_size,
            batch_timeout_ms=recording.config.batch_timeout_ms,
            action=step.decision.action,
            reason=step.decision.reason,
        )
    )


async def start_prometheus(
    stack: contextlib.ExitStack,
    workdir: Path,
    servers: list[ServerProcess],
    exporter: str,
    stop: asyncio.Event,
    stream: TextIO,
) -> LocalPrometheus | None:
    """Prometheus scraping the servers, or None (direct scrape) when it is not installed."""
    if find_binary() is None:
        say(stream, "prometheus not installed: the tuner scrapes the servers' /metrics itself")
        return None
    prometheus = stack.enter_context(prometheus_running(workdir, servers, exporter))
    await unless_stopped(asyncio.to_thread(prometheus.wait_for_targets_up), stop)
    say(stream, f"prometheus at {prometheus.url} (try {prometheus.url}/graph)")
    return prometheus


def say(stream: TextIO, message: str) -> None:
    stream.write(f"batchpilot demo: {message}\n")
    stream.flush()


async def run_demo(
    options: DemoOptions, stop: asyncio.Event, stream: TextIO
) -> tuple[Recording, LoadReport | None]:
    """Start everything, run the load with the tuner in the loop, stop everything."""
    recording = Recording(options)
    with (
        tempfile.TemporaryDirectory(prefix="batchpilot-demo-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        workdir = Path(tmp)
        say(stream, f"starting {SERVERS} servers of {options.model} (continuous batching, "
            f"batch {INITIAL.max_batch_size}, timeout {INITIAL.batch_timeout_ms:g} ms)")
        servers = stack.enter_context(servers_running(options.model, workdir))
        ready_timeout_s = options.profile.ready_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            await unless_stopped(
                asyncio.gather(*(wait_ready(s, session, ready_timeout_s) for s in servers)), stop
            )
        exporter = stack.enter_context(policy_exporter(options))
        prometheus = None
        if options.use_prometheus:
            prometheus = await start_prometheus(stack, workdir, servers, exporter, stop, stream)
        else:
            say(stream, "--no-prometheus: the tuner scrapes the servers' /metrics itself")
        recording.signal_source = "prometheus" if prometheus else "direct scrape"
        return recording, await drive(options, servers, prometheus, recording, stop, stream)


async def drive(
    options: DemoOptions,
    servers: list[ServerProcess],
    prometheus: LocalPrometheus | None,
    recording: Recording,
    stop: asyncio.Event,
    stream: TextIO,
) -> LoadReport | None:
    """The load and the tuner side by side until the load ends or a signal stops them."""
    view = LiveView(stream)
    recording.started = time.monotonic()
    tuning_done = asyncio.Event()
    load = asyncio.create_task(run_load(load_spec(options, servers)))
    tuner = asyncio.create_task(
        tune_loop(
            tune_options(options, servers, prometheus.url if prometheus else None),
            lambda step: record_step(recording, step),
            tuning_done,
        )
    )
    view_task = asyncio.create_task(keep_view_fresh(view, recording))
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({load, tuner, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        tuning_done.set()
        for task in (load, view_task, stopper):
            task.cancel()
        await asyncio.gather(load, tuner, view_task, stopper, return_exceptions=True)
        view.refresh(recording)
    tuner.result()  # re-raises what stopped the tuner, e.g. a TuneError
    return None if load.cancelled() else load.result()


# --- entry point ---------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    return asyncio.run(demo(options_from(argv), sys.stdout))


async def demo(options: DemoOptions, stream: TextIO) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in EXIT_CODES:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        recording, report = await run_demo(options, stop, stream)
    except Stopped:
        say(stream, "interrupted while starting; everything it started is stopped")
        return EXIT_CODES[received[0]]
    except (DemoError, PrometheusError, TuneError) as exc:
        print(f"batchpilot demo: {exc}", file=sys.stderr)
        return 1
    finally:
        for sig in EXIT_CODES:
            loop.remove_signal_handler(sig)
    if recording.samples:
        write_plot(recording, options.out)
    else:
        say(stream, f"no tuner interval completed, so no plot was written to {options.out}")
    for line in summary_lines(recording, report, interrupted=bool(received)):
        stream.write(line + "\n")
    stream.flush()
    return EXIT_CODES[received[0]] if received else 0
