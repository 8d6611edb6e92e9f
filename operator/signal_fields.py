"""Each `Signals` field declared once: the series it is read from and the arithmetic
that turns a window's totals into it.

Every source (Prometheus, the direct scrape, the simulator) fills one `WindowTotals`
with the increases and readings of the series named here, and `signals_from` computes
every field from it. A p99 is therefore one quantile read from the shared latency
buckets whatever the source, and a field is added in one place.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from batchpilot_operator.signals import (
    LENGTH_QUANTILES,
    MIN_REQUESTS_PER_WINDOW,
    ClassSignals,
    Signals,
    histogram_quantile,
    status_detail,
    traffic_status,
)
from batchpilot_server import metric_names as names

# Field -> (histogram, quantile) of the lengths: the totals' and each class's.
LENGTHS: dict[str, tuple[str, float]] = {
    **{f"output_tokens_p{round(q * 100)}": (names.REQUEST_GENERATION_TOKENS, q)
       for q in LENGTH_QUANTILES},
    **{f"prompt_tokens_p{round(q * 100)}": (names.REQUEST_PROMPT_TOKENS, q)
       for q in LENGTH_QUANTILES},
}  # fmt: skip
# Field -> (histogram, quantile): read from the window's bucket increases.
QUANTILES: dict[str, tuple[str, float]] = {
    "p99_latency_s": (names.REQUEST_DURATION, 0.99),
    "queue_wait_p99_s": (names.QUEUE_WAIT, 0.99),
    "ttft_p99_s": (names.TIME_TO_FIRST_TOKEN, 0.99),
    "tpot_p99_s": (names.REQUEST_TIME_PER_OUTPUT_TOKEN, 0.99),
    **LENGTHS,
}
# Field -> histogram: its mean over the window (increase of _sum over increase of _count).
MEANS: dict[str, str] = {
    "mean_batch_size": names.BATCH_SIZE,
    "mean_latency_s": names.REQUEST_DURATION,
}
# Field -> counter: per second over the window; 0 where no pod exports it.
RATES: dict[str, str] = {
    "request_rate": names.REQUESTS_TOTAL,
    "preemption_rate": names.PREEMPTIONS_TOTAL,
    "tokens_per_s": names.GENERATION_TOKENS_TOTAL,
    # speculative decoding: draft tokens verified and accepted (0 with k = 0 or an older server)
    "spec_draft_tokens_per_s": names.SPEC_DRAFT_TOKENS_TOTAL,
    "spec_accepted_tokens_per_s": names.SPEC_ACCEPTED_TOKENS_TOTAL,
}
# Field -> counter (or a histogram's count): its increase; None where no pod exports it.
INCREASES: dict[str, str] = {
    "steps": names.STEP_DURATION,
    "step_decode_rows": names.STEP_DECODE_ROWS_TOTAL,
    "step_prefill_tokens": names.STEP_PREFILL_TOKENS_TOTAL,
    "step_kv_tokens": names.STEP_KV_TOKENS_TOTAL,
}
# Field -> histogram: the increase of its _sum; None where no pod exports it.
SUMS: dict[str, str] = {"step_seconds": names.STEP_DURATION}
# Field -> gauge: its value now, summed over the pods (0 where none exports it).
NOW: dict[str, str] = {"waiting": names.REQUESTS_WAITING, "running": names.REQUESTS_RUNNING}
# Field -> gauge: the highest value of any pod in the window (the pod closest to the limit).
PEAKS: dict[str, str] = {"kv_usage": names.KV_CACHE_USAGE}
# Field -> gauge: the lowest value of any pod now (the smallest KV pool binds); None
# where no pod exports it.
LEAST: dict[str, str] = {"kv_pool_tokens": names.KV_CACHE_CAPACITY_TOKENS}
# busy_s_per_token: busy seconds over generated tokens, both counters' increases.
BUSY = (names.ENGINE_BUSY_SECONDS_TOTAL, names.GENERATION_TOKENS_TOTAL)
# arrival_rate: this counter per second over the newer half of the window (a load that
# just stepped up shows there, not in the window's mean).
ARRIVALS = names.REQUESTS_ARRIVED_TOTAL
# pods: the pods exporting the config they run, one series each.
POD_SERIES = names.CONFIG_MAX_BATCH_SIZE

# ClassSignals field -> (histogram, quantile) per SLO class, by the `class` label: its
# p99s, and its lengths (the predictor judges each class's tails by its own).
CLASS_QUANTILES: dict[str, tuple[str, float]] = {
    "ttft_p99_s": (names.TIME_TO_FIRST_TOKEN, 0.99),
    "tpot_p99_s": (names.REQUEST_TIME_PER_OUTPUT_TOKEN, 0.99),
    "p99_latency_s": (names.REQUEST_DURATION, 0.99),
    **LENGTHS,
}
CLASS_HISTOGRAMS = tuple(dict.fromkeys(h for h, _ in CLASS_QUANTILES.values()))
# ClassSignals.waiting: this gauge's value now per SLO class, summed over the pods.
CLASS_WAITING = names.REQUESTS_WAITING_BY_CLASS

# The series each kind of source reads.
HISTOGRAMS = tuple(dict.fromkeys(
    [h for h, _ in QUANTILES.values()] + list(MEANS.values()) + list(SUMS.values())
    + [names.REQUEST_DURATION, names.STEP_DURATION]  # requests; steps
))  # fmt: skip
COUNTERS = tuple(dict.fromkeys(
    [*RATES.values(), *(c for c in INCREASES.values() if c not in HISTOGRAMS), *BUSY, ARRIVALS]
))  # fmt: skip
GAUGES = tuple(dict.fromkeys([*NOW.values(), *PEAKS.values(), *LEAST.values()]))


@dataclass
class WindowTotals:
    """What one window measured over a policy's pods, in the terms declared above."""

    window_s: float
    # histogram -> le -> the increase of that cumulative bucket, summed over pods
    buckets: dict[str, dict[float, float]] = field(default_factory=dict)
    sums: dict[str, float] = field(default_factory=dict)  # histogram -> increase of _sum
    counts: dict[str, float] = field(default_factory=dict)  # counters, histograms' _count
    now: dict[str, float] = field(default_factory=dict)  # gauge -> sum over pods now
    peaks: dict[str, float] = field(default_factory=dict)  # gauge -> highest in the window
    least: dict[str, float] = field(default_factory=dict)  # gauge -> lowest of any pod now
    slo: dict[tuple[str, str], float] = field(default_factory=dict)  # (result, target) -> n
    arrival_rate: float | None = None  # ARRIVALS per second over the newer half
    pods: int = 0
    budget_attainment: float | None = None  # met / judged over the SLO's budget window
    # By SLO class (the `class` label; series without one are in the totals only):
    # class -> histogram -> le -> increase, for CLASS_HISTOGRAMS
    class_buckets: dict[str, dict[str, dict[float, float]]] = field(default_factory=dict)
    class_slo: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)
    # class -> met / judged over the budget window
    class_budget_attainment: dict[str, float] = field(default_factory=dict)
    # class -> CLASS_WAITING now, summed over pods
    class_waiting: dict[str, float] = field(default_factory=dict)


