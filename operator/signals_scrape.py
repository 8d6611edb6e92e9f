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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import aiohttp
from batchpilot_operator.signal_fields import (
    ARRIVALS,
    CLASS_HISTOGRAMS,
    CLASS_WAITING,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    LEAST,
    NOW,
    PEAKS,
    WindowTotals,
    signals_from,
    slo_attainment,
)
from batchpilot_operator.signals import MIN_REQUESTS_PER_WINDOW, Signals, no_data
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


@dataclass
class Totals:
    """One server's cumulative values at one scrape."""

    buckets: dict[str, dict[float, float]] = field(default_factory=dict)  # histogram -> le -> n
    counts: dict[str, float] = field(default_factory=dict)  # histogram _count, counters
    sums: dict[str, float] = field(default_factory=dict)  # histogram _sum
    gauges: dict[str, float] = field(default_factory=dict)
    slo: dict[tuple[str, str], float] = field(default_factory=dict)  # (result, target) -> n
    # By SLO class (the `class` label): class -> histogram -> le -> n, for CLASS_HISTOGRAMS
    class_buckets: dict[str, dict[str, dict[float, float]]] = field(default_factory=dict)
    class_slo: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    class_waiting: dict[str, float] = field(default_factory=dict)  # class -> CLASS_WAITING

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
            class_buckets={
                name: {
                    histogram: _increases(per, before.get(histogram, {}))
                    for histogram, per in by_histogram.items()
                }
                for name, by_histogram in self.class_buckets.items()
                for before in [earlier.class_buckets.get(name, {})]
            },
            class_slo={
                name: _increases(per, earlier.class_slo.get(name, {}))
                for name, per in self.class_slo.items()
            },
            class_waiting=dict(self.class_waiting),
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
            slo_class = sample.labels.get(names.CLASS_LABEL)
            if name.endswith("_bucket") and name.removesuffix("_bucket") in HISTOGRAMS:
                base = name.removesuffix("_bucket")
                le = float(sample.labels["le"])
                per = totals.buckets.setdefault(base, {})
                per[le] = per.get(le, 0.0) + value
                if slo_class and base in CLASS_HISTOGRAMS:
                    by_class = totals.class_buckets.setdefault(slo_class, {})
                    _add(by_class.setdefault(base, {}), le, value)
            elif name.endswith("_count") and name.removesuffix("_count") in HISTOGRAMS:
                _add(totals.counts, name.removesuffix("_count"), value)
            elif name.endswith("_sum") and name.removesuffix("_sum") in HISTOGRAMS:
                _add(totals.sums, name.removesuffix("_sum"), value)
            elif name in COUNTERS:
                _add(totals.counts, name, value)
            elif name in GAUGES:
                _add(totals.gauges, name, value)
            elif name == CLASS_WAITING and slo_class:
                _add(totals.class_waiting, slo_class, value)
            elif name == names.REQUESTS_SLO_TOTAL:
                key = (sample.labels.get("result", ""), sample.labels.get("target", ""))
                totals.slo[key] = totals.slo.get(key, 0.0) + value
                if slo_class:
                    _add(totals.class_slo.setdefault(slo_class, {}), key, value)
    return totals


def _add(into: dict[K, float], key: K, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


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
        deltas = _deltas(now, baseline)
        if not deltas:
            return no_data("no server answered both scrapes of the window", window_s)
        if not any(names.REQUEST_DURATION in t.buckets for t in deltas):
            return no_data(f"no {names.REQUEST_DURATION} series on the servers", window_s)
        totals = _window_totals(deltas, window_s)
        totals.now = {g: sum(t.gauges.get(g, 0.0) for t in now.per_server.values())
                      for g in NOW.values()}  # fmt: skip
        for server in now.per_server.values():
            for name, n in server.class_waiting.items():
                _add(totals.class_waiting, name, n)
        totals.peaks = self._peaks(baseline.at)
        totals.least = {
            gauge: min(values)
            for gauge in LEAST.values()
            if (values := [t.gauges[gauge] for t in now.per_server.values() if gauge in t.gauges])
        }
        totals.arrival_rate = self._arrival_rate(baseline, now)
        totals.budget_attainment, totals.class_budget_attainment = self._budget_attainment(now)
        return signals_from(
            totals, min_requests=self.min_requests, detail="; ".join(self.errors.values())
        )

    def _budget_attainment(self, now: Snapshot) -> tuple[float | None, dict[str, float]]:
        """Met / judged since the budget window's baseline (the first scrape, early on),
        in all and by SLO class."""
        baseline = self.budget_marks[0] if self.budget_marks else None
        if baseline is None or baseline is now:
            return None, {}
        totals = _window_totals(_deltas(now, baseline), 0.0)
        by_class = {name: slo_attainment(slo) for name, slo in totals.class_slo.items()}
        return slo_attainment(totals.slo), {
            name: share for name, share in by_class.items() if share is not None
        }

    def _arrival_rate(self, baseline: Snapshot, now: Snapshot) -> float | None:
        """Arrivals per second since the newest snapshot in the newer half of the window
        (the whole window when the scrapes in between are missing); None when no server
        exports the counter (an older one)."""
        newer = self._baseline(now.at - (now.at - baseline.at) / 2, exclude=now) or baseline
        arrived = _window_totals(_deltas(now, newer), 0.0).counts.get(ARRIVALS)
        return None if arrived is None else arrived / (now.at - newer.at)

    def _peaks(self, since: float) -> dict[str, float]:
        """Each peak gauge's highest value on any server in any snapshot of the window."""
        readings = [
            totals.gauges for snapshot in self.history if snapshot.at >= since
            for totals in snapshot.per_server.values()
        ]  # fmt: skip
        return {
            gauge: max(values)
            for gauge in PEAKS.values()
            if (values := [g[gauge] for g in readings if gauge in g])
        }


def _deltas(now: Snapshot, since: Snapshot) -> list[Totals]:
    """Each server's increases since `since`, for the servers seen at both ends."""
    return [
        totals.minus(since.per_server[url])
        for url, totals in now.per_server.items()
        if url in since.per_server
    ]


def _window_totals(deltas: Sequence[Totals], window_s: float) -> WindowTotals:
    """The servers' increases summed, in the declared series' terms."""
    totals = WindowTotals(window_s=window_s, pods=len(deltas))
    for delta in deltas:
        for histogram, per in delta.buckets.items():
            merged = totals.buckets.setdefault(histogram, {})
            for le, n in per.items():
                merged[le] = merged.get(le, 0.0) + n
        for into, values in ((totals.sums, delta.sums), (totals.counts, delta.counts)):
            for name, value in values.items():
                into[name] = into.get(name, 0.0) + value
        for key, n in delta.slo.items():
            totals.slo[key] = totals.slo.get(key, 0.0) + n
        for name, by_histogram in delta.class_buckets.items():
            merged_class = totals.class_buckets.setdefault(name, {})
            for histogram, per in by_histogram.items():
                into_histogram = merged_class.setdefault(histogram, {})
                for le, n in per.items():
                    _add(into_histogram, le, n)
        for name, per in delta.class_slo.items():
            into_slo = totals.class_slo.setdefault(name, {})
            for key, n in per.items():
                _add(into_slo, key, n)
    return totals
