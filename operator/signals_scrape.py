"""Signals from a direct scrape of the servers' `/metrics`, for when no Prometheus is set.

Each `read` scrapes every server, keeps the snapshot, and computes window
deltas locally against the oldest snapshot still inside the window, summed
over servers: the same arithmetic PromQL's `increase` and
`histogram_quantile` do, so both sources mean the same by "p99 over 60 s".
A counter that went down (the server restarted) counts from zero, as in
Prometheus.

The error budget's attainment (`budget_attainment`) is counted the same way,
from a snapshot about one budget window old. A scrape knows only what it has
seen: until the source has run a whole budget window, it counts since its
first scrape (and over the servers seen at both ends), where Prometheus would
count the whole window.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
from batchpilot_operator.signals import (
    MIN_REQUESTS_PER_WINDOW,
    Signals,
    histogram_quantile,
    no_data,
    status_detail,
    traffic_status,
)
from batchpilot_operator.slo import DEFAULT_BUDGET_WINDOW_S
from batchpilot_server import metric_names as names
from prometheus_client.parser import text_string_to_metric_families

K = TypeVar("K")
SCRAPE_TIMEOUT_S = 5.0
# A timer that fires a little early still counts the previous read as the window start.
SCHEDULING_SLACK_S = 0.25
SCHEDULING_SLACK_SHARE = 0.05
# The budget window is kept as this many snapshots, evenly spaced, at most.
BUDGET_MARKS = 60
HISTOGRAMS = (
    names.REQUEST_DURATION, names.QUEUE_WAIT, names.BATCH_SIZE, names.REQUEST_GENERATION_TOKENS,
    names.TIME_TO_FIRST_TOKEN, names.REQUEST_TIME_PER_OUTPUT_TOKEN, names.REQUEST_PROMPT_TOKENS,
    names.STEP_DURATION,
)
COUNTERS = (
    names.REQUESTS_TOTAL, names.REQUESTS_ARRIVED_TOTAL, names.GENERATION_TOKENS_TOTAL,
    names.PREEMPTIONS_TOTAL, names.ENGINE_BUSY_SECONDS_TOTAL,
    names.STEP_DECODE_ROWS_TOTAL, names.STEP_PREFILL_TOKENS_TOTAL,
    names.STEP_KV_TOKENS_TOTAL,
)
GAUGES = (names.KV_CACHE_USAGE, names.REQUESTS_WAITING, names.REQUESTS_RUNNING)


@dataclass
class Totals:
    """One server's cumulative values at one scrape."""

    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> n
    counts: dict[str, float] = field(default_factory=dict)  # histogram _count, counters
    sums: dict[str, float] = field(default_factory=dict)  # histogram _sum
    gauges: dict[str, float] = field(default_factory=dict)
    slo: dict[tuple[str, str], float] = field(default_factory=dict)  # (result, target) -> n

    def minus(self, earlier: Totals) -> Totals:
        """Increase since `earlier`; a value that went down restarted from zero."""
        return Totals(
            buckets={
                name: _increases(per, earlier.buckets.get(name, {}))
                for name, per in self.buckets.items()
            },
            counts=_increases(self.counts, earlier.counts),
            sums=_increases(self.sums, earlier.sums),
            gauges=dict(self.gauges),
            slo=_increases(self.slo, earlier.slo),
        )


def _increases(now: Mapping[K, float], before: Mapping[K, float]) -> dict[K, float]:
    return {key: _increase(value, before.get(key)) for key, value in now.items()}


def _increase(now: float, before: float | None) -> float:
    if before is None or now < before:
        return now
    return now - before


