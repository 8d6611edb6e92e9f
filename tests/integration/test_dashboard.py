"""manifests/grafana: the dashboard's structure, its provisioning, and every query against
a real Prometheus scraping real servers under load.

Grafana cannot run here, so the test does what Grafana would: substitute the
template variables into each panel target and annotation, and run the query
on the Prometheus HTTP API.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from batchpilot_operator.policy_metrics import PolicyMetrics
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_tools.loadgen import LengthDist, LoadSpec, run_load

from tests.support import ROOT
from tests.support.prometheus import requires_prometheus, run_prometheus
from tests.support.servers import ServerProcess, spawn_server, wait_ready

pytestmark = requires_prometheus

GRAFANA_DIR = ROOT / "manifests" / "grafana"
DASHBOARD = GRAFANA_DIR / "batchpilot.json"
NAMESPACE = "test"
# policy -> server mode: one of each, so mode-specific panels (hostage) have data
POLICIES = {"cont": "continuous", "dyn": "dynamic"}
# Grafana's $__rate_interval is at least 4 scrape intervals; the load runs longer.
RATE_INTERVAL = "20s"
LOAD_S = 14.0
# every target stated, so that each target-vs-p99 panel has both lines; the pods judge
# requests against the targets the operator hands them. A class beside the default one,
# which some requests name by the gateway's header, for the per-class panels.
CHAT = "chat"
SLO = Slo(ttft_s=0.5, tpot_s=0.05, e2e_s=0.5,
          classes=(SloClass(CHAT, 10, ttft_s=0.5, attainment=0.95),))  # fmt: skip


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every panel target and every Prometheus annotation."""
    queries = [
        (f"panel {panel['id']} {panel['title']!r} target {target['refId']}", target["expr"])
        for panel in dashboard["panels"]
        for target in panel["targets"]
    ]
    queries += [
        (f"annotation {a['name']!r}", a["expr"])
        for a in dashboard["annotations"]["list"]
        if "expr" in a
    ]
    return queries


def substitute(expr: str) -> str:
    """What Grafana sends for namespace=test and policy=[cont, dyn] (multi-value regex)."""
    out = (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$namespace", NAMESPACE)
        .replace("$policy", "(" + "|".join(POLICIES) + ")")
    )
    assert "$" not in out, f"unsubstituted variable in {out}"
    return out


def label_values_query(definition: str) -> tuple[str, str]:
    """Grafana's `label_values(selector, label)` as the PromQL `group by (label) (selector)`."""
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
    assert match, f"not a label_values() definition: {definition}"
    selector, label = match.groups()
    return f"group by ({label}) ({substitute(selector)})", label


# --- structure -------------------------------------------------------------------------


