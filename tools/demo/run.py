"""One demo run: start the servers, the exporter and Prometheus, then the load and the
tuning loop side by side until the load ends or a signal stops them."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
from pathlib import Path
from typing import TextIO

import aiohttp
from batchpilot_operator.tune_local import TuneOptions, tune_loop
from batchpilot_operator.tuner import Cadence, Goal, Slo
from batchpilot_tools.demo.exporter import policy_exporter
from batchpilot_tools.demo.options import ADMIN_TOKEN, INITIAL, SERVERS, DemoOptions
from batchpilot_tools.demo.recording import Recording, record_step
from batchpilot_tools.demo.supervisor import (
    ServerProcess,
    prometheus_running,
    servers_running,
    unless_stopped,
    wait_ready,
)
from batchpilot_tools.demo.view import LiveView, keep_view_fresh, say
from batchpilot_tools.demo.waste import read_slot_waste
from batchpilot_tools.loadgen import LengthDist, LoadReport, LoadSpec, run_load
from batchpilot_tools.prometheus_local import LocalPrometheus, find_binary

# Each decision reads the last few intervals (trimmed at a change by the tuner).
WINDOW_INTERVALS = 3
# Fewer than the operator's default: the demo's intervals are short, and seeing
# the tuner act beats a statistically careful p99 here.
MIN_REQUESTS = 30


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
        report = await drive(options, servers, prometheus, recording, stop, stream)
        recording.slot_waste = await read_slot_waste(servers)
        return recording, report


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
