"""The demo's load, sized from what the first server carries on this machine.

A fixed rate tells a different story on every CPU: on a fast one the surge fits one
server at a larger batch and the second server never starts; on a slow one even the
step breaks the SLO. So, unless `--rate` is given, the first server is measured before
the load: `max_batch` clients back to back at the batch ceiling (the most one server
does), then the start config is put back. The surge is SURGE_OVER_CAPACITY times that,
so it needs a second server whatever the CPU, and the step (a quarter of the surge's
factor less, by default) fits one server once the batch has grown.

It runs before Prometheus starts and before the tuner's first scrape, so no tuning
window counts its requests.
"""

from __future__ import annotations

import dataclasses

import aiohttp
from batchpilot_operator.actuators import put_batching
from batchpilot_operator.tuning_loop import Refused
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.demo.options import ADMIN_TOKEN, INITIAL, DemoOptions
from batchpilot_tools.demo.supervisor import DemoError
from batchpilot_tools.loadgen import LengthDist, LoadSpec, run_load

# The surge against one server's closed-loop throughput at the batch ceiling. Open-loop
# arrivals at that rate queue past any latency SLO on one server (it would run 100 %
# busy), so a second server is needed; two servers sharing the cores with the load
# generator and Prometheus carry it (at 1.2x and 1.5x they did not, on 2 cores).
SURGE_OVER_CAPACITY = 1.0
# Seconds of measurement, at least; a real model's slower answers get two intervals.
MIN_MEASURE_S = 10.0
PROMPT_LEN = LengthDist("uniform", 16, 48)
REQUEST_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class Capacity:
    """One server's measured throughput at the batch ceiling."""

    requests_per_s: float
    batch: int
    seconds: float

    def base_rate(self, surge_factor: float) -> float:
        """The base rate whose surge is SURGE_OVER_CAPACITY times this capacity."""
        return SURGE_OVER_CAPACITY * self.requests_per_s / surge_factor


def measure_seconds(options: DemoOptions) -> float:
    return max(MIN_MEASURE_S, 2 * options.interval_s)


async def measure_capacity(options: DemoOptions, url: str) -> Capacity:
    """Closed-loop load on the server at `url` at the batch ceiling; the start config is
    back in force when this returns (or raises)."""
    ceiling = dataclasses.replace(INITIAL, max_batch_size=options.max_batch)
    seconds = measure_seconds(options)
    async with aiohttp.ClientSession() as session:
        await _put(session, url, ceiling)
        try:
            report = await run_load(LoadSpec(
                urls=[url], arrival="concurrency", concurrency=options.max_batch,
                duration_s=seconds, prompt_len=PROMPT_LEN,
                output_len=options.profile.output_len, timeout_s=REQUEST_TIMEOUT_S,
            ))  # fmt: skip
        finally:
            await _put(session, url, INITIAL)
    if report.ok == 0:
        raise DemoError(
            f"measuring the first server's capacity: none of {report.sent} requests "
            f"succeeded in {seconds:g} s ({report.errors_by_status}); give --rate to skip "
            "the measurement"
        )
    return Capacity(report.requests_per_s, options.max_batch, report.duration_s)


async def _put(session: aiohttp.ClientSession, url: str, config: BatchingConfig) -> None:
    result = await put_batching(session, url, ADMIN_TOKEN, config, url)
    if isinstance(result, Refused):
        raise DemoError(f"measuring the first server's capacity: {url} refused "
                        f"the config: {result.reason}")  # fmt: skip
