"""Both signal sources against two real servers under load and a real Prometheus."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from batchpilot_operator.policy.types import Bounds, Cadence, Goal
from batchpilot_operator.signals_prometheus import PrometheusSource, selector_for_instances
from batchpilot_operator.signals_scrape import ScrapeSource
from batchpilot_operator.slo import Slo
from batchpilot_operator.tune_local import TuneOptions, tune_loop
from batchpilot_operator.tuning_loop import TuneStep
from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.loadgen import LengthDist, LoadSpec, run_load
from prometheus_client.parser import text_string_to_metric_families

from tests.support.prometheus import requires_prometheus, run_prometheus
from tests.support.servers import spawn_server, wait_ready
from tests.support.slo_exporter import serve_slo_exporter

BOUNDS = (*names.LATENCY_BUCKETS, math.inf)
BATCH = 16
SETTLE_DEADLINE_S = 30.0


def bucket_of(value: float) -> int:
    return int(np.searchsorted(np.asarray(BOUNDS), value, side="left"))


def within_bucket_resolution(measured: float, estimate: float | None) -> bool:
    """Same histogram bucket, or the next one over (the client also times the HTTP hop)."""
    return estimate is not None and abs(bucket_of(estimate) - bucket_of(measured)) <= 1


async def pool_tokens(session: aiohttp.ClientSession, url: str) -> float:
    """The server's KV pool in tokens from vLLM's info series: blocks x block size."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        if family.name == names.VLLM_CACHE_CONFIG_INFO:
            labels = family.samples[0].labels
            return float(int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
    raise AssertionError(f"no {names.VLLM_CACHE_CONFIG_INFO} on {url}")


@requires_prometheus
async def test_p99_agrees_with_the_load_generator_and_the_tuner_rides_out_an_outage(
    tmp_path: Path,
) -> None:
    with (
        spawn_server(tmp_path=tmp_path, max_batch_size=BATCH, wait=False) as first,
        spawn_server(tmp_path=tmp_path, max_batch_size=BATCH, wait=False) as second,
    ):
        for server in (first, second):  # both started before either is waited for
            wait_ready(server)
        urls = [first.url, second.url]
        hosts = [u.removeprefix("http://") for u in urls]
        with run_prometheus(tmp_path, hosts, labels={"policy": "local"}) as prom:
            await asyncio.to_thread(prom.wait_for_targets_up)
            async with aiohttp.ClientSession() as session:
                scrape = ScrapeSource(urls, session)
                await scrape.scrape()
                started = time.monotonic()
                report = await run_load(
                    LoadSpec(
                        urls=urls,
                        rate=25.0,
                        duration_s=8.0,
                        prompt_len=LengthDist("uniform", 8, 64),
                        output_len=LengthDist("uniform", 4, 48),
                    )
                )
                assert report.ok >= 100, report.errors_by_status
                # The p99 as histogram_quantile ranks it: the ceil(0.99 n)-th smallest
                # (the load generator's interpolated p99 sits a rank lower, which at a
                # few hundred requests can be two buckets below where the top two land)
                latencies = [r.latency_s for r in report.results if r.ok]
                measured = float(np.percentile(latencies, 99, method="inverted_cdf"))

                # The direct scrape sees exactly the requests that finished.
                scraped = await scrape.read(time.monotonic() - started + 1.0)
                assert scraped.status == "ok", scraped.detail
                assert scraped.requests == report.ok
                assert within_bucket_resolution(measured, scraped.p99_latency_s), (
                    measured,
                    scraped.p99_latency_s,
                )

                # Prometheus, once it scraped the last of them, agrees.
                count = f"sum({names.REQUEST_DURATION}_count{{{selector_for_instances(urls)}}})"
                await asyncio.to_thread(prom.wait_for_value, count, report.ok, SETTLE_DEADLINE_S)
                source = PrometheusSource(prom.url, selector_for_instances(urls), session)
                window = time.monotonic() - started + 5.0
                signals = await source.read(window)
                assert signals.status == "ok", signals.detail
                assert within_bucket_resolution(measured, signals.p99_latency_s), (
                    measured,
                    signals.p99_latency_s,
                )
                assert signals.kv_usage is not None and 0 <= signals.kv_usage <= 1
                # each pod's KV pool in tokens, as vLLM's cache_config_info describes it
                pool = await pool_tokens(session, first.url)
                assert scraped.kv_pool_tokens == signals.kv_pool_tokens == pool > 0
                assert signals.mean_batch_size is not None and signals.mean_batch_size >= 1
                assert signals.tokens_per_s > 0

            # The tuner holds while Prometheus is down and resumes when it is back.
            async def outage(step: TuneStep) -> None:
                if step.index == 0:
                    await asyncio.to_thread(prom.stop)
                elif step.index == 1:
                    await asyncio.to_thread(prom.start)

            # Bounds that pin the knobs where the servers run them: every round holds, so
            # the window stays whole (a change would cut it to the last interval).
            timeout = BatchingConfig().batch_timeout_ms
            pinned = Bounds(BATCH, BATCH, timeout, timeout)
            options = TuneOptions(
                servers=tuple(urls),
                goal=Goal(Slo(e2e_s=60.0), pinned),
                prometheus_url=prom.url,
                cadence=Cadence(0.5, window + 10),
                iterations=3,
            )
            steps = await tune_loop(options, outage)
    before, during, after = (s.signals for s in steps)
    assert before.status == "ok" and after.status == "ok", (before.detail, after.detail)
    assert during.status == "no_data"
    assert f"Prometheus at {prom.url} is unreachable" in during.detail
    assert steps[1].decision.action == "hold"
    assert steps[1].decision.config == steps[1].before


@requires_prometheus
async def test_both_sources_read_the_same_slo_attainment_budget_and_step_totals(
    tmp_path: Path,
) -> None:
    """Prometheus' `increase` extrapolates to the window's ends, so its counts are not whole;
    shares of series scraped together (attainment, rows per step) agree within a percent."""
    with serve_slo_exporter() as exporter:
        selector = selector_for_instances([exporter.url])
        with run_prometheus(tmp_path, [exporter.url.removeprefix("http://")]) as prom:
            await asyncio.to_thread(prom.wait_for_targets_up)
            async with aiohttp.ClientSession() as session:
                scrape = ScrapeSource([exporter.url], session, min_requests=1)
                await scrape.scrape()
                started = time.monotonic()
                # A sample of the counters at zero inside every window read below: then a
                # scrape that lands amid the requests cannot split what `increase` sees.
                await asyncio.to_thread(prom.wait_for_scrapes_after, time.time())
                for index in range(40):
                    missed = ("ttft",) if index % 8 == 0 else ()  # 5 of 40 miss
                    exporter.request(ttft_s=0.9 if missed else 0.05, tpot_s=0.01, e2e_s=0.5,
                                     prompt=200, missed=missed)  # fmt: skip
                for _ in range(5):
                    exporter.engine_step(0.02, rows=6, prefill=256, kv=3000)
                scraped = await scrape.read(time.monotonic() - started + 1.0)
                judged = f'sum({names.REQUESTS_SLO_TOTAL}{{{selector},target="all"}})'
                await asyncio.to_thread(prom.wait_for_value, judged, 40, SETTLE_DEADLINE_S)
                # one scrape more, so that `increase` has samples after the change
                await asyncio.to_thread(prom.wait_for_scrapes_after, time.time())
                source = PrometheusSource(
                    prom.url, selector, session, min_requests=1, budget_window_s=600
                )
                signals = await source.read(time.monotonic() - started + 5.0)
    assert (scraped.slo_judged, scraped.slo_met, scraped.attainment) == (40, 35, 35 / 40)
    assert scraped.slo_missed == {"all": 5, "ttft": 5}
    assert scraped.budget_attainment == 35 / 40
    assert signals.attainment == pytest.approx(35 / 40, rel=0.01)
    assert signals.budget_attainment == pytest.approx(35 / 40, rel=0.01)
    assert signals.slo_judged == pytest.approx(40, rel=0.5)
    assert set(signals.slo_missed) == {"all", "ttft"}
    for read in (scraped, signals):
        assert bucket_of(read.ttft_p99_s or 0) == bucket_of(0.9), read.ttft_p99_s
        assert bucket_of(read.tpot_p99_s or 0) == bucket_of(0.01), read.tpot_p99_s
        assert read.steps and read.step_decode_rows == pytest.approx(6 * read.steps, rel=0.01)
        assert read.step_kv_tokens == pytest.approx(3000 * read.steps, rel=0.01)
        assert read.prompt_tokens_p50 is not None and 64 < read.prompt_tokens_p50 <= 256


@requires_prometheus
async def test_both_sources_read_each_class_beside_the_same_totals(tmp_path: Path) -> None:
    """Two classes' requests on one exporter: each source reads each class's judgement and
    p99s from the `class` label, and the totals over both, as a single-class window's."""
    with serve_slo_exporter() as exporter:
        selector = selector_for_instances([exporter.url])
        with run_prometheus(tmp_path, [exporter.url.removeprefix("http://")]) as prom:
            await asyncio.to_thread(prom.wait_for_targets_up)
            async with aiohttp.ClientSession() as session:
                for slo_class in ("interactive", "batch"):
                    exporter.declare_class(slo_class)
                scrape = ScrapeSource([exporter.url], session, min_requests=1)
                await scrape.scrape()
                started = time.monotonic()
                await asyncio.to_thread(prom.wait_for_scrapes_after, time.time())
                for index in range(20):  # interactive: fast, 4 of 20 miss their ttft
                    missed = ("ttft",) if index % 5 == 0 else ()
                    exporter.request(ttft_s=0.05, tpot_s=0.01, e2e_s=0.3, prompt=100,
                                     missed=missed, slo_class="interactive")  # fmt: skip
                for _ in range(10):  # batch: slow, every one met
                    exporter.request(ttft_s=2.0, tpot_s=0.1, e2e_s=30.0, prompt=3000,
                                     missed=(), slo_class="batch")  # fmt: skip
                scraped = await scrape.read(time.monotonic() - started + 1.0)
                judged = f'sum({names.REQUESTS_SLO_TOTAL}{{{selector},target="all"}})'
                await asyncio.to_thread(prom.wait_for_value, judged, 30, SETTLE_DEADLINE_S)
                await asyncio.to_thread(prom.wait_for_scrapes_after, time.time())
                source = PrometheusSource(
                    prom.url, selector, session, min_requests=1, budget_window_s=600
                )
                signals = await source.read(time.monotonic() - started + 5.0)
    assert (scraped.slo_judged, scraped.slo_met) == (30, 26)
    assert signals.attainment == pytest.approx(26 / 30, rel=0.01)
    for read in (scraped, signals):
        interactive, batch = read.classes["interactive"], read.classes["batch"]
        assert interactive.attainment == pytest.approx(16 / 20, rel=0.01), read.classes
        assert batch.attainment == 1.0
        assert set(interactive.slo_missed) == {"all", "ttft"} and not any(batch.slo_missed.values())
        assert interactive.budget_attainment == pytest.approx(16 / 20, rel=0.01)
        assert bucket_of(interactive.ttft_p99_s or 0) == bucket_of(0.05)
        assert bucket_of(batch.ttft_p99_s or 0) == bucket_of(2.0)
        assert bucket_of(batch.p99_latency_s or 0) == bucket_of(30.0)
        assert bucket_of(interactive.tpot_p99_s or 0) == bucket_of(0.01)
        # each class's prompts, by their own buckets (16, 64, 256, 1024, 4096)
        assert 64 < (interactive.prompt_tokens_p50 or 0) <= 256
        assert 1024 < (batch.prompt_tokens_p50 or 0) <= 4096
        assert read.classes["default"].slo_judged == 0  # its series exist, at zero
    assert (scraped.classes["interactive"].slo_judged, scraped.classes["batch"].slo_judged) == (
        20, 10,
    )  # fmt: skip
