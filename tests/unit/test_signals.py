"""Signal arithmetic: quantiles from buckets, traffic classes, window deltas of a scrape."""

from __future__ import annotations

import math

import aiohttp
import numpy as np
import pytest
from batchpilot_operator.signal_fields import WindowTotals, bucket_quantile, signals_from
from batchpilot_operator.signals import histogram_quantile, status_detail, traffic_status
from batchpilot_operator.signals_prometheus import _window_totals as prometheus_totals
from batchpilot_operator.signals_prometheus import queries
from batchpilot_operator.signals_scrape import ScrapeSource, Totals, _window_totals, parse_metrics
from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine_api import EngineStats
from batchpilot_server.http.metrics import ServerMetrics

from tests.support.slo_exporter import serve_slo_exporter

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
    [
        (0, 0, "no_traffic"),
        (0, 3, "too_little_traffic"),
        (49, 0, "too_little_traffic"),
        (50, 0, "ok"),
        (12, 50, "ok"),
        (12, 38, "ok"),
        (12, 5, "too_little_traffic"),
        (10, 10, "ok"),
        (10, 9, "too_little_traffic"),
        (0, 300, "too_little_traffic"),
    ],
)
def test_traffic_classes(requests: float, waiting: float, status: str) -> None:
    assert traffic_status(requests, waiting, 0.0, min_requests=50) == status


@pytest.mark.parametrize(
    ("requests", "waiting", "running", "status"),
    [(3, 0, 64, "ok"),  # a full batch of long answers, a few of them finishing
     (12, 3, 35, "ok"),  # 50 finished, waiting and running together
     (10, 0, 10, "ok"),  # as many run as finished: the requests outlast the window
     (10, 4, 6, "ok"),  # as many run and wait together
     (10, 0, 9, "too_little_traffic"), (12, 2, 5, "too_little_traffic"),
     (0, 0, 64, "too_little_traffic"),  # nothing finished: no latency, but not no traffic
     (0, 2, 64, "too_little_traffic")],
)  # fmt: skip
def test_what_runs_is_evidence_as_what_waits(
    requests: float, waiting: float, running: float, status: str
) -> None:
    assert traffic_status(requests, waiting, running, min_requests=50) == status


def test_the_detail_says_what_runs_and_waits_when_too_little_finished() -> None:
    def detail(requests: float, waiting: float, running: float) -> str:
        status = traffic_status(requests, waiting, running, min_requests=50)
        return status_detail(status, requests, waiting, running, min_requests=50)

    assert detail(0, 0, 0) == "no request finished in the window and none is waiting or running"
    assert detail(0, 3, 64) == (
        "no request finished in the window while 64 run and 3 wait: no latency to read yet"
    )
    assert detail(12, 2, 5).startswith(
        "only 12 requests finished in the window, and fewer run and wait (5 running, 2 waiting;"
    )
    assert detail(3, 0, 64) == ""


def test_prometheus_reads_what_runs_summed_over_pods() -> None:
    running = queries('policy="p"', 60.0)[f"now:{names.REQUESTS_RUNNING}"]
    assert running == f'sum({names.REQUESTS_RUNNING}{{policy="p"}})'


async def test_the_scrape_counts_what_runs_on_every_pod_as_evidence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two pods with full batches of long answers (32 running each): a window in which
    none finished holds and says why; one in which 3 finished is judged (3 finished and
    none waiting alone were too little)."""
    pods = {url: ServerMetrics(model="tiny", mode="continuous") for url in ("http://a", "http://b")}
    busy = EngineStats(running=32, waiting=0, kv_blocks_total=100, kv_blocks_used=90)
    clock = [0.0]

    async def page(url: str) -> str:
        return pods[url].exposition(busy).decode()

    async with aiohttp.ClientSession() as session:
        source = ScrapeSource(list(pods), session, clock=lambda: clock[0])
        monkeypatch.setattr(source, "_fetch", page)
        await source.scrape()
        clock[0] = 60.0
        nothing = await source.read(60.0)
        for seconds in (20.0, 25.0, 31.0):
            pods["http://a"].request_duration.observe(seconds)
        clock[0] = 120.0
        few = await source.read(60.0)
    assert (nothing.status, nothing.running, nothing.waiting) == ("too_little_traffic", 64, 0)
    assert nothing.p99_latency_s is None and "while 64 run and 0 wait" in nothing.detail
    assert (few.status, few.running, few.requests) == ("ok", 64, 3)
    assert few.p99_latency_s is not None and bucket_of(few.p99_latency_s) == bucket_of(31.0)


def test_parse_and_delta_of_a_real_metrics_page() -> None:
    """The server's own registry, observed twice: the delta holds only what came between."""
    metrics = ServerMetrics(model="tiny", mode="continuous")
    metrics.set_config(BatchingConfig())
    stats = EngineStats(running=3, waiting=2, kv_blocks_total=10, kv_blocks_used=4)
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
    median = bucket_quantile(0.5, delta.buckets[names.REQUEST_DURATION])
    assert median is not None and bucket_of(median) == bucket_of(0.12)
    assert after.gauges[names.KV_CACHE_USAGE] == pytest.approx(stats.kv_usage_ratio)
    assert after.gauges[names.REQUESTS_WAITING] == stats.waiting
    assert after.gauges[names.REQUESTS_RUNNING] == stats.running


