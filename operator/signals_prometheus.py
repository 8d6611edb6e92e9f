"""Signals from the Prometheus HTTP API (`/api/v1/query`, instant queries).

Series are selected by the `policy` and `namespace` labels the scrape
config's relabelling puts on every pod (operator), or by an `instance`
list (local mode, Prometheus scraping plain host:port targets). The p99 is
`histogram_quantile` over the window's rate of the duration histogram,
summed over pods: the same quantity the scrape source computes by hand.
The SLO's attainment is the pods' own per-request count
(`batchpilot_requests_slo_total`), its increase over the window and, for the
error budget, over the SLO's budget window (which Prometheus keeps, however
long the operator has run). A series an older server does not export leaves
its signal None.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import aiohttp
from batchpilot_operator.signal_fields import (
    ARRIVALS,
    CLASS_HISTOGRAMS,
    CLASS_WAITING,
    COUNTERS,
    HISTOGRAMS,
    LEAST,
    NOW,
    PEAKS,
    POD_SERIES,
    WindowTotals,
    signals_from,
)
from batchpilot_operator.signals import MIN_REQUESTS_PER_WINDOW, Signals, no_data
from batchpilot_operator.slo import DEFAULT_BUDGET_WINDOW_S
from batchpilot_server import metric_names as names

QUERY_TIMEOUT_S = 5.0


class PrometheusQueryError(RuntimeError):
    """Prometheus could not be reached or refused a query."""


def selector_for_policy(namespace: str, policy: str) -> str:
    return f'namespace="{_escape(namespace)}",policy="{_escape(policy)}"'


def selector_for_instances(instances: Sequence[str]) -> str:
    """Series scraped from these host:port targets (or server URLs)."""
    hosts = [re.sub(r"^https?://", "", i).rstrip("/") for i in instances]
    return f'instance=~"{"|".join(_escape(re.escape(h)) for h in hosts)}"'


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def queries(
    selector: str, window_s: float, budget_window_s: float = DEFAULT_BUDGET_WINDOW_S
) -> dict[str, str]:
    """The PromQL behind a window's totals (signal_fields.py), by what each fills:
    `buckets:H` and `slo` answer one sample per label set, the rest one value.
    `[window]` is a whole number of seconds."""
    w = f"{max(1, round(window_s))}s"
    half = f"{max(1, round(window_s / 2))}s"  # the arrival rate's: the newer half
    budget = f"{max(1, round(budget_window_s))}s"
    sel = "{" + selector + "}"

    def judged(extra: str) -> str:
        return f"sum(increase({names.REQUESTS_SLO_TOTAL}{{{selector},{extra}}}[{budget}]))"

    every = f'target="{names.SLO_ALL}"'  # each judged request once
    met = f'{every},result="met"'
    by_class = names.CLASS_LABEL
    return {
        **{f"buckets:{h}": f"sum by (le) (increase({h}_bucket{sel}[{w}]))" for h in HISTOGRAMS},
        **{f"sum:{h}": f"sum(increase({h}_sum{sel}[{w}]))" for h in HISTOGRAMS},
        **{f"count:{h}": f"sum(increase({h}_count{sel}[{w}]))" for h in HISTOGRAMS},
        **{f"count:{c}": f"sum(increase({c}{sel}[{w}]))" for c in COUNTERS},
        **{f"now:{g}": f"sum({g}{sel})" for g in NOW.values()},
        **{f"peak:{g}": f"max(max_over_time({g}{sel}[{w}]))" for g in PEAKS.values()},
        **{f"least:{g}": f"min({g}{sel})" for g in LEAST.values()},
        "slo": f"sum by (result, target) (increase({names.REQUESTS_SLO_TOTAL}{sel}[{w}]))",
        "arrival_rate": f"sum(rate({ARRIVALS}{sel}[{half}]))",
        "pods": f"count({POD_SERIES}{sel})",  # every pod exports the config it runs
        "budget_attainment": f"{judged(met)} / {judged(every)}",
        # By SLO class: the same series split by their `class` label.
        **{
            f"class_buckets:{h}": f"sum by ({by_class}, le) (increase({h}_bucket{sel}[{w}]))"
            for h in CLASS_HISTOGRAMS
        },
        "class_slo": f"sum by ({by_class}, result, target) "
        f"(increase({names.REQUESTS_SLO_TOTAL}{sel}[{w}]))",
        "class_budget": f"sum by ({by_class}, result) "
        f"(increase({names.REQUESTS_SLO_TOTAL}{{{selector},{every}}}[{budget}]))",
        "class_waiting": f"sum by ({by_class}) ({CLASS_WAITING}{sel})",
    }


class PrometheusSource:
    """Reads one policy's (or one set of servers') signals from Prometheus."""

    def __init__(
        self,
        url: str,
        selector: str,
        session: aiohttp.ClientSession,
        *,
        min_requests: int = MIN_REQUESTS_PER_WINDOW,
        budget_window_s: float = DEFAULT_BUDGET_WINDOW_S,
    ) -> None:
        self.url = url.rstrip("/")
        self.selector = selector
        self.session = session
        self.min_requests = min_requests
        self.budget_window_s = budget_window_s

    async def query(self, promql: str, at: float | None = None) -> list[Sample]:
        """The samples of an instant query (at Unix time `at`, else Prometheus' now);
        NaN samples are left out."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        try:
            timeout = aiohttp.ClientTimeout(total=QUERY_TIMEOUT_S)
            async with self.session.get(
                f"{self.url}/api/v1/query", params=params, timeout=timeout
            ) as response:
                status, text = response.status, await response.text()
        except TimeoutError as exc:
            raise PrometheusQueryError(
                f"Prometheus at {self.url} timed out: no answer within {QUERY_TIMEOUT_S:g} s"
            ) from exc
        except aiohttp.ClientError as exc:
            raise PrometheusQueryError(
                f"Prometheus at {self.url} is unreachable: {exc or type(exc).__name__}"
            ) from exc
        try:
            body = json.loads(text)
        except ValueError:
            raise PrometheusQueryError(
                f"Prometheus at {self.url} answered HTTP {status} with a body that is not "
                f"JSON: {text[:80]!r}"
            ) from None
        if not isinstance(body, Mapping) or body.get("status") != "success":
            error = body.get("error") if isinstance(body, Mapping) else body
            raise PrometheusQueryError(
                f"Prometheus at {self.url} refused {promql!r} (HTTP {status}): {error}"
            )
        return _samples(body, f"Prometheus at {self.url} answered {promql!r}")

    async def read(self, window_s: float) -> Signals:
        named = queries(self.selector, window_s, self.budget_window_s)
        try:
            # One instant for every query, Prometheus' own now (no clock skew between it
            # and the operator): each query extrapolates its range to its evaluation
            # time, so queries evaluated apart disagree on shares of series scraped
            # together.
            at = _one_value(await self.query("vector(time())"), "vector(time())")
            answers = dict(zip(
                named, await asyncio.gather(*(self.query(q, at) for q in named.values())),
                strict=True,
            ))  # fmt: skip
            totals = _window_totals(answers, window_s)
        except PrometheusQueryError as exc:
            return no_data(str(exc), window_s)
        if names.REQUEST_DURATION not in totals.counts:
            return no_data(
                f"no {names.REQUEST_DURATION} series match {{{self.selector}}} over the last "
                f"{window_s:.0f} s (is Prometheus scraping the servers, at least twice a window?)",
                window_s,
            )
        return signals_from(totals, min_requests=self.min_requests)


Sample = tuple[dict[str, str], float]  # a series' labels and its value


def _window_totals(answers: Mapping[str, list[Sample]], window_s: float) -> WindowTotals:
    """The answers to `queries` as the window's totals; a query that found no series
    leaves its entry out (the field then says "not exported")."""

    def value(key: str) -> float | None:
        samples = answers[key]
        return samples[0][1] if samples else None

    def present(prefix: str) -> dict[str, float]:
        return {key.removeprefix(prefix): v for key in answers
                if key.startswith(prefix) and (v := value(key)) is not None}  # fmt: skip

    return WindowTotals(
        window_s=window_s,
        buckets={
            key.removeprefix("buckets:"): {_le(labels, key): n for labels, n in samples}
            for key, samples in answers.items()
            if key.startswith("buckets:") and samples
        },
        sums=present("sum:"),
        counts=present("count:"),
        now=present("now:"),
        peaks=present("peak:"),
        least=present("least:"),
        slo={
            (labels.get("result", ""), labels.get("target", "")): n for labels, n in answers["slo"]
        },
        arrival_rate=value("arrival_rate"),
        pods=round(value("pods") or 0),
        budget_attainment=value("budget_attainment"),
        **_class_totals(answers),
    )


def _class_totals(answers: Mapping[str, list[Sample]]) -> dict[str, Any]:
    """WindowTotals' per-class fields from the `class_*` answers; a series without a
    class label (an older server) is left to the totals."""
    label = names.CLASS_LABEL
    class_buckets: dict[str, dict[str, dict[float, float]]] = {}
    for key, samples in answers.items():
        if key.startswith("class_buckets:"):
            histogram = key.removeprefix("class_buckets:")
            for labels, n in samples:
                if labels.get(label):
                    per = class_buckets.setdefault(labels[label], {}).setdefault(histogram, {})
                    per[_le(labels, key)] = n
    class_slo: dict[str, dict[tuple[str, str], float]] = {}
    for labels, n in answers.get("class_slo", []):
        if labels.get(label):
            key = (labels.get("result", ""), labels.get("target", ""))
            class_slo.setdefault(labels[label], {})[key] = n
    budget: dict[str, dict[str, float]] = {}
    for labels, n in answers.get("class_budget", []):
        if labels.get(label):
            budget.setdefault(labels[label], {})[labels.get("result", "")] = n
    return {
        "class_buckets": class_buckets,
        "class_slo": class_slo,
        "class_budget_attainment": {
            name: by_result.get("met", 0.0) / judged
            for name, by_result in budget.items()
            if (judged := sum(by_result.values())) > 0
        },
        "class_waiting": {
            labels[label]: n for labels, n in answers.get("class_waiting", []) if labels.get(label)
        },
    }


def _one_value(samples: list[Sample], promql: str) -> float:
    if len(samples) != 1:
        raise PrometheusQueryError(f"Prometheus answered {promql!r} with {len(samples)} "
                                   "samples, not one")  # fmt: skip
    return samples[0][1]


def _le(labels: Mapping[str, str], key: str) -> float:
    """A bucket sample's upper bound; a sample without one is a query error."""
    try:
        return float(labels["le"])
    except (KeyError, ValueError):
        raise PrometheusQueryError(
            f"Prometheus answered the {key} query with a sample that has no bucket bound "
            f"(le): {dict(labels)}"
        ) from None


def _samples(body: Mapping[str, Any], answered: str) -> list[Sample]:
    """An instant query's samples; a malformed answer is a query error."""
    try:
        result = body["data"]["result"]
        if body["data"].get("resultType") == "scalar":
            result = [{"metric": {}, "value": result}]
        samples = [(dict(item.get("metric") or {}), float(item["value"][1])) for item in result]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise PrometheusQueryError(
            f"{answered} with a malformed result ({type(exc).__name__}: {exc}): "
            f"{json.dumps(body)[:120]}"
        ) from None
    return [(labels, v) for labels, v in samples if not math.isnan(v)]
