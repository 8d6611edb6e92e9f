"""Test fixture layer over `batchpilot_tools.prometheus_local`: a real Prometheus per test.

    with run_prometheus(tmp_path, [f"127.0.0.1:{server.port}"], labels={"policy": "demo"}) as prom:
        prom.wait_for_targets_up()
        prom.query("batchpilot_requests_running")

The process is always stopped, also when the test fails.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from batchpilot_tools.prometheus_local import (
    LocalPrometheus,
    PrometheusError,
    find_binary,
    scrape_config,
)

PrometheusProcess = LocalPrometheus

__all__ = [
    "PrometheusError",
    "PrometheusProcess",
    "requires_prometheus",
    "run_prometheus",
]

requires_prometheus = pytest.mark.skipif(
    find_binary() is None, reason="prometheus binary not installed (make prometheus)"
)


@contextmanager
def run_prometheus(
    tmp_path: Path,
    targets: Sequence[str],
    *,
    scrape_interval: str = "1s",
    rule_files: Sequence[str | Path] = (),
    labels: Mapping[str, str] | None = None,
    target_labels: Mapping[str, Mapping[str, str]] | None = None,
) -> Iterator[LocalPrometheus]:
    """Start Prometheus scraping `targets` (host:port), ready to query; stop it on exit."""
    config = scrape_config(
        targets,
        scrape_interval=scrape_interval,
        rule_files=rule_files,
        labels=labels,
        target_labels=target_labels,
    )
    prometheus = LocalPrometheus(tmp_path / "prometheus", config)
    try:
        prometheus.start()
        yield prometheus
    finally:
        prometheus.stop()


def pod_group(
    name: str, *, address: str, annotations: dict[str, str], labels: dict[str, str]
) -> dict[str, Any]:
    """A file_sd target group shaped like Kubernetes pod discovery's output for one pod."""
    meta = {"__meta_kubernetes_namespace": "ml", "__meta_kubernetes_pod_name": name}
    for key, value in annotations.items():
        meta["__meta_kubernetes_pod_annotation_" + sanitize(key)] = value
    for key, value in labels.items():
        meta["__meta_kubernetes_pod_label_" + sanitize(key)] = value
    return {"targets": [address], "labels": meta}


def sanitize(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name)
