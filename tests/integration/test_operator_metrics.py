"""The operator publishes each policy's SLO targets, attainment objective and KV watermark
for Prometheus.

Kopf runs for real against the emulator and serves the gauges on a real port;
the tests scrape them over HTTP as Prometheus would.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml
from batchpilot_operator import kube
from batchpilot_operator.main import main
from batchpilot_operator.policy_metrics import (
    KV_HIGH_WATERMARK,
    SLO_ATTAINMENT_OBJECTIVE,
    SLO_OBJECTIVE,
    SLO_P99_LATENCY,
)
from prometheus_client.parser import text_string_to_metric_families

from tests.support.commands import BATCHPILOT, DEADLINE_S
from tests.support.k8s_emulator import Cluster, run_cluster, run_operator
from tests.support.manifests import operator_object, render_manifests
from tests.support.policies import policy_object
from tests.support.prometheus import pod_group
from tests.support.servers import free_port
from tests.support.usage import refused_usage

# (metric, namespace, policy, target: "" for the unlabelled ones) -> value
Series = dict[tuple[str, str, str, str], float]
POLICY_SERIES = (SLO_P99_LATENCY, SLO_OBJECTIVE, SLO_ATTAINMENT_OBJECTIVE, KV_HIGH_WATERMARK)


@pytest.fixture(scope="module")
def metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def cluster(metrics_port: int) -> Iterator[Cluster]:
    with run_cluster() as running, run_operator(running, memo={"metrics_port": metrics_port}):
        yield running


def policy(namespace: str, slo_ms: float, watermark: float, **spec: Any) -> dict[str, Any]:
    return policy_object("llm", namespace, {
        "replicas": 1,
        "slo": {"p99LatencyMs": slo_ms},
        # No tuning loop: these tests only watch the published targets.
        "autotune": {"enabled": False, "kvHighWatermark": watermark},
        **spec,
    })


async def scrape(port: int) -> Series:
    """The operator's policy series, read from its /metrics as Prometheus would."""
    async with aiohttp.ClientSession() as session, session.get(
        f"http://127.0.0.1:{port}/metrics"
    ) as response:
        assert response.status == 200
        text = await response.text()
    return {
        (
            sample.name, sample.labels["namespace"], sample.labels["policy"],
            sample.labels.get("target", ""),
        ): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in POLICY_SERIES
    }  # fmt: skip


async def wait_for_series(
    cluster: Cluster, port: int, namespace: str, want: dict[tuple[str, str], float]
) -> None:
    """Until the policy's series are exactly `want`: {(metric, target): value}."""

    async def published() -> bool:
        series = await scrape(port)
        mine = {(name, target): v for (name, ns, _, target), v in series.items() if ns == namespace}
        return mine == want

    await cluster.wait_until(published, f"{namespace}/llm series exactly {want}")


async def wait_for_targets(
    cluster: Cluster, port: int, namespace: str, slo_ms: float, watermark: float
) -> None:
    """The series of an older p99LatencyMs policy: an e2e target at attainment 0.99."""
    await wait_for_series(cluster, port, namespace, {
        (SLO_P99_LATENCY, ""): slo_ms / 1000.0,
        (SLO_OBJECTIVE, "e2e"): slo_ms / 1000.0,
        (SLO_ATTAINMENT_OBJECTIVE, ""): 0.99,
        (KV_HIGH_WATERMARK, ""): watermark,
    })  # fmt: skip


async def wait_for_no_targets(cluster: Cluster, port: int, namespace: str) -> None:
    async def gone() -> bool:
        return not any(ns == namespace for _, ns, _, _ in await scrape(port))

    await cluster.wait_until(gone, f"no target series of {namespace}/llm")


async def test_targets_follow_the_spec_and_leave_with_the_policy(
    cluster: Cluster, metrics_port: int
) -> None:
    await cluster.create(kube.POLICIES, policy("follow", slo_ms=750, watermark=0.8))
    await wait_for_targets(cluster, metrics_port, "follow", 750, 0.8)

    await cluster.patch(
        kube.POLICIES, "follow", "llm",
        {"spec": {"slo": {"p99LatencyMs": 300}, "autotune": {"kvHighWatermark": 0.6}}},
    )
    await wait_for_targets(cluster, metrics_port, "follow", 300, 0.6)

    await cluster.delete(kube.POLICIES, "follow", "llm")
    await wait_for_no_targets(cluster, metrics_port, "follow")