def test_a_counter_that_went_down_counts_from_zero() -> None:
    earlier = Totals(counts={names.PREEMPTIONS_TOTAL: 40.0})
    restarted = Totals(counts={names.PREEMPTIONS_TOTAL: 3.0})
    assert restarted.minus(earlier).counts[names.PREEMPTIONS_TOTAL] == 3.0


async def test_the_scrape_reads_the_slo_judgement_lengths_and_step_totals() -> None:
    """Exact counts of a window, and the budget's attainment since the budget window's start
    (since the first scrape, until the source has run that long)."""
    clock = [0.0]
    with serve_slo_exporter() as exporter:
        async with aiohttp.ClientSession() as session:
            source = ScrapeSource(
                [exporter.url], session, min_requests=1, clock=lambda: clock[0],
                budget_window_s=120.0,
            )  # fmt: skip
            await source.scrape()
            # before the window: 4 met, 4 missed (the budget counts these, the window not)
            for missed in [(), (), (), (), ("ttft",), ("ttft",), ("tpot",), ("ttft", "tpot")]:
                exporter.request(ttft_s=0.1, tpot_s=0.02, e2e_s=1.0, prompt=100, missed=missed)
            clock[0] = 60.0
            await source.read(60.0)
            for _ in range(9):
                exporter.request(ttft_s=0.1, tpot_s=0.02, e2e_s=1.0, prompt=100, missed=())
            exporter.request(ttft_s=2.0, tpot_s=0.2, e2e_s=9.0, prompt=3000,
                             missed=("ttft", "tpot"))  # fmt: skip
            for _ in range(3):
                exporter.engine_step(0.05, rows=8, prefill=512, kv=4000)
            clock[0] = 120.0
            signals = await source.read(60.0)
    assert (signals.slo_judged, signals.slo_met, signals.attainment) == (10, 9, 0.9)
    assert signals.slo_missed == {"all": 1, "ttft": 1, "tpot": 1}
    assert signals.budget_attainment == 13 / 18  # both windows, since the first scrape
    assert signals.ttft_p99_s is not None and bucket_of(signals.ttft_p99_s) == bucket_of(2.0)
    assert signals.tpot_p99_s is not None and bucket_of(signals.tpot_p99_s) == bucket_of(0.2)
    assert signals.prompt_tokens_p50 is not None and signals.prompt_tokens_p50 <= 256
    assert signals.prompt_tokens_p99 is not None and signals.prompt_tokens_p99 > 1024
    assert (signals.steps, signals.step_decode_rows) == (3, 24)
    assert (signals.step_prefill_tokens, signals.step_kv_tokens) == (1536, 12000)
    assert signals.step_seconds == pytest.approx(0.15)


async def test_an_older_server_without_slo_series_leaves_them_none() -> None:
    metrics = ServerMetrics(model="tiny", mode="continuous")
    metrics.request_duration.observe(0.2)
    today = metrics.exposition(EngineStats(0, 0, 10, 0)).decode().splitlines()
    newer = (names.REQUESTS_SLO_TOTAL, names.REQUEST_TIME_PER_OUTPUT_TOKEN)
    older = "\n".join(line for line in today if not any(name in line for name in newer))
    assert parse_metrics("\n".join(today)).slo  # today's server has the series, at 0
    totals = parse_metrics(older)
    assert totals.slo == {}
    assert parse_metrics("").slo == {}


def test_the_scrape_sums_every_class_into_the_window_totals() -> None:
    # the operator's totals stay over all requests once the pods count by class
    metrics = ServerMetrics(model="tiny", mode="continuous")
    for slo_class, seconds in (("default", 0.1), ("chat", 0.2), ("batch", 0.3)):
        metrics.request_duration.observe(seconds, slo_class)
        metrics.count_slo({"e2e": True, names.SLO_ALL: True}, slo_class)
    totals = parse_metrics(metrics.exposition(EngineStats(0, 0, 10, 0)).decode())
    assert totals.counts[names.REQUEST_DURATION] == 3
    assert totals.sums[names.REQUEST_DURATION] == pytest.approx(0.6)
    assert totals.slo[("met", names.SLO_ALL)] == 3


