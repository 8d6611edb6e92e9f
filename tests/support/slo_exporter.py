"""A /metrics endpoint that exports the pods' SLO and step series by their documented
names (batchpilot_server.metric_names), driven by the test with known counts.

It lets the signal sources be checked against exact numbers; the real servers'
series are the same names and, like theirs, the latency and prompt-length histograms and
the SLO counter carry the request's SLO class (the server's own tests check what it counts).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import DEFAULT_CLASS
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server

TOKEN_BUCKETS = (16, 64, 256, 1024, 4096)


@dataclass
class SloExporter:
    registry: CollectorRegistry
    url: str
    judged: Counter
    duration: Histogram
    ttft: Histogram
    tpot: Histogram
    prompts: Histogram
    step: Histogram
    decode_rows: Counter
    prefill_tokens: Counter
    kv_tokens: Counter

    def request(
        self,
        *,
        ttft_s: float,
        tpot_s: float,
        e2e_s: float,
        prompt: int,
        missed: tuple[str, ...],
        slo_class: str = DEFAULT_CLASS,
    ) -> None:
        """One finished request of `slo_class`, judged as the pods judge it."""
        self.duration.labels(slo_class).observe(e2e_s)
        self.ttft.labels(slo_class).observe(ttft_s)
        self.tpot.labels(slo_class).observe(tpot_s)
        self.prompts.labels(slo_class).observe(prompt)
        self.judged.labels("missed" if missed else "met", names.SLO_ALL, slo_class).inc()
        for target in missed:
            self.judged.labels("missed", target, slo_class).inc()

    def declare_class(self, slo_class: str) -> None:
        """The class's series at zero, as after its first request: Prometheus' `increase`
        counts from a series' first sample, so a window must open after it."""
        for histogram in (self.duration, self.ttft, self.tpot, self.prompts):
            histogram.labels(slo_class)
        for result in ("met", "missed"):
            self.judged.labels(result, names.SLO_ALL, slo_class)

    def engine_step(self, seconds: float, rows: int, prefill: int, kv: int) -> None:
        self.step.observe(seconds)
        self.decode_rows.inc(rows)
        self.prefill_tokens.inc(prefill)
        self.kv_tokens.inc(kv)


@contextmanager
def serve_slo_exporter() -> Iterator[SloExporter]:
    registry = CollectorRegistry()

    def histogram(name: str, buckets: tuple[float, ...] = names.LATENCY_BUCKETS) -> Histogram:
        return Histogram(name, name, buckets=buckets, registry=registry)

    def counter(name: str) -> Counter:
        return Counter(name.removesuffix("_total"), name, registry=registry)

    def by_class(name: str, buckets: tuple[float, ...] = names.LATENCY_BUCKETS) -> Histogram:
        labelled = Histogram(name, name, (names.CLASS_LABEL,), buckets=buckets,
                             registry=registry)  # fmt: skip
        labelled.labels(DEFAULT_CLASS)  # the default class's series exist from the start
        return labelled

    judged = Counter(
        names.REQUESTS_SLO_TOTAL.removesuffix("_total"), "judged",
        ("result", "target", names.CLASS_LABEL), registry=registry,
    )  # fmt: skip
    for result in ("met", "missed"):
        judged.labels(result, names.SLO_ALL, DEFAULT_CLASS)  # both series exist from the start
    http: WSGIServer
    http, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield SloExporter(
            registry=registry,
            url=f"http://127.0.0.1:{http.server_port}",
            judged=judged,
            duration=by_class(names.REQUEST_DURATION),
            ttft=by_class(names.TIME_TO_FIRST_TOKEN),
            tpot=by_class(names.REQUEST_TIME_PER_OUTPUT_TOKEN),
            prompts=by_class(names.REQUEST_PROMPT_TOKENS, TOKEN_BUCKETS),
            step=histogram(names.STEP_DURATION),
            decode_rows=counter(names.STEP_DECODE_ROWS_TOTAL),
            prefill_tokens=counter(names.STEP_PREFILL_TOKENS_TOTAL),
            kv_tokens=counter(names.STEP_KV_TOKENS_TOTAL),
        )
    finally:
        http.shutdown()
        thread.join(timeout=5)