def parse_metrics(text: str) -> Totals:
    """The series the tuner needs from one `/metrics` page, summed over label sets."""
    totals = Totals()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, value = sample.name, float(sample.value)
            if name.endswith("_bucket") and name.removesuffix("_bucket") in HISTOGRAMS:
                base = name.removesuffix("_bucket")
                le = float(sample.labels["le"])
                per = totals.buckets.setdefault(base, {})
                per[le] = per.get(le, 0.0) + value
            elif name.endswith("_count") and name.removesuffix("_count") in HISTOGRAMS:
                _add(totals.counts, name.removesuffix("_count"), value)
            elif name.endswith("_sum") and name.removesuffix("_sum") in HISTOGRAMS:
                _add(totals.sums, name.removesuffix("_sum"), value)
            elif name in COUNTERS:
                _add(totals.counts, name, value)
            elif name in GAUGES:
                _add(totals.gauges, name, value)
            elif name == names.REQUESTS_SLO_TOTAL:
                key = (sample.labels.get("result", ""), sample.labels.get("target", ""))
                totals.slo[key] = totals.slo.get(key, 0.0) + value
    return totals


def _add(into: dict[str, float], key: str, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


def quantile_from_buckets(q: float, buckets: dict[float, float]) -> float | None:
    if not buckets:
        return None
    bounds = sorted(buckets)
    return histogram_quantile(q, bounds, [buckets[b] for b in bounds])


@dataclass
class Snapshot:
    at: float
    per_server: dict[str, Totals]


class ScrapeSource:
    """Scrapes servers' `/metrics` and turns the last window into `Signals`."""

    def __init__(
        self,
        urls: Sequence[str],
        session: aiohttp.ClientSession,
        *,
        min_requests: int = MIN_REQUESTS_PER_WINDOW,
        clock: Callable[[], float] = time.monotonic,
        budget_window_s: float = DEFAULT_BUDGET_WINDOW_S,
    ) -> None:
        if not urls:
            raise ValueError("the scrape source needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.session = session
        self.min_requests = min_requests
        self.clock = clock
        self.history: list[Snapshot] = []
        self.errors: dict[str, str] = {}
        self.budget_window_s = budget_window_s
        self.budget_marks: list[Snapshot] = []  # the budget window's baselines, oldest first

    async def scrape(self) -> Snapshot:
        """Scrape every server now; unreachable ones are left out and noted in `errors`."""
        pages = await asyncio.gather(*(self._fetch(url) for url in self.urls))
        snapshot = Snapshot(self.clock(), {})
        self.errors = {}
        for url, page in zip(self.urls, pages, strict=True):
            if isinstance(page, str):
                snapshot.per_server[url] = parse_metrics(page)
            else:
                self.errors[url] = str(page)
        self.history.append(snapshot)
        self._mark_budget(snapshot)
        return snapshot

    def _mark_budget(self, snapshot: Snapshot) -> None:
        """Keep a few snapshots spanning the budget window: the oldest still at or past
        its start is the error budget's baseline."""
        spacing = self.budget_window_s / BUDGET_MARKS
        if not self.budget_marks or snapshot.at - self.budget_marks[-1].at >= spacing:
            self.budget_marks.append(snapshot)
        start = snapshot.at - self.budget_window_s
        while len(self.budget_marks) > 1 and self.budget_marks[1].at <= start:
            self.budget_marks.pop(0)

    async def _fetch(self, url: str) -> str | Exception:
        try:
            timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
            async with self.session.get(f"{url}/metrics", timeout=timeout) as response:
                if response.status != 200:
                    return RuntimeError(f"GET {url}/metrics answered {response.status}")
                return await response.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return RuntimeError(f"cannot scrape {url}/metrics: {exc or type(exc).__name__}")

    async def read(self, window_s: float) -> Signals:
        """Scrape now and return the signals over (at least) the last `window_s` seconds."""
        now = await self.scrape()
        if not now.per_server:
            return no_data("; ".join(self.errors.values()), window_s)
        baseline = self._baseline(now.at - window_s, exclude=now)
        if baseline is None:
            return no_data("first scrape: the next one opens the window", window_s)
        self.history = [s for s in self.history if s.at >= baseline.at]
        return self._signals(baseline, now)

    def _baseline(self, since: float, exclude: Snapshot) -> Snapshot | None:
        """The newest snapshot at or before `since`, else the oldest there is.

        Reads come late when servers are busy; the window then spans a little
        more than asked, never a blend reaching before the previous read.
        """
        earlier = [s for s in self.history if s is not exclude]
        if not earlier:
            return None
        slack = max(SCHEDULING_SLACK_S, SCHEDULING_SLACK_SHARE * (exclude.at - since))
        at_or_before = [s for s in earlier if s.at <= since + slack]
        return at_or_before[-1] if at_or_before else earlier[0]

    def _signals(self, baseline: Snapshot, now: Snapshot) -> Signals:
        window_s = now.at - baseline.at
        deltas = [
            totals.minus(baseline.per_server[url])
            for url, totals in now.per_server.items()
            if url in baseline.per_server
        ]
        if not deltas:
            return no_data("no server answered both scrapes of the window", window_s)
        duration = _merged_buckets(deltas, names.REQUEST_DURATION)
        if not duration:
            return no_data(f"no {names.REQUEST_DURATION} series on the servers", window_s)
        requests = _total(deltas, names.REQUEST_DURATION)
        waiting = _gauge_sum(now, names.REQUESTS_WAITING)
        running = _gauge_sum(now, names.REQUESTS_RUNNING)
        status = traffic_status(requests, waiting, running, min_requests=self.min_requests)
        detail = status_detail(status, requests, waiting, running, min_requests=self.min_requests)
        if self.errors:
            detail = "; ".join([detail, *self.errors.values()]).lstrip("; ")
        lengths = _merged_buckets(deltas, names.REQUEST_GENERATION_TOKENS)
        prompts = _merged_buckets(deltas, names.REQUEST_PROMPT_TOKENS)
        judged, met = _judged(deltas)
        return Signals(
            status=status,
            window_s=window_s,
            requests=requests,
            request_rate=_total(deltas, names.REQUESTS_TOTAL) / window_s,
            p99_latency_s=quantile_from_buckets(0.99, duration) if status == "ok" else None,
            queue_wait_p99_s=quantile_from_buckets(
                0.99, _merged_buckets(deltas, names.QUEUE_WAIT)
            ),
            kv_usage=self._kv_max(baseline.at),
            waiting=waiting,
            running=running,
            preemption_rate=_total(deltas, names.PREEMPTIONS_TOTAL) / window_s,
            tokens_per_s=_total(deltas, names.GENERATION_TOKENS_TOTAL) / window_s,
            mean_batch_size=_mean(deltas, names.BATCH_SIZE),
            mean_latency_s=_mean(deltas, names.REQUEST_DURATION),
            output_tokens_p10=quantile_from_buckets(0.1, lengths),
            output_tokens_p50=quantile_from_buckets(0.5, lengths),
            output_tokens_p90=quantile_from_buckets(0.9, lengths),
            output_tokens_p99=quantile_from_buckets(0.99, lengths),
            arrival_rate=self._arrival_rate(baseline, now),
            busy_s_per_token=_busy_per_token(deltas),
            pods=len(deltas),
            ttft_p99_s=quantile_from_buckets(
                0.99, _merged_buckets(deltas, names.TIME_TO_FIRST_TOKEN)
            ),
            tpot_p99_s=quantile_from_buckets(
                0.99, _merged_buckets(deltas, names.REQUEST_TIME_PER_OUTPUT_TOKEN)
            ),
            slo_judged=judged,
            slo_met=met,
            slo_missed=_missed(deltas),
            budget_attainment=self._budget_attainment(now),
            prompt_tokens_p10=quantile_from_buckets(0.1, prompts),
            prompt_tokens_p50=quantile_from_buckets(0.5, prompts),
            prompt_tokens_p90=quantile_from_buckets(0.9, prompts),
            prompt_tokens_p99=quantile_from_buckets(0.99, prompts),
            steps=_total_if_exported(deltas, names.STEP_DURATION),
            step_seconds=_sum_if_exported(deltas, names.STEP_DURATION),
            step_decode_rows=_total_if_exported(deltas, names.STEP_DECODE_ROWS_TOTAL),
            step_prefill_tokens=_total_if_exported(deltas, names.STEP_PREFILL_TOKENS_TOTAL),
            step_kv_tokens=_total_if_exported(deltas, names.STEP_KV_TOKENS_TOTAL),
            detail=detail,
        )

    def _budget_attainment(self, now: Snapshot) -> float | None:
        """Met / judged since the budget window's baseline (the first scrape, early on)."""
        baseline = self.budget_marks[0] if self.budget_marks else None
        if baseline is None or baseline is now:
            return None
        judged, met = _judged(
            [t.minus(baseline.per_server[url]) for url, t in now.per_server.items()
             if url in baseline.per_server]
        )  # fmt: skip
        return met / judged if judged and met is not None else None

    def _arrival_rate(self, baseline: Snapshot, now: Snapshot) -> float | None:
        """Arrivals per second since the newest snapshot in the newer half of the window
        (the whole window when the scrapes in between are missing)."""
        newer = self._baseline(now.at - (now.at - baseline.at) / 2, exclude=now) or baseline
        deltas = [
            totals.minus(newer.per_server[url])
            for url, totals in now.per_server.items()
            if url in newer.per_server
        ]
        return _rate_if_exported(deltas, names.REQUESTS_ARRIVED_TOTAL, now.at - newer.at)

    def _kv_max(self, since: float) -> float | None:
        values = [
            totals.gauges[names.KV_CACHE_USAGE]
            for snap in self.history
            if snap.at >= since
            for totals in snap.per_server.values()
            if names.KV_CACHE_USAGE in totals.gauges
        ]
        return max(values) if values else None


def _gauge_sum(snapshot: Snapshot, name: str) -> float:
    """A gauge's value now, summed over the servers (0 where none exports it)."""
    return sum(t.gauges.get(name, 0.0) for t in snapshot.per_server.values())


def _merged_buckets(deltas: Sequence[Totals], name: str) -> dict[float, float]:
    merged: dict[float, float] = {}
    for totals in deltas:
        for le, n in totals.buckets.get(name, {}).items():
            merged[le] = merged.get(le, 0.0) + n
    if merged and math.inf not in merged:
        raise ValueError(f"{name} has no +Inf bucket")
    return merged


def _judged(deltas: Sequence[Totals]) -> tuple[float | None, float | None]:
    """(requests judged, requests that met every target); (None, None) when no server
    exports the SLO counter (an older one, or none has judged a request yet)."""
    every = [(result, n) for t in deltas for (result, target), n in t.slo.items()
             if target == names.SLO_ALL]  # fmt: skip
    if not every:
        return None, None
    return sum(n for _, n in every), sum(n for result, n in every if result == "met")


def _missed(deltas: Sequence[Totals]) -> dict[str, float]:
    """Misses per target (ttft, tpot, e2e; all: requests that missed any)."""
    missed: dict[str, float] = {}
    for totals in deltas:
        for (result, target), n in totals.slo.items():
            if result == "missed":
                missed[target] = missed.get(target, 0.0) + n
    return missed


def _total_if_exported(deltas: Sequence[Totals], name: str) -> float | None:
    """A counter's (or histogram's count's) increase; None when no server exports it."""
    return _total(deltas, name) if any(name in t.counts for t in deltas) else None


def _sum_if_exported(deltas: Sequence[Totals], histogram: str) -> float | None:
    if not any(histogram in t.sums for t in deltas):
        return None
    return sum(t.sums.get(histogram, 0.0) for t in deltas)


def _total(deltas: Sequence[Totals], name: str) -> float:
    return sum(t.counts.get(name, 0.0) for t in deltas)


def _rate_if_exported(deltas: Sequence[Totals], name: str, window_s: float) -> float | None:
    """Per second over the window; None when no server exports the counter (an older one)."""
    if not any(name in t.counts for t in deltas):
        return None
    return _total(deltas, name) / window_s


def _busy_per_token(deltas: Sequence[Totals]) -> float | None:
    """The engines' busy seconds per generated token; None when no token was generated."""
    tokens = _total(deltas, names.GENERATION_TOKENS_TOTAL)
    return _total(deltas, names.ENGINE_BUSY_SECONDS_TOTAL) / tokens if tokens else None


def _mean(deltas: Sequence[Totals], histogram: str) -> float | None:
    """A histogram's mean over the window; None when it observed nothing."""
    count = _total(deltas, histogram)
    return sum(t.sums.get(histogram, 0.0) for t in deltas) / count if count else None