def test_the_prometheus_queries_sum_over_the_class_label() -> None:
    # every totals query aggregates with sum or `sum by` of labels other than class: a
    # class label adds series, never a result per class; the class_ queries split by it
    for key, query in queries('policy="p"', 60.0).items():
        assert query.startswith(("sum", "count(", "max(", "min(")) or " / " in query
        if key.startswith("class_"):
            assert query.startswith(f"sum by ({names.CLASS_LABEL}"), key
        else:
            assert names.CLASS_LABEL not in query, key


def two_class_page(
    metrics: ServerMetrics, chat: int, batch: int, waiting: dict[str, int] | None = None
) -> str:
    """`chat` chat requests (fast, all met) and `batch` batch requests (slow, one in four
    missing e2e) more on the page; `waiting`: the engine's waiting requests by class."""
    for _ in range(chat):
        metrics.ttft.observe(0.1, "chat")
        metrics.request_duration.observe(0.5, "chat")
        metrics.request_prompt_tokens.observe(100, "chat")
        metrics.request_generation_tokens.observe(200, "chat")
        metrics.count_slo({"ttft": True, names.SLO_ALL: True}, "chat")
    for i in range(batch):
        metrics.ttft.observe(3.0, "batch")
        metrics.request_duration.observe(40.0, "batch")
        metrics.request_prompt_tokens.observe(4000, "batch")
        metrics.request_generation_tokens.observe(100, "batch")
        met = i % 4 != 0
        metrics.count_slo({"e2e": met, names.SLO_ALL: met}, "batch")
    by_class = waiting or {}
    stats = EngineStats(running=0, waiting=sum(by_class.values()), kv_blocks_total=10,
                        kv_blocks_used=0, waiting_by_class=by_class)  # fmt: skip
    return metrics.exposition(stats).decode()


def test_the_scrape_reads_each_class_beside_the_totals() -> None:
    metrics = ServerMetrics(model="tiny", mode="continuous")
    before = parse_metrics(two_class_page(metrics, 5, 4))
    after = parse_metrics(two_class_page(metrics, 20, 40))
    totals = _window_totals([after.minus(before)], 60.0)
    signals = signals_from(totals, min_requests=1)
    assert (signals.slo_judged, signals.slo_met) == (60, 50)  # the totals: every class
    assert set(signals.classes) == {"chat", "batch", "default"}
    chat, batch = signals.classes["chat"], signals.classes["batch"]
    assert (chat.slo_judged, chat.attainment) == (20, 1.0)
    assert (batch.slo_judged, batch.slo_met, batch.slo_missed["e2e"]) == (40, 30, 10)
    assert chat.ttft_p99_s is not None and bucket_of(chat.ttft_p99_s) == bucket_of(0.1)
    assert batch.ttft_p99_s is not None and bucket_of(batch.ttft_p99_s) == bucket_of(3.0)
    assert batch.p99_latency_s is not None and bucket_of(batch.p99_latency_s) == bucket_of(40.0)
    assert chat.tpot_p99_s is None  # nothing observed
    assert signals.classes["default"].slo_judged == 0
    # each class's lengths from its own series; the totals' over both
    assert chat.prompt_tokens_p99 is not None and chat.prompt_tokens_p99 <= 128
    assert batch.prompt_tokens_p10 is not None and batch.prompt_tokens_p10 > 2048
    assert chat.output_tokens_p50 is not None and chat.output_tokens_p50 > 128
    assert batch.output_tokens_p99 is not None and batch.output_tokens_p99 <= 128
    assert signals.prompt_tokens_p10 is not None and signals.prompt_tokens_p10 <= 128
    assert signals.prompt_tokens_p99 is not None and signals.prompt_tokens_p99 > 2048
    assert signals.classes["default"].prompt_tokens_p50 is None


async def test_the_scrape_reads_each_class_waiting_now_summed_over_pods(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The waiting gauge by class is read at the window's end, not as an increase: the
    chat class's requests waiting at the first scrape were scheduled since (its gauge
    back at 0); the batch class's wait on both pods."""
    pods = {url: ServerMetrics(model="tiny", mode="continuous") for url in ("http://a", "http://b")}
    waiting = {"http://a": {"chat": 3}, "http://b": {"batch": 1}}
    clock = [0.0]

    async def page(url: str) -> str:
        return two_class_page(pods[url], 10, 10, waiting=waiting[url])

    async with aiohttp.ClientSession() as session:
        source = ScrapeSource(list(pods), session, clock=lambda: clock[0])
        monkeypatch.setattr(source, "_fetch", page)
        await source.scrape()
        waiting = {"http://a": {"batch": 4}, "http://b": {"batch": 3}}
        clock[0] = 60.0
        signals = await source.read(60.0)
    assert signals.waiting == 7
    by_class = {name: c.waiting for name, c in signals.classes.items()}
    assert by_class == {"chat": 0.0, "batch": 7.0, "default": 0.0}


