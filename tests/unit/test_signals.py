"""Signal arithmetic: quantiles from buckets, traffic classes, window deltas of a scrape."""

from __future__ import annotations

import math

import numpy as np
import pytest
from batchpilot_operator.signals import histogram_quantile, traffic_status
from batchpilot_operator.signals_scrape import Totals, parse_metrics, quantile_from_buckets
from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine_api import EngineStats
from batchpilot_server.metrics import ServerMetrics

BOUNDS = (*names.LATENCY_BUCKETS, math.inf)


def cumulative(values: list[float]) -> list[float]:
    index = np.searchsorted(np.asarray(names.LATENCY_BUCKETS), values, side="left")
    return np.cumsum(np.bincount(index, minlength=len(BOUNDS))).tolist()


def bucket_of(value: float) -> int:
    return int(np.searchsorted(np.asarray(BOUNDS), value, side="left"))


@pytest.mark.parametrize("seed", range(5))
def test_quantile_lands_in_the_bucket_of_the_exact_quantile(seed: int) -> None:
    values = np.random.default_rng(seed).lognormal(np.log(0.2), 0.8, 2000).tolist()
    exact = float(np.quantile(values, 0.99, method="inverted_cdf"))
    estimate = histogram_quantile(0.99, BOUNDS, cumulative(values))
    assert estimate is not None
    assert bucket_of(estimate) == bucket_of(exact)


def test_quantile_interpolates_linearly_inside_a_bucket() -> None:
    # 100 observations spread over (0.1, 0.15]: the median sits mid-bucket.
    values = [0.1 + 0.05 * (i + 0.5) / 100 for i in range(100)]
    assert histogram_quantile(0.5, BOUNDS, cumulative(values)) == pytest.approx(0.125)


def test_quantile_in_the_inf_bucket_answers_the_last_finite_bound() -> None:
    assert histogram_quantile(0.99, BOUNDS, cumulative([100.0] * 10)) == names.LATENCY_BUCKETS[-1]


def test_quantile_of_nothing_is_none_and_bad_input_is_refused() -> None:
    assert histogram_quantile(0.99, BOUNDS, [0.0] * len(BOUNDS)) is None
    with pytest.raises(ValueError, match="quantile"):
        histogram_quantile(1.5, BOUNDS, cumulative([0.1]))
    with pytest.raises(ValueError, match="equal length"):
        histogram_quantile(0.5, BOUNDS, [1.0])


@pytest.mark.parametrize(
    ("requests", "waiting", "status"),
    [(0, 0, "no_traffic"), (0, 3, "too_little_traffic"), (49, 0, "too_little_traffic"),
     (50, 0, "ok"), (12, 50, "ok"), (12, 38, "ok"), (12, 5, "too_little_traffic"),
     (10, 10, "ok"), (10, 9, "too_little_traffic"), (0, 300, "too_little_traffic")],
)
def test_traffic_classes(requests: float, waiting: float, status: str) -> None:
    assert traffic_status(requests, waiting, 50) == status


def test_parse_and_delta_of_a_real_metrics_page() -> None:
    """The server's own registry, observed twice: the delta holds only what came between."""
    metrics = ServerMetrics(model="tiny", mode="continuous")
    metrics.set_config(BatchingConfig())
    stats = EngineStats(running=0, waiting=2, kv_blocks_total=10, kv_blocks_used=4)
    before_values = [0.05, 0.3]
    after_values = [0.12, 0.12, 2.5]
    for v in before_values:
        metrics.request_duration.observe(v)
    before = parse_metrics(metrics.exposition(stats).decode())
    for v in after_values:
        metrics.request_duration.observe(v)
    after = parse_metrics(metrics.exposition(stats).decode())
    delta = after.minus(before)
    assert delta.counts[names.REQUEST_DURATION] == len(after_values)
    assert delta.sums[names.REQUEST_DURATION] == pytest.approx(sum(after_values))
    median = quantile_from_buckets(0.5, delta.buckets[names.REQUEST_DURATION])
    assert median is not None and bucket_of(median) == bucket_of(0.12)
    assert after.gauges[names.KV_CACHE_USAGE] == pytest.approx(stats.kv_usage_ratio)
    assert after.gauges[names.REQUESTS_WAITING] == stats.waiting


def test_a_counter_that_went_down_counts_from_zero() -> None:
    earlier = Totals(counts={names.PREEMPTIONS_TOTAL: 40.0})
    restarted = Totals(counts={names.PREEMPTIONS_TOTAL: 3.0})
    assert restarted.minus(earlier).counts[names.PREEMPTIONS_TOTAL] == 3.0
