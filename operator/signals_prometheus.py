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
from batchpilot_operator.signals import (
    MIN_REQUESTS_PER_WINDOW,
    Signals,
    no_data,
    status_detail,
    traffic_status,
)
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
    """The PromQL behind each signal; `[window]` is a whole number of seconds."""
    w = f"{max(1, round(window_s))}s"
    half = f"{max(1, round(window_s / 2))}s"  # the arrival rate's: the newer half
    budget = f"{max(1, round(budget_window_s))}s"
    sel = "{" + selector + "}"

    def judged(extra: str, window: str = w) -> str:
        return f"sum(increase({names.REQUESTS_SLO_TOTAL}{{{selector},{extra}}}[{window}]))"

    def increase(counter: str) -> str:
        return f"sum(increase({counter}{sel}[{w}]))"

    every = f'target="{names.SLO_ALL}"'  # each judged request once
    met = f'{every},result="met"'

    def quantile(q: float, histogram: str) -> str:
        return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{sel}[{w}])))"

    def mean(histogram: str) -> str:
        return f"sum(rate({histogram}_sum{sel}[{w}])) / sum(rate({histogram}_count{sel}[{w}]))"

    return {
        "requests": f"sum(increase({names.REQUEST_DURATION}_count{sel}[{w}]))",
        "request_rate": f"sum(rate({names.REQUESTS_TOTAL}{sel}[{w}]))",
        "p99": quantile(0.99, names.REQUEST_DURATION),
        "queue_wait_p99": quantile(0.99, names.QUEUE_WAIT),
        "kv_usage": f"max(max_over_time({names.KV_CACHE_USAGE}{sel}[{w}]))",
        "waiting": f"sum({names.REQUESTS_WAITING}{sel})",
        "running": f"sum({names.REQUESTS_RUNNING}{sel})",
        "preemption_rate": f"sum(rate({names.PREEMPTIONS_TOTAL}{sel}[{w}]))",
        "tokens_per_s": f"sum(rate({names.GENERATION_TOKENS_TOTAL}{sel}[{w}]))",
        "mean_batch_size": mean(names.BATCH_SIZE),
        "mean_latency": mean(names.REQUEST_DURATION),
        "output_tokens_p10": quantile(0.1, names.REQUEST_GENERATION_TOKENS),
        "output_tokens_p50": quantile(0.5, names.REQUEST_GENERATION_TOKENS),
        "output_tokens_p90": quantile(0.9, names.REQUEST_GENERATION_TOKENS),
        "output_tokens_p99": quantile(0.99, names.REQUEST_GENERATION_TOKENS),
        "arrival_rate": f"sum(rate({names.REQUESTS_ARRIVED_TOTAL}{sel}[{half}]))",
        "busy_per_token": f"sum(rate({names.ENGINE_BUSY_SECONDS_TOTAL}{sel}[{w}])) / "
        f"sum(rate({names.GENERATION_TOKENS_TOTAL}{sel}[{w}]))",
        # every pod exports the config it runs: one series each
        "pods": f"count({names.CONFIG_MAX_BATCH_SIZE}{sel})",
        "ttft_p99": quantile(0.99, names.TIME_TO_FIRST_TOKEN),
        "tpot_p99": quantile(0.99, names.REQUEST_TIME_PER_OUTPUT_TOKEN),
        "slo_judged": judged(every),
        "slo_met": judged(met),
        **{
            f"slo_missed_{target}": judged(f'target="{target}",result="missed"')
            for target in (*names.SLO_STATED, names.SLO_ALL)
        },
        "budget_attainment": f"{judged(met, budget)} / {judged(every, budget)}",
        "prompt_tokens_p10": quantile(0.1, names.REQUEST_PROMPT_TOKENS),
        "prompt_tokens_p50": quantile(0.5, names.REQUEST_PROMPT_TOKENS),
        "prompt_tokens_p90": quantile(0.9, names.REQUEST_PROMPT_TOKENS),
        "prompt_tokens_p99": quantile(0.99, names.REQUEST_PROMPT_TOKENS),
        "steps": increase(f"{names.STEP_DURATION}_count"),
        "step_seconds": increase(f"{names.STEP_DURATION}_sum"),
        "step_decode_rows": increase(names.STEP_DECODE_ROWS_TOTAL),
        "step_prefill_tokens": increase(names.STEP_PREFILL_TOKENS_TOTAL),
        "step_kv_tokens": increase(names.STEP_KV_TOKENS_TOTAL),
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

    async def query(self, promql: str, at: float | None = None) -> float | None:
        """The single value of an instant query (at Unix time `at`, else Prometheus' now);
        None for an empty result or NaN."""
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
        return _single_value(body, f"Prometheus at {self.url} answered {promql!r}")

    async def read(self, window_s: float) -> Signals:
        named = queries(self.selector, window_s, self.budget_window_s)
        try:
            # One instant for every query, Prometheus' own now (no clock skew between it
            # and the operator): each query extrapolates its range to its evaluation
            # time, so queries evaluated apart disagree on shares of series scraped
            # together.
            at = await self.query("vector(time())")
            values = dict(
                zip(
                    named,
                    await asyncio.gather(*(self.query(q, at) for q in named.values())),
                    strict=True,
                )
            )
        except PrometheusQueryError as exc:
            return no_data(str(exc), window_s)
        requests = values["requests"]
        if requests is None:
            return no_data(
                f"no {names.REQUEST_DURATION} series match {{{self.selector}}} over the last "
                f"{window_s:.0f} s (is Prometheus scraping the servers, at least twice a window?)",
                window_s,
            )
        waiting, running = values["waiting"] or 0.0, values["running"] or 0.0
        status = traffic_status(requests, waiting, running, min_requests=self.min_requests)
        return Signals(
            status=status,
            window_s=window_s,
            requests=requests,
            request_rate=values["request_rate"] or 0.0,
            p99_latency_s=values["p99"] if status == "ok" else None,
            queue_wait_p99_s=values["queue_wait_p99"],
            kv_usage=values["kv_usage"],
            waiting=waiting,
            running=running,
            preemption_rate=values["preemption_rate"] or 0.0,
            tokens_per_s=values["tokens_per_s"] or 0.0,
            mean_batch_size=values["mean_batch_size"],
            mean_latency_s=values["mean_latency"],
            output_tokens_p10=values["output_tokens_p10"],
            output_tokens_p50=values["output_tokens_p50"],
            output_tokens_p90=values["output_tokens_p90"],
            output_tokens_p99=values["output_tokens_p99"],
            arrival_rate=values["arrival_rate"],
            busy_s_per_token=values["busy_per_token"],
            pods=round(values["pods"] or 0),
            ttft_p99_s=values["ttft_p99"],
            tpot_p99_s=values["tpot_p99"],
            slo_judged=values["slo_judged"],
            # no request met every target: the met series may not exist yet
            slo_met=_zero_if_judged(values["slo_met"], values["slo_judged"]),
            slo_missed={
                target: value
                for target in (*names.SLO_STATED, names.SLO_ALL)
                if (value := values[f"slo_missed_{target}"]) is not None
            },
            budget_attainment=values["budget_attainment"],
            prompt_tokens_p10=values["prompt_tokens_p10"],
            prompt_tokens_p50=values["prompt_tokens_p50"],
            prompt_tokens_p90=values["prompt_tokens_p90"],
            prompt_tokens_p99=values["prompt_tokens_p99"],
            steps=values["steps"],
            step_seconds=values["step_seconds"],
            step_decode_rows=values["step_decode_rows"],
            step_prefill_tokens=values["step_prefill_tokens"],
            step_kv_tokens=values["step_kv_tokens"],
            detail=status_detail(
                status, requests, waiting, running, min_requests=self.min_requests
            ),
        )


def _zero_if_judged(met: float | None, judged: float | None) -> float | None:
    """Met requests where some were judged; a server counts a label set only once it has
    seen one, so judged requests without a `met` series all missed."""
    return 0.0 if met is None and judged is not None else met


def _single_value(body: Mapping[str, Any], answered: str) -> float | None:
    """The value of an instant query's first sample; a malformed answer is a query error."""
    try:
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise PrometheusQueryError(
            f"{answered} with a malformed result ({type(exc).__name__}: {exc}): "
            f"{json.dumps(body)[:120]}"
        ) from None
    return None if math.isnan(value) else value