def test_prometheus_answers_by_class_become_each_class_signals() -> None:
    label = names.CLASS_LABEL
    answers: dict[str, list[tuple[dict[str, str], float]]] = {
        key: [] for key in queries('policy="p"', 60.0)
    }
    answers[f"buckets:{names.REQUEST_DURATION}"] = [({"le": "1"}, 10.0), ({"le": "+Inf"}, 12.0)]
    answers[f"count:{names.REQUEST_DURATION}"] = [({}, 12.0)]
    answers[f"class_buckets:{names.TIME_TO_FIRST_TOKEN}"] = [
        ({label: "chat", "le": "0.25"}, 10.0), ({label: "chat", "le": "+Inf"}, 10.0),
        ({label: "batch", "le": "0.25"}, 0.0), ({label: "batch", "le": "+Inf"}, 2.0),
        ({"le": "+Inf"}, 5.0),  # an older server's series, without the label: totals only
    ]  # fmt: skip
    answers["class_slo"] = [
        ({label: "chat", "result": "met", "target": "all"}, 10.0),
        ({label: "batch", "result": "met", "target": "all"}, 1.0),
        ({label: "batch", "result": "missed", "target": "all"}, 1.0),
        ({label: "batch", "result": "missed", "target": "e2e"}, 1.0),
    ]
    answers["class_budget"] = [
        ({label: "chat", "result": "met"}, 99.0), ({label: "chat", "result": "missed"}, 1.0),
        ({label: "batch", "result": "missed"}, 4.0),
    ]  # fmt: skip
    answers["class_waiting"] = [
        ({label: "chat"}, 0.0), ({label: "batch"}, 40.0),
        ({}, 5.0),  # an older server's series, without the label: totals only
    ]  # fmt: skip
    answers[f"class_buckets:{names.REQUEST_PROMPT_TOKENS}"] = [
        ({label: "chat", "le": "256"}, 10.0), ({label: "chat", "le": "+Inf"}, 10.0),
        ({label: "batch", "le": "256"}, 0.0), ({label: "batch", "le": "+Inf"}, 2.0),
    ]  # fmt: skip
    signals = signals_from(prometheus_totals(answers, 60.0), min_requests=1)
    chat, batch = signals.classes["chat"], signals.classes["batch"]
    assert chat.prompt_tokens_p99 is not None and chat.prompt_tokens_p99 <= 256
    assert batch.prompt_tokens_p10 == 256  # the +Inf bucket answers the last finite bound
    assert chat.output_tokens_p50 is None  # not exported by class (an older server)
    assert (chat.waiting, batch.waiting) == (0.0, 40.0)
    assert (chat.attainment, batch.attainment, batch.slo_missed) == (1.0, 0.5, {"all": 1, "e2e": 1})
    assert (chat.budget_attainment, batch.budget_attainment) == (0.99, 0.0)
    assert chat.ttft_p99_s is not None and chat.ttft_p99_s <= 0.25
    assert batch.ttft_p99_s == 0.25  # the +Inf bucket answers the last finite bound
    assert set(signals.classes) == {"chat", "batch"}


def test_the_spec_decode_counters_become_draft_and_accepted_tokens_per_second() -> None:
    """The server's own counters through the scrape's parse and delta: 40 of 100 drafted
    tokens accepted in a 10 s window; the Prometheus source reads the same counters."""
    metrics = ServerMetrics(model="tiny", mode="continuous")
    stats = EngineStats(running=0, waiting=0, kv_blocks_total=10, kv_blocks_used=0)
    before = parse_metrics(metrics.exposition(stats).decode())
    metrics.on_spec_decode(drafted=[4] * 25, accepted=[2, 0] * 10 + [4] * 5)
    delta = parse_metrics(metrics.exposition(stats).decode()).minus(before)
    signals = signals_from(WindowTotals(window_s=10.0, counts=delta.counts))
    assert (signals.spec_draft_tokens_per_s, signals.spec_accepted_tokens_per_s) == (10.0, 4.0)
    assert signals.spec_acceptance == pytest.approx(0.4)
    # no drafts (k = 0, or a server from before speculative decoding): no acceptance
    assert signals_from(WindowTotals(window_s=10.0)).spec_acceptance is None
    asked = queries('policy="p"', 60.0)
    assert f"count:{names.SPEC_ACCEPTED_TOKENS_TOTAL}" in asked