async def test_a_ttft_tpot_slo_publishes_its_targets_and_objective_and_no_p99(
    cluster: Cluster, metrics_port: int
) -> None:
    await cluster.create(kube.POLICIES, policy("llmslo", slo_ms=900, watermark=0.9))
    await wait_for_targets(cluster, metrics_port, "llmslo", 900, 0.9)

    await cluster.patch(
        kube.POLICIES, "llmslo", "llm",
        {"spec": {"slo": {"p99LatencyMs": None, "ttftMs": 400, "tpotMs": 50,
                          "attainment": 0.95}}},
    )  # fmt: skip
    await wait_for_series(cluster, metrics_port, "llmslo", {
        (SLO_OBJECTIVE, "ttft"): 0.4,
        (SLO_OBJECTIVE, "tpot"): 0.05,
        (SLO_ATTAINMENT_OBJECTIVE, ""): 0.95,
        (KV_HIGH_WATERMARK, ""): 0.9,
    })  # fmt: skip
    # reconcile shows the objective (kubectl get bp's SLO column) without a tuning round
    objective = "ttft<=400ms tpot<=50ms @95%"
    shown = await cluster.wait_for(
        kube.POLICIES, "llmslo", "llm",
        lambda p: ((p.get("status") or {}).get("slo") or {}).get("objective") == objective,
        f"status.slo.objective {objective!r}",
    )  # fmt: skip
    assert "e2eMs" not in shown["status"]["slo"]  # the older e2e target is gone with the spec


async def test_an_invalid_spec_drops_the_targets_and_a_fix_restores_them(
    cluster: Cluster, metrics_port: int
) -> None:
    await cluster.create(kube.POLICIES, policy("invalid", slo_ms=400, watermark=0.9))
    await wait_for_targets(cluster, metrics_port, "invalid", 400, 0.9)

    await cluster.patch(kube.POLICIES, "invalid", "llm", {"spec": {"server": {"model": "gpt-9"}}})
    await cluster.wait_for_condition("invalid", "llm", "Ready", "False", "UnknownModel")
    await wait_for_no_targets(cluster, metrics_port, "invalid")

    await cluster.patch(kube.POLICIES, "invalid", "llm", {"spec": {"server": {"model": "tiny"}}})
    await wait_for_targets(cluster, metrics_port, "invalid", 400, 0.9)


async def test_policies_are_published_side_by_side(cluster: Cluster, metrics_port: int) -> None:
    await cluster.create(kube.POLICIES, policy("left", slo_ms=200, watermark=0.7))
    await cluster.create(kube.POLICIES, policy("right", slo_ms=900, watermark=0.95))
    await wait_for_targets(cluster, metrics_port, "left", 200, 0.7)
    await wait_for_targets(cluster, metrics_port, "right", 900, 0.95)
    await cluster.delete(kube.POLICIES, "left", "llm")
    await wait_for_no_targets(cluster, metrics_port, "left")
    await wait_for_targets(cluster, metrics_port, "right", 900, 0.95)


def test_a_taken_metrics_port_stops_the_operator_with_the_reason() -> None:
    with socket.socket() as taken, run_cluster() as cluster:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["operator", "-A", "--liveness-port", "0", "--metrics-port", str(port)]
        exited = subprocess.run(
            [str(BATCHPILOT), *argv],
            env={**os.environ, "KUBECONFIG": str(cluster.kubeconfig)},
            capture_output=True, text=True, timeout=DEADLINE_S,
        )
    assert exited.returncode == 1
    last = exited.stderr.strip().splitlines()[-1]
    reason = f"cannot serve policy metrics on port {port} (--metrics-port):"
    assert last.startswith(f"batchpilot operator: error: {reason}")
    assert "Traceback" not in exited.stderr


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["-A", "--metrics-port", "-1"], "--metrics-port must be 0..65535"),
        (["-A", "--metrics-port", "9000", "--liveness-port", "9000"], "need two ports"),
    ],
)
def test_bad_metrics_port_exits_2_with_a_clear_message(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert words in refused_usage(main, argv, capsys)


def kept_by(job: dict[str, Any], meta: dict[str, str]) -> bool:
    """Whether the job's `keep` relabel rules let a target with these labels through."""
    return all(
        re.fullmatch(rule["regex"], ";".join(meta.get(src, "") for src in rule["source_labels"]))
        for rule in job["relabel_configs"]
        if rule.get("action") == "keep"
    )


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_the_base_has_prometheus_scrape_the_operator_metrics_port() -> None:
    docs = render_manifests()
    template = operator_object(docs, "Deployment")["spec"]["template"]
    (container,) = template["spec"]["containers"]
    args, annotations = container["args"], template["metadata"]["annotations"]
    port = int(args[args.index("--metrics-port") + 1])
    assert {p["name"]: p["containerPort"] for p in container["ports"]}["metrics"] == port
    assert annotations["prometheus.io/port"] == str(port)

    (config,) = [
        yaml.safe_load(d["data"]["prometheus.yml"])
        for d in docs
        if d["kind"] == "ConfigMap" and "prometheus.yml" in d.get("data", {})
    ]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    meta = pod_group(
        "operator", address=f"10.0.0.1:{port}",
        annotations=annotations, labels=template["metadata"]["labels"],
    )["labels"]
    assert kept_by(jobs["batchpilot-operator"], meta)
    # Not also scraped as a server: it would be counted twice.
    assert not kept_by(jobs["batchpilot-servers"], meta)