def test_panel_ids_refids_and_datasources() -> None:
    dashboard = load_dashboard()
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    uses_var = {"type": "prometheus", "uid": "${datasource}"}
    for panel in dashboard["panels"]:
        assert panel["datasource"] == uses_var, panel["title"]
        refids = [target["refId"] for target in panel["targets"]]
        assert len(refids) == len(set(refids)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == uses_var, panel["title"]
            assert 'namespace=~"$namespace"' in target["expr"], panel["title"]
            assert 'policy=~"$policy"' in target["expr"], panel["title"]
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            assert annotation["datasource"] == uses_var
    for name in ("namespace", "policy"):
        assert variables[name]["multi"] and variables[name]["includeAll"]


def test_panels_do_not_overlap() -> None:
    cells: set[tuple[int, int]] = set()
    for panel in load_dashboard()["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        mine = {
            (x, y)
            for x in range(grid["x"], grid["x"] + grid["w"])
            for y in range(grid["y"], grid["y"] + grid["h"])
        }
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine


def test_kustomize_provisions_the_dashboard_verbatim() -> None:
    rendered = subprocess.run(
        ["kubectl", "kustomize", str(GRAFANA_DIR)],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    maps = {doc["metadata"]["name"]: doc for doc in yaml.safe_load_all(rendered.stdout)}
    dashboards = maps["batchpilot-grafana-dashboards"]
    assert dashboards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboards["data"]["batchpilot.json"]) == load_dashboard()
    provisioning = maps["batchpilot-grafana-provisioning"]["data"]
    provider = yaml.safe_load(provisioning["dashboards.yaml"])["providers"][0]
    assert provider["options"]["path"] == "/var/lib/grafana/dashboards/batchpilot"
    datasource = yaml.safe_load(provisioning["datasources.yaml"])["datasources"][0]
    assert datasource["type"] == "prometheus"


# --- every query against real servers --------------------------------------------------


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[dict[str, ServerProcess]]:
    with (
        spawn_server(
            tmp_path=tmp_path, mode=POLICIES["cont"], max_batch_size=8, wait=False
        ) as cont,
        spawn_server(tmp_path=tmp_path, mode=POLICIES["dyn"], max_batch_size=8, wait=False) as dyn,
    ):
        for server in (cont, dyn):  # both started before either is waited for
            wait_ready(server)
        yield {"cont": cont, "dyn": dyn}


@pytest.fixture
def policy_metrics() -> Iterator[int]:
    """The per-policy SLO and watermark gauges, served as the operator would; yields the port."""
    metrics = PolicyMetrics()
    for policy in POLICIES:
        metrics.publish_slo(NAMESPACE, policy, SLO)
    http, thread = metrics.serve(0, addr="127.0.0.1")
    try:
        yield http.server_port
    finally:
        http.shutdown()
        thread.join(timeout=5)


def put_batching(server: ServerProcess, changes: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{server.url}/admin/batching",
        data=json.dumps(changes).encode(),
        method="PUT",
        headers={"Authorization": f"Bearer {server.token}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return dict(json.loads(response.read()))


async def class_requests(url: str, slo_class: str, duration_s: float) -> int:
    """Completions naming `slo_class` by the gateway's header, one after another for
    `duration_s`; returns how many were answered."""
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 8, "stream": True}
    headers = {"x-gateway-inference-objective": slo_class}
    answered, stop = 0, time.monotonic() + duration_s
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < stop:
            async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
                await r.read()
                answered += r.status == 200
    return answered


def finite_values(result: list[dict[str, Any]]) -> list[float]:
    return [float(s["value"][1]) for s in result if math.isfinite(float(s["value"][1]))]


async def test_every_query_returns_data(
    tmp_path: Path, servers: dict[str, ServerProcess], policy_metrics: int
) -> None:
    targets = {f"127.0.0.1:{s.port}": policy for policy, s in servers.items()}
    operator_target = f"127.0.0.1:{policy_metrics}"
    target_labels = {
        target: {"policy": policy, "namespace": NAMESPACE, "pod": f"{policy}-0"}
        for target, policy in targets.items()
    }
    with run_prometheus(tmp_path, [*targets, operator_target], target_labels=target_labels) as prom:
        await asyncio.to_thread(prom.wait_for_targets_up)
        for server in servers.values():
            await asyncio.to_thread(put_batching, server, {"slo": asdict(SLO.targets())})
        # Round robin hands `dyn` every other arrival, 6/s: at the 10 ms default timeout its
        # dynamic batches were mostly of one request, and a fast machine saw no batch of two
        # (slot waste 0). At 250 ms a batch gathers each arrival its timeout covers.
        await asyncio.to_thread(put_batching, servers["dyn"], {"batch_timeout_ms": 250})
        spec = LoadSpec(
            urls=[s.url for s in servers.values()],
            rate=12.0,
            duration_s=LOAD_S,
            prompt_len=LengthDist("fixed", 16),
            # mixed lengths in one dynamic batch: the short ones are held hostage
            output_len=LengthDist("uniform", 4, 24),
        )
        load = asyncio.create_task(run_load(spec))
        chat = asyncio.create_task(class_requests(servers["cont"].url, CHAT, LOAD_S))
        await asyncio.sleep(LOAD_S / 2)  # the tuner's move lands mid-load, as in production
        applied = await asyncio.to_thread(
            put_batching, servers["cont"], {"max_batch_size": 4, "batch_timeout_ms": 5}
        )
        assert applied["max_batch_size"] == 4
        report = await load
        assert report.ok > 0, report
        assert await chat > 0
        # Every panel is read as of the load's end: the loop of queries below takes seconds
        # on a busy machine, and a rate window read later would cover only the load's tail.
        ended = time.time()
        await asyncio.to_thread(prom.wait_for_scrapes_after, ended)

        for where, expr in panel_queries(load_dashboard()):
            result = await asyncio.to_thread(prom.query, substitute(expr), ended)
            assert finite_values(result), f"{where}: no data for {substitute(expr)}: {result}"

        # mixed output lengths in dynamic batches: finished members held their slots
        waste = next(p for p in load_dashboard()["panels"] if p["title"] == "Batch slot waste")
        finished = await asyncio.to_thread(
            prom.query, substitute(waste["targets"][0]["expr"]), ended
        )
        shares = {s["metric"]["policy"]: float(s["value"][1]) for s in finished}
        assert shares["cont"] == 0.0 < shares["dyn"] < 1.0, shares

        # the attainment is a share, against the objective the operator publishes
        attainment = next(p for p in load_dashboard()["panels"] if p["title"] == "SLO attainment")
        for target, bounds in zip(attainment["targets"], ((0.0, 1.0), (0.99, 0.99)), strict=True):
            values = finite_values(await asyncio.to_thread(prom.query, substitute(target["expr"]),
                                                           ended))  # fmt: skip
            assert values and all(bounds[0] <= v <= bounds[1] for v in values), (target, values)

        # the per-class panels tell the classes apart: the chat class's requests on `cont`,
        # the load's (no class named) in default, each against its own objective
        by_class = next(
            p for p in load_dashboard()["panels"] if p["title"] == "SLO attainment by class"
        )
        seen = {}
        for target in by_class["targets"]:
            result = await asyncio.to_thread(prom.query, substitute(target["expr"]), ended)
            seen[target["refId"]] = {
                (s["metric"]["policy"], s["metric"]["class"]): float(s["value"][1]) for s in result
            }
        assert {("cont", "default"), ("cont", CHAT), ("dyn", "default")} <= set(seen["A"])
        assert all(0.0 <= v <= 1.0 for v in seen["A"].values()), seen
        assert seen["B"][("cont", CHAT)] == 0.95 and seen["B"][("cont", "default")] == 0.99

        # one server per policy here: the Replicas panel counts the pods serving each
        replicas = next(p for p in load_dashboard()["panels"] if p["title"] == "Replicas")
        counted = await asyncio.to_thread(
            prom.query, substitute(replicas["targets"][0]["expr"]), ended
        )
        assert {s["metric"]["policy"]: float(s["value"][1]) for s in counted} == {
            policy: 1.0 for policy in POLICIES
        }

        variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
        for name, expected in (("namespace", {NAMESPACE}), ("policy", set(POLICIES))):
            query, label = label_values_query(variables[name]["definition"])
            values = {s["metric"][label] for s in await asyncio.to_thread(prom.query, query)}
            assert values == expected, f"variable {name}: {values}"
