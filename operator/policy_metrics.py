"""Per-policy targets as Prometheus gauges, so alerts and dashboards can compare against them.

The servers know nothing of a policy's SLO or KV watermark; the operator (and
`batchpilot demo`) does. It publishes them here, labelled `namespace` and
`policy` like the server series after relabelling, and Prometheus scrapes them
(job `batchpilot-operator` in manifests/prometheus/prometheus.yml).
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

SLO_P99_LATENCY = "batchpilot_slo_p99_latency_seconds"
KV_HIGH_WATERMARK = "batchpilot_kv_high_watermark_ratio"
LABELS = ("namespace", "policy")


class PolicyMetrics:
    """The SLO and KV watermark gauges of every policy this process tunes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._slo = Gauge(
            SLO_P99_LATENCY, "p99 latency SLO of the policy", LABELS, registry=self.registry
        )
        self._watermark = Gauge(
            KV_HIGH_WATERMARK,
            "KV cache usage above which the tuner cuts the batch",
            LABELS,
            registry=self.registry,
        )

    def publish(
        self, namespace: str, policy: str, *, slo_p99_ms: float, kv_high_watermark: float
    ) -> None:
        self._slo.labels(namespace, policy).set(slo_p99_ms / 1000.0)
        self._watermark.labels(namespace, policy).set(kv_high_watermark)

    def forget(self, namespace: str, policy: str) -> None:
        """Drop a deleted policy's series, so its 'metrics missing' alert stops."""
        for gauge in (self._slo, self._watermark):
            try:
                gauge.remove(namespace, policy)
            except KeyError:
                continue

    def serve(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Expose the gauges at http://addr:port/metrics (port 0 picks a free one)."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        return server, thread
