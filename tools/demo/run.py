"""One demo run: start the servers, the exporter and Prometheus, then the load and the
tuning loop (knobs and, with a range of replicas, the server count) side by side until
the load ends or a signal stops them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import tempfile
import time
from pathlib import Path
from typing import TextIO

from batchpilot_operator.policy.types import Cadence, Goal
from batchpilot_operator.tune_local import TuneOptions, tune_loop
from batchpilot_tools.demo.capacity import measure_capacity, measure_seconds
from batchpilot_tools.demo.exporter import policy_exporter
from batchpilot_tools.demo.fleet import ProcessFleet
from batchpilot_tools.demo.options import ADMIN_TOKEN, INITIAL, DemoOptions
from batchpilot_tools.demo.recording import Recording, record_step
from batchpilot_tools.demo.supervisor import (
    ServerProcess,
    demo_scrape_config,
    prometheus_running,
    unless_stopped,
)
from batchpilot_tools.demo.view import LiveView, keep_view_fresh, say
from batchpilot_tools.demo.waste import read_slot_waste
from batchpilot_tools.loadgen import LengthDist, LoadReport, LoadSpec, run_load
from batchpilot_tools.prometheus_local import LocalPrometheus, find_binary

# Each decision reads the last few intervals (trimmed at a change by the tuner).
WINDOW_INTERVALS = 3
REQUEST_TIMEOUT_S = 60.0


def load_spec(options: DemoOptions, fleet: ProcessFleet) -> LoadSpec:
    return LoadSpec(
        urls=fleet.serving(),
        arrival="poisson",
        rate_schedule=options.offered_rate,
        duration_s=options.duration_s,
        prompt_len=LengthDist("uniform", 16, 48),
        output_len=options.profile.output_len,
        timeout_s=REQUEST_TIMEOUT_S,
    )


def tune_options(
    options: DemoOptions, fleet: ProcessFleet, prometheus_url: str | None
) -> TuneOptions:
    return TuneOptions(
        servers=tuple(fleet.serving()),
        goal=Goal(
            options.slo,
            options.batch_bounds,
            replicas=options.replica_bounds,
        ),
        cadence=Cadence(options.interval_s, WINDOW_INTERVALS * options.interval_s),
        prometheus_url=prometheus_url,
        token=ADMIN_TOKEN,
        min_requests=options.min_requests,
        config_file=fleet.config_file,
    )


async def start_prometheus(
    stack: contextlib.AsyncExitStack,
    workdir: Path,
    fleet: ProcessFleet,
    exporter: str,
    stop: asyncio.Event,
    stream: TextIO,
) -> LocalPrometheus | None:
    """Prometheus scraping the servers, or None (direct scrape) when it is not installed.
    It follows the fleet: each change rewrites its targets."""
    if find_binary() is None:
        say(stream, "prometheus not installed: the tuner scrapes the servers' /metrics itself")
        return None
    prometheus = stack.enter_context(prometheus_running(workdir, fleet.servers, exporter))
    await unless_stopped(asyncio.to_thread(prometheus.wait_for_targets_up), stop)

    async def follow(servers: list[ServerProcess]) -> None:
        await asyncio.to_thread(prometheus.reconfigure, demo_scrape_config(servers, exporter))

    fleet.on_change = follow
    say(stream, f"prometheus at {prometheus.url} (try {prometheus.url}/graph)")
    return prometheus


async def run_demo(
    options: DemoOptions, stop: asyncio.Event, stream: TextIO
) -> tuple[Recording, LoadReport | None]:
    """Start everything, run the load with the tuner in the loop, stop everything."""
    with tempfile.TemporaryDirectory(prefix="batchpilot-demo-") as tmp:
        async with contextlib.AsyncExitStack() as stack:
            workdir = Path(tmp)
            replicas = options.replicas
            servers = f"{replicas.low} server" + ("s" if replicas.low > 1 else "")
            scaling = f"the tuner scales {replicas}" if replicas.autoscaled else "a fixed fleet"
            say(stream, f"starting {servers} of {options.model} (continuous batching, batch "
                f"{INITIAL.max_batch_size} of at most {options.max_batch}, timeout "
                f"{INITIAL.batch_timeout_ms:g} ms; {scaling})")
            fleet = await stack.enter_async_context(
                ProcessFleet(options.model, workdir, options.profile.ready_timeout_s)
            )
            await unless_stopped(fleet.start(replicas.low), stop)
            options = await unless_stopped(sized_load(options, fleet, stream), stop)
            recording = Recording(options)
            exporter = stack.enter_context(policy_exporter(options))
            prometheus = None
            if options.use_prometheus:
                prometheus = await start_prometheus(stack, workdir, fleet, exporter, stop, stream)
            else:
                say(stream, "--no-prometheus: the tuner scrapes the servers' /metrics itself")
            recording.signal_source = "prometheus" if prometheus else "direct scrape"
            report = await drive(options, fleet, prometheus, recording, stop, stream)
            recording.slot_waste = await read_slot_waste(fleet.servers, fleet.retired)
            return recording, report


async def sized_load(options: DemoOptions, fleet: ProcessFleet, stream: TextIO) -> DemoOptions:
    """`options` with its base rate; unless given, measured on the first server."""
    if options.base_rate is not None:
        return options
    url = fleet.serving()[0]
    say(stream, f"measuring what one server carries: {options.max_batch} clients back to "
        f"back at batch {options.max_batch} for {measure_seconds(options):g} s")
    capacity = await measure_capacity(options, url)
    sized = dataclasses.replace(options, base_rate=capacity.base_rate(options.surge_factor))
    say(stream, f"one server carries {capacity.requests_per_s:.2f} req/s at batch "
        f"{capacity.batch}: the load is {sized.offered_rate(0):.2f} req/s, "
        f"{sized.offered_rate(sized.step_at_s):.2f} in the step and "
        f"{sized.offered_rate(sized.surge_at_s):.2f} in the surge"
        + (", which needs a second server" if options.replicas.autoscaled else ""))
    return sized


async def drive(
    options: DemoOptions,
    fleet: ProcessFleet,
    prometheus: LocalPrometheus | None,
    recording: Recording,
    stop: asyncio.Event,
    stream: TextIO,
) -> LoadReport | None:
    """The load and the tuner side by side until the load ends or a signal stops them."""
    view = LiveView(stream)
    recording.started = time.monotonic()
    tuning_done = asyncio.Event()
    load = asyncio.create_task(run_load(load_spec(options, fleet), targets=fleet.load))
    tuner = asyncio.create_task(
        tune_loop(
            tune_options(options, fleet, prometheus.url if prometheus else None),
            lambda step: record_step(recording, step),
            tuning_done,
            scaler=fleet,
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
