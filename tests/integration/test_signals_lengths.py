"""The output-length spread, the mean latency and the capacity model's inputs (arrival rate,
busy seconds per token, pods), from both signal sources, on real servers.

One server gets equal output lengths, the other a spread: each read alone
through the direct scrape and through a real Prometheus, against the lengths
the load generator asked for (ignore_eos: each request generates exactly its
max_tokens) and the latencies it measured.
"""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from batchpilot_operator.policy.mode import ModeParams
from batchpilot_operator.signals import Signals
from batchpilot_operator.signals_prometheus import PrometheusSource, selector_for_instances
from batchpilot_operator.signals_scrape import ScrapeSource
from batchpilot_server import metric_names as names
from batchpilot_tools.loadgen import LengthDist, LoadSpec, RequestResult, run_load

from tests.support.prometheus import PrometheusProcess, requires_prometheus, run_prometheus
from tests.support.servers import spawn_server, wait_ready

TOKEN_BOUNDS = (*names.GENERATION_TOKEN_BUCKETS, math.inf)
SETTLE_DEADLINE_S = 30.0
EQUAL = LengthDist("fixed", 24)
SPREAD = LengthDist("uniform", 4, 96)


def bucket_of(tokens: float) -> int:
    return int(np.searchsorted(np.asarray(TOKEN_BOUNDS), tokens, side="left"))


def reads_lengths(signals: Signals, lengths: list[int]) -> bool:
    """p50 and p90 in the bucket of the exact quantile (linear interpolation stays inside it)."""
    exact = {q: float(np.quantile(lengths, q, method="inverted_cdf")) for q in (0.5, 0.9)}
    read = {0.5: signals.output_tokens_p50, 0.9: signals.output_tokens_p90}
    return all(
        read[q] is not None and bucket_of(read[q]) == bucket_of(exact[q])  # type: ignore[arg-type]
        for q in exact
    )


@requires_prometheus
async def test_both_sources_read_the_length_spread_and_the_mean_latency(tmp_path: Path) -> None:
    with (
        spawn_server(tmp_path=tmp_path, wait=False) as equal_server,
        spawn_server(tmp_path=tmp_path, wait=False) as spread_server,
    ):
        for server in (equal_server, spread_server):  # both started before either waits
            wait_ready(server)
        urls = {"equal": equal_server.url, "spread": spread_server.url}
        hosts = [u.removeprefix("http://") for u in urls.values()]
        with run_prometheus(tmp_path, hosts) as prom:
            await asyncio.to_thread(prom.wait_for_targets_up)
            async with aiohttp.ClientSession() as session:
                scrapes = {k: ScrapeSource([u], session) for k, u in urls.items()}
                scrapes["both"] = ScrapeSource(list(urls.values()), session)
                for scrape in scrapes.values():
                    await scrape.scrape()
                started = time.monotonic()
                results: dict[str, list[RequestResult]] = {"equal": [], "spread": []}
                await asyncio.gather(
                    *(
                        run_load(
                            LoadSpec(
                                urls=[urls[k]],
                                rate=15.0,
                                duration_s=6.0,
                                prompt_len=LengthDist("fixed", 8),
                                output_len=dist,
                            ),
                            results[k].append,
                        )
                        for k, dist in (("equal", EQUAL), ("spread", SPREAD))
                    )
                )
                ok = {k: [r for r in rs if r.ok] for k, rs in results.items()}
                assert all(len(rs) >= 50 for rs in ok.values()), {k: len(v) for k, v in ok.items()}
                window = time.monotonic() - started + 1.0
                scraped = {k: await s.read(window) for k, s in scrapes.items()}

                await settle(prom, urls["equal"], len(ok["equal"]))
                await settle(prom, urls["spread"], len(ok["spread"]))
                queried_at = time.monotonic()
                # An even number of seconds: the arrival rate's half window, which PromQL
                # takes in whole seconds, is then the half the requests are counted in.
                window = 2.0 * math.ceil((queried_at - started + 5.0) / 2)
                queried = {
                    k: await PrometheusSource(prom.url, selector_for_instances(us), session).read(
                        window
                    )
                    for k, us in (*((k, [u]) for k, u in urls.items()), ("both", [*urls.values()]))
                }
                # Prometheus evaluates each query when it arrives: somewhere in between.
                queried_until = time.monotonic()
    # Every request the load generator sent arrived, whatever its outcome. The scrape's two
    # snapshots bracket the load: its counter delta counts them exactly. Prometheus reads
    # the newer half of its window, where part of the load fell; rate() extrapolates.
    for kind in ("equal", "spread"):
        sent = len(results[kind])
        arrival = scraped[kind].arrival_rate
        assert arrival is not None and arrival * scraped[kind].window_s == pytest.approx(sent)
        half = queried[kind].window_s / 2

        def in_half_ending(at: float, kind: str = kind, half: float = half) -> int:
            return sum(1 for r in results[kind] if started + r.start_s > at - half)

        earliest, latest = in_half_ending(queried_at), in_half_ending(queried_until)
        queried_arrival = queried[kind].arrival_rate
        assert queried_arrival is not None
        assert 0.75 * latest <= queried_arrival * half <= 1.33 * earliest, (latest, earliest, sent)
        busy, queried_busy = scraped[kind].busy_s_per_token, queried[kind].busy_s_per_token
        assert busy is not None and queried_busy is not None
        assert 0.8 * busy <= queried_busy <= 1.25 * busy, (busy, queried_busy)
    for source in (scraped, queried):
        assert source["both"].pods == 2 and source["equal"].pods == 1
        for kind in ("equal", "spread"):
            signals = source[kind]
            assert signals.status == "ok", signals.detail
            lengths = [r.completion_tokens for r in ok[kind]]
            assert reads_lengths(signals, lengths), (kind, signals)
            # The server times arrival to last byte; the client adds its HTTP hop.
            client_mean = float(np.mean([r.latency_s for r in ok[kind]]))
            assert signals.mean_latency_s is not None
            assert 0.5 * client_mean <= signals.mean_latency_s <= client_mean, (
                kind,
                signals.mean_latency_s,
                client_mean,
            )
            # Forward time per token: a pod is never busier than the whole window.
            utilisation = signals.utilisation
            assert utilisation is not None and 0 < utilisation <= 1, (kind, signals)
        equal, spread = source["equal"].output_spread, source["spread"].output_spread
        assert equal is not None and equal <= ModeParams().enter_spread
        assert spread is not None and spread > ModeParams().leave_spread


async def settle(prom: PrometheusProcess, url: str, requests: int) -> None:
    """Wait until Prometheus scraped every request the server finished."""
    count = f"sum({names.REQUEST_GENERATION_TOKENS}_count{{{selector_for_instances([url])}}})"
    await asyncio.to_thread(prom.wait_for_value, count, requests, SETTLE_DEADLINE_S)