def signals_from(
    totals: WindowTotals, *, min_requests: int = MIN_REQUESTS_PER_WINDOW, detail: str = ""
) -> Signals:
    """Every field of `Signals` from one window's totals. The window must hold the
    request-duration series (each source says, in its own words, when it does not).
    `detail` adds the source's own remarks (a pod it could not scrape) to the status's."""
    window_s = totals.window_s
    requests = totals.counts.get(names.REQUEST_DURATION, 0.0)
    waiting, running = (totals.now.get(NOW[f], 0.0) for f in ("waiting", "running"))
    status = traffic_status(requests, waiting, running, min_requests=min_requests)
    quantiles = {
        name: bucket_quantile(q, totals.buckets.get(histogram, {}))
        for name, (histogram, q) in QUANTILES.items()
    }
    if status != "ok":  # a p99 of a handful of requests is their maximum: not a signal
        quantiles["p99_latency_s"] = None
    judged, met = _judged(totals.slo)
    busy, tokens = (totals.counts.get(name) for name in BUSY)
    remarks = [status_detail(status, requests, waiting, running, min_requests=min_requests),
               detail]  # fmt: skip
    return Signals(
        status=status,
        window_s=window_s,
        waiting=waiting,
        running=running,
        **quantiles,
        **{name: _mean(totals, histogram) for name, histogram in MEANS.items()},
        **{name: totals.counts.get(counter, 0.0) / window_s for name, counter in RATES.items()},
        **{name: totals.counts.get(counter) for name, counter in INCREASES.items()},
        **{name: totals.sums.get(histogram) for name, histogram in SUMS.items()},
        **{name: totals.peaks.get(gauge) for name, gauge in PEAKS.items()},
        **{name: totals.least.get(gauge) for name, gauge in LEAST.items()},
        requests=requests,
        busy_s_per_token=busy / tokens if busy is not None and tokens else None,
        arrival_rate=totals.arrival_rate,
        pods=totals.pods,
        slo_judged=judged,
        slo_met=met,
        slo_missed={target: n for (result, target), n in totals.slo.items() if result == "missed"},
        budget_attainment=totals.budget_attainment,
        detail="; ".join(remark for remark in remarks if remark),
        classes=class_signals(totals),
    )


