"""Per-policy targets as Prometheus gauges, so alerts and dashboards can compare against them.

The servers know a policy's latency targets (the operator hands them over with the
batching config) but not its attainment objective or KV watermark; the operator
(and `batchpilot demo`) knows them all. It publishes them here, labelled
`namespace` and `policy` like the server series after relabelling, and Prometheus
scrapes them (job `batchpilot-operator` in manifests/prometheus/prometheus.yml).
The burn-rate alerts read the attainment objective from here: it exists once per
policy whether or not any pod runs, so a fleet scaled to nothing, or pods still on
an older config, never leave an alert without its threshold.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import DEFAULT_CLASS
from prometheus_client import CollectorRegistry, Gauge, start_http_server

SLO_P99_LATENCY = "batchpilot_slo_p99_latency_seconds"
SLO_OBJECTIVE = "batchpilot_slo_objective_seconds"
SLO_ATTAINMENT_OBJECTIVE = "batchpilot_slo_attainment_objective_ratio"
# The same per SLO class (label class: `default` for the top-level targets, and each of
# spec.slo.classes): the per-class burn-rate alerts' threshold.
SLO_CLASS_ATTAINMENT_OBJECTIVE = "batchpilot_slo_class_attainment_objective_ratio"
CLASS_LABEL = "class"
KV_HIGH_WATERMARK = "batchpilot_kv_high_watermark_ratio"
LABELS = ("namespace", "policy")
TARGET_LABEL = "target"
TARGETS = ("ttft", "tpot", "e2e")


class PolicyMetrics:
    """The SLO, attainment objective and KV watermark gauges of every policy this
    process tunes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._slo = Gauge(
            SLO_P99_LATENCY,
            "end-to-end latency target of the policy (p99LatencyMs or e2eMs); absent when it "
            "states none",
            LABELS,
            registry=self.registry,
        )
        self._objective = Gauge(
            SLO_OBJECTIVE,
            "each latency target the policy states (target: ttft, tpot, e2e)",
            (*LABELS, TARGET_LABEL),
            registry=self.registry,
        )
        self._attainment = Gauge(
            SLO_ATTAINMENT_OBJECTIVE,
            "share of requests that must meet every stated target (1 minus it: the error "
            "budget's rate)",
            LABELS,
            registry=self.registry,
        )
        self._class_attainment = Gauge(
            SLO_CLASS_ATTAINMENT_OBJECTIVE,
            "share of a class's requests that must meet every target it states (class: "
            "default for the top-level targets)",
            (*LABELS, CLASS_LABEL),
            registry=self.registry,
        )
        self._classes: dict[tuple[str, str], set[str]] = {}  # the classes published
        self._watermark = Gauge(
            KV_HIGH_WATERMARK,
            "KV cache usage above which the tuner cuts the batch",
            LABELS,
            registry=self.registry,
        )

    def publish_slo(self, namespace: str, policy: str, slo: Slo) -> None:
        """A policy's targets, attainment objective and KV watermark; a target it no
        longer states disappears."""
        stated = slo.stated
        for target in TARGETS:
            if target in stated:
                self._objective.labels(namespace, policy, target).set(stated[target])
            else:
                _remove(self._objective, namespace, policy, target)
        if "e2e" in stated:
            self._slo.labels(namespace, policy).set(stated["e2e"])
        else:
            _remove(self._slo, namespace, policy)
        self._attainment.labels(namespace, policy).set(slo.attainment)
        self._watermark.labels(namespace, policy).set(slo.kv_high_watermark)
        classes = {DEFAULT_CLASS: slo.attainment, **{c.name: c.attainment for c in slo.classes}}
        for gone in self._classes.get((namespace, policy), set()) - set(classes):
            _remove(self._class_attainment, namespace, policy, gone)
        for name, attainment in classes.items():
            self._class_attainment.labels(namespace, policy, name).set(attainment)
        self._classes[(namespace, policy)] = set(classes)

    def publish(
        self, namespace: str, policy: str, *, slo_p99_ms: float, kv_high_watermark: float
    ) -> None:
        """An end-to-end p99 SLO (the older form, as `batchpilot demo` states it)."""
        self.publish_slo(
            namespace, policy, Slo(e2e_s=slo_p99_ms / 1000.0, kv_high_watermark=kv_high_watermark)
        )

    def forget(self, namespace: str, policy: str) -> None:
        """Drop a deleted policy's series, so its 'metrics missing' alert stops."""
        for gauge in (self._slo, self._attainment, self._watermark):
            _remove(gauge, namespace, policy)
        for target in TARGETS:
            _remove(self._objective, namespace, policy, target)
        for name in self._classes.pop((namespace, policy), set()):
            _remove(self._class_attainment, namespace, policy, name)

    def serve(self, port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, threading.Thread]:
        """Expose the gauges at http://addr:port/metrics (port 0 picks a free one)."""
        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        return server, thread


def _remove(gauge: Gauge, *labels: str) -> None:
    try:
        gauge.remove(*labels)
    except KeyError:  # never published
        return
