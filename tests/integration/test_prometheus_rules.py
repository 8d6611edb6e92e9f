"""manifests/prometheus: promtool checks, rule unit tests, and the relabelling run for real.

Debian's Prometheus is built without Kubernetes service discovery, so the
scrape config is checked and run with each `kubernetes_sd_configs` swapped for
a `file_sd_configs` whose target groups carry the `__meta_kubernetes_*` labels
that pod discovery would attach. Everything else (relabelling, rule files) is
the manifest's, unchanged.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from batchpilot_operator.policy_metrics import PolicyMetrics
from batchpilot_tools.prometheus_local import LocalPrometheus
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tests.support import ROOT
from tests.support.prometheus import pod_group, requires_prometheus

PROM_DIR = ROOT / "manifests" / "prometheus"
CONFIG = PROM_DIR / "prometheus.yml"
RULES = PROM_DIR / "rules.yml"
RULES_TEST = PROM_DIR / "rules_test.yml"
PROMTOOL = "promtool"

pytestmark = requires_prometheus


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60)


def render_without_kubernetes_sd(sd_file: Path, scrape_interval: str) -> dict[str, Any]:
    config = yaml.safe_load(CONFIG.read_text())
    config["global"] = {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval}
    config["rule_files"] = [str(RULES)]
    for job in config["scrape_configs"]:
        assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
        job["file_sd_configs"] = [{"files": [str(sd_file)]}]
    return config


@pytest.fixture
def exporters() -> Iterator[tuple[int, int]]:
    """Real /metrics endpoints: a 'server' (one gauge) and the policy metrics of an operator."""
    server_registry = CollectorRegistry()
    Gauge("batchpilot_requests_running", "running", registry=server_registry).set(3)
    server_http, server_thread = start_http_server(0, addr="127.0.0.1", registry=server_registry)
    policies = PolicyMetrics()
    policies.publish("ml", "demo", slo_p99_ms=250, kv_high_watermark=0.9)
    operator_http, operator_thread = policies.serve(0, addr="127.0.0.1")
    try:
        yield server_http.server_port, operator_http.server_port
    finally:
        for http, thread in ((server_http, server_thread), (operator_http, operator_thread)):
            http.shutdown()
            thread.join(timeout=5)


def test_rules_are_valid() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rule_unit_tests_pass() -> None:
    result = promtool("test", "rules", str(RULES_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_config_is_valid(tmp_path: Path) -> None:
    sd_file = tmp_path / "pods.json"
    sd_file.write_text("[]")
    rendered = tmp_path / "prometheus.yml"
    rendered.write_text(yaml.safe_dump(render_without_kubernetes_sd(sd_file, "10s")))
    result = promtool("check", "config", str(rendered))
    assert result.returncode == 0, result.stdout + result.stderr


def test_relabelling_and_rules_on_a_real_prometheus(
    tmp_path: Path, exporters: tuple[int, int]
) -> None:
    server_port, operator_port = exporters
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(server_port)}
    server_labels = {"app.kubernetes.io/name": "batchpilot-server", "batchpilot.io/policy": "demo"}
    groups = [
        # the container port in __address__ differs: the annotation's port must win
        pod_group("demo-0", address="127.0.0.1:1", annotations=scrape, labels=server_labels),
        pod_group("stray", address="127.0.0.1:2", annotations=scrape, labels={}),
        pod_group(
            "opted-out",
            address="127.0.0.1:3",
            annotations={**scrape, "prometheus.io/scrape": "false"},
            labels=server_labels,
        ),
        pod_group(
            "batchpilot-operator-0",
            address="127.0.0.1:4",
            annotations={"prometheus.io/scrape": "true", "prometheus.io/port": str(operator_port)},
            labels={"app.kubernetes.io/name": "batchpilot-operator"},
        ),
    ]
    sd_file = tmp_path / "pods.json"
    sd_file.write_text(json.dumps(groups))
    config = render_without_kubernetes_sd(sd_file, "1s")

    with LocalPrometheus(tmp_path / "prom", config) as prom:
        prom.wait_for_targets_up()
        kept = {t["labels"]["job"]: t["labels"] for t in prom.targets()}
        assert set(kept) == {"batchpilot-servers", "batchpilot-operator"}
        assert len(prom.targets()) == 2
        server = kept["batchpilot-servers"]
        assert server["instance"] == f"127.0.0.1:{server_port}"
        assert (server["policy"], server["namespace"], server["pod"]) == ("demo", "ml", "demo-0")

        running = prom.wait_for_data('batchpilot_requests_running{policy="demo", namespace="ml"}')
        assert running[0]["metric"]["pod"] == "demo-0"
        # The operator's series keep the policy's namespace; the rules aggregate them.
        slo = prom.wait_for_data(
            'namespace_policy:batchpilot_slo_p99_latency_seconds:max{namespace="ml", policy="demo"}'
        )
        assert float(slo[0]["value"][1]) == 0.25


def test_prometheus_operator_objects_match_the_plain_config() -> None:
    operator_dir = PROM_DIR / "prometheus-operator"
    rule = yaml.safe_load((operator_dir / "prometheusrule.yaml").read_text())
    assert rule["spec"]["groups"] == yaml.safe_load(RULES.read_text())["groups"]

    monitors = {
        doc["metadata"]["name"]: doc["spec"]
        for doc in yaml.safe_load_all((operator_dir / "podmonitor.yaml").read_text())
    }
    endpoint = monitors["batchpilot-servers"]["podMetricsEndpoints"][0]
    as_pairs = {(r["sourceLabels"][0], r["targetLabel"]) for r in endpoint["relabelings"]}
    servers_job = yaml.safe_load(CONFIG.read_text())["scrape_configs"][0]
    expected = {
        (r["source_labels"][0], r["target_label"])
        for r in servers_job["relabel_configs"]
        if r.get("target_label") in {"policy", "namespace", "pod"}
    }
    assert as_pairs == expected