def class_signals(totals: WindowTotals) -> dict[str, ClassSignals]:
    """Each SLO class the window's series name: its judgement, p99s, lengths and waiting
    requests, by name."""
    names_seen = sorted(
        set(totals.class_slo)
        | set(totals.class_buckets)
        | set(totals.class_budget_attainment)
        | set(totals.class_waiting)
    )
    classes = {}
    for name in names_seen:
        slo = totals.class_slo.get(name, {})
        judged, met = _judged(slo)
        buckets = totals.class_buckets.get(name, {})
        classes[name] = ClassSignals(
            name=name,
            slo_judged=judged,
            slo_met=met,
            slo_missed={target: n for (result, target), n in slo.items() if result == "missed"},
            **{
                field_name: bucket_quantile(q, buckets.get(histogram, {}))
                for field_name, (histogram, q) in CLASS_QUANTILES.items()
            },
            budget_attainment=totals.class_budget_attainment.get(name),
            waiting=totals.class_waiting.get(name),
        )
    return classes


def slo_attainment(slo: Mapping[tuple[str, str], float]) -> float | None:
    """Met / judged of an SLO counter's increases; None when nothing was judged."""
    judged, met = _judged(slo)
    return met / judged if judged and met is not None else None


def _judged(slo: Mapping[tuple[str, str], float]) -> tuple[float | None, float | None]:
    """(requests judged, requests that met every target); (None, None) when no pod exports
    the SLO counter. A pod counts a label set only once it has seen one, so judged
    requests without a `met` series all missed."""
    every = [(result, n) for (result, target), n in slo.items() if target == names.SLO_ALL]
    if not every:
        return None, None
    return sum(n for _, n in every), sum(n for result, n in every if result == "met")


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The `q` quantile of a histogram given as le -> cumulative count (None: empty)."""
    if not buckets:
        return None
    if math.inf not in buckets:
        raise ValueError("a histogram's buckets must end with +Inf")
    bounds = sorted(buckets)
    return histogram_quantile(q, bounds, [buckets[b] for b in bounds])


def _mean(totals: WindowTotals, histogram: str) -> float | None:
    """A histogram's mean over the window; None when it observed nothing."""
    count = totals.counts.get(histogram)
    return totals.sums.get(histogram, 0.0) / count if count else None
