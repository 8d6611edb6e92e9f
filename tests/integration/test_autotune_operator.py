"""The autotune daemon for real: Kopf against the emulator, pods that are real local servers."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from batchpilot_operator import builders, kube
from batchpilot_operator.actuators import get_batching, held_config
from batchpilot_server.batching_config import BatchingConfig, SloTargets
from batchpilot_tools.loadgen import LengthDist, LoadSpec, run_load

from tests.support.k8s_emulator import Cluster, condition, run_cluster, run_operator
from tests.support.policies import policy_object
from tests.support.prometheus import requires_prometheus, run_prometheus
from tests.support.servers import ServerProcess, free_port, spawn_server, wait_ready

TOKEN = "autotune-test-token"
INTERVAL_S = 5  # the CRD's minimum
TUNE_DEADLINE_S = 60.0  # a baseline round, then decisions every INTERVAL_S


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running:
        yield running


@pytest.fixture(autouse=True)
async def no_policy_left(cluster: Cluster) -> AsyncIterator[None]:
    """Each test's policies go with it: the next test's operator must not tune them too."""
    yield
    await cluster.delete_policies()


def policy(namespace: str, name: str = "llm", **autotune: Any) -> dict[str, Any]:
    return policy_object(
        name,
        namespace,
        {
            "replicas": 1,
            "server": {"image": "batchpilot:test"},
            "batching": {
                "mode": "continuous",
                "maxBatchSize": {"initial": 1, "min": 1, "max": 32},
                "batchTimeoutMs": {"initial": 0, "min": 0, "max": 50},
            },
            "slo": {"p99LatencyMs": 30000},
            "autotune": {"intervalSeconds": INTERVAL_S, "windowSeconds": 10, **autotune},
        },
    )


async def admin_secret(cluster: Cluster, namespace: str, name: str = "llm") -> None:
    """The policy's admin Secret made up front, so the local server can share its token."""
    await cluster.create(
        kube.SECRETS,
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {"name": builders.secret_name(name), "namespace": namespace},
            "data": {builders.TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()},
        },
    )


@contextlib.asynccontextmanager
async def background_load(url: str) -> AsyncIterator[None]:
    """Far more than a batch of one can serve: the queue grows until the tuner acts."""
    spec = LoadSpec(
        urls=[url],
        rate=40.0,
        duration_s=3 * TUNE_DEADLINE_S,
        prompt_len=LengthDist("fixed", 16),
        output_len=LengthDist("fixed", 24),
    )
    task = asyncio.create_task(run_load(spec))
    try:
        yield
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


@contextlib.asynccontextmanager
async def server_pod(
    cluster: Cluster, tmp_path: Path, namespace: str
) -> AsyncIterator[ServerProcess]:
    """A real server at batch 1, timeout 0, sharing the policy's admin token, as pod llm-0."""
    await admin_secret(cluster, namespace)
    with spawn_server(
        tmp_path=tmp_path,
        max_batch_size=1,
        batch_timeout_ms=0,
        max_queue_size=4096,
        admin_token=TOKEN,
    ) as server:
        await cluster.add_server_pod(namespace, "llm", "llm-0", "127.0.0.1", server.port)
        yield server


def tuned(policy_obj: dict[str, Any]) -> bool:
    return bool((policy_obj.get("status") or {}).get("history"))


async def test_the_loop_tunes_a_real_server_and_a_restart_resumes_from_status(
    cluster: Cluster, tmp_path: Path
) -> None:
    ns = "autotune"
    async with server_pod(cluster, tmp_path, ns) as server:
        # A pod that is Ready but whose server is gone: it must be reported, not fatal.
        dead_port = free_port()
        await cluster.add_server_pod(ns, "llm", "llm-1", "127.0.0.1", dead_port)
        async with background_load(server.url), aiohttp.ClientSession() as session:
            with run_operator(cluster):
                await cluster.create(kube.POLICIES, policy(ns))
                first = await cluster.wait_for(
                    kube.POLICIES,
                    ns,
                    "llm",
                    tuned,
                    "a tuning change in status.history",
                    TUNE_DEADLINE_S,
                )
                # The config in force has its own writer (reconcile's, from the ConfigMap),
                # apart from the round's record: wait for it, not read it beside the record.
                shown, cm = await cluster.wait_for_in_force(ns, "llm", TUNE_DEADLINE_S)
            status = first["status"]
            change = status["history"][0]
            assert change["action"] == "grow_batch", change
            assert change["maxBatchSize"] > 1
            assert status["observed"]["requestRate"] > 0
            for type_ in ("Tuning", "MetricsAvailable"):
                assert condition(first, type_)["status"] == "True"  # type: ignore[index]
            assert condition(first, "SLOMet") is not None
            # The decision is in force everywhere: ConfigMap, the server, status.
            in_force = await get_batching(session, server.url)
            stored = builders.parse_config_data(cm["data"])
            assert stored is not None
            assert in_force.max_batch_size == stored.max_batch_size
            assert stored.max_batch_size == shown["status"]["maxBatchSize"]
            # the round posts its Events after the status it records
            await cluster.wait_for_events(
                ns, "llm", lambda e: e["reason"] == "Tuned", "a Tuned Event", TUNE_DEADLINE_S
            )
            (refused, *_) = await cluster.wait_for_events(
                ns, "llm", lambda e: e["reason"] == "PushRefused", "a PushRefused Event",
                TUNE_DEADLINE_S,
            )  # fmt: skip
            assert refused["type"] == "Warning"
            assert "llm-1: unreachable" in refused["message"]

            # A new operator starts from what is in force, not from `initial`.
            with run_operator(cluster):

                def decided_again(obj: dict[str, Any]) -> bool:
                    last = (obj.get("status") or {}).get("lastDecision") or {}
                    return last.get("time", "") > status["lastDecision"]["time"]

                resumed = await cluster.wait_for(
                    kube.POLICIES,
                    ns,
                    "llm",
                    decided_again,
                    "a decision after the restart",
                    TUNE_DEADLINE_S,
                )
                resumed, _ = await cluster.wait_for_in_force(ns, "llm", TUNE_DEADLINE_S)
            assert resumed["status"]["maxBatchSize"] >= shown["status"]["maxBatchSize"] > 1
            pushed = await get_batching(session, server.url)
            assert pushed.max_batch_size >= in_force.max_batch_size


async def test_disabled_autotune_changes_nothing(cluster: Cluster, tmp_path: Path) -> None:
    ns = "disabled"
    async with (
        server_pod(cluster, tmp_path, ns) as server,
        background_load(server.url),
        aiohttp.ClientSession() as session,
    ):
        with run_operator(cluster):
            await cluster.create(kube.POLICIES, policy(ns, enabled=False))
            found = await cluster.wait_for_condition(
                ns, "llm", "Tuning", "False", "Disabled", TUNE_DEADLINE_S
            )
            assert "enabled is false" in found["message"]
            # A round ran under a load that makes an enabled tuner grow the batch
            # at its first round (the test above): here nothing moved.
            current = await cluster.get(kube.POLICIES, ns, "llm")
        assert current is not None
        assert not (current.get("status") or {}).get("history")
        assert (current.get("status") or {}).get("lastDecision") is None
        assert (await get_batching(session, server.url)).max_batch_size == 1
        cm = await cluster.get(kube.CONFIGMAPS, ns, builders.config_map_name("llm"))
        assert cm is not None
        stored = builders.parse_config_data(cm["data"])
        assert stored is not None and stored.max_batch_size == 1


async def test_unreachable_prometheus_sets_metrics_available_false_and_holds(
    cluster: Cluster,
) -> None:
    ns = "noprom"
    dead = f"http://127.0.0.1:{free_port()}"
    with run_operator(cluster):
        await cluster.create(kube.POLICIES, policy(ns, prometheusUrl=dead))
        found = await cluster.wait_for_condition(
            ns, "llm", "MetricsAvailable", "False", "MetricsUnavailable", TUNE_DEADLINE_S
        )
        current, _ = await cluster.wait_for_in_force(ns, "llm", TUNE_DEADLINE_S)
    assert f"Prometheus at {dead} is unreachable" in found["message"]
    status = current["status"]
    assert status["lastDecision"]["action"] == "hold"
    assert status["maxBatchSize"] == 1
    assert condition(current, "SLOMet")["status"] == "Unknown"  # type: ignore[index]


@requires_prometheus
async def test_prometheus_outage_holds_with_metrics_unavailable_and_recovers(
    cluster: Cluster, tmp_path: Path
) -> None:
    ns = "outage"
    async with server_pod(cluster, tmp_path, ns) as server:
        with run_prometheus(
            tmp_path, [f"127.0.0.1:{server.port}"], labels={"namespace": ns, "policy": "llm"}
        ) as prometheus:
            prometheus.wait_for_targets_up()
            async with background_load(server.url):
                with run_operator(cluster):
                    await cluster.create(kube.POLICIES, policy(ns, prometheusUrl=prometheus.url))
                    await cluster.wait_for_condition(
                        ns, "llm", "MetricsAvailable", "True", "MetricsRead", TUNE_DEADLINE_S
                    )
                    prometheus.stop()
                    down = await cluster.wait_for_condition(
                        ns,
                        "llm",
                        "MetricsAvailable",
                        "False",
                        "MetricsUnavailable",
                        TUNE_DEADLINE_S,
                    )
                    during = await cluster.get(kube.POLICIES, ns, "llm")
                    prometheus.start()
                    await cluster.wait_for_condition(
                        ns, "llm", "MetricsAvailable", "True", "MetricsRead", TUNE_DEADLINE_S
                    )
    assert f"Prometheus at {prometheus.url} is unreachable" in down["message"]
    assert during is not None
    assert during["status"]["lastDecision"]["action"] == "hold"


async def test_pods_holding_other_values_get_the_config_in_force_again(
    cluster: Cluster, tmp_path: Path
) -> None:
    """llm-0 runs other knobs than the ConfigMap (as after a refused push); llm-1 too,
    but it knows an older token: one is brought back in line, the other reported once."""
    ns = "resync"
    await admin_secret(cluster, ns)
    with (
        spawn_server(
            tmp_path=tmp_path,
            max_batch_size=3,
            batch_timeout_ms=7,
            admin_token=TOKEN,
            wait=False,
        ) as drifted,
        spawn_server(
            tmp_path=tmp_path, max_batch_size=2, admin_token="stale-token", wait=False
        ) as locked,
    ):
        for server in (drifted, locked):  # both started before either is waited for
            wait_ready(server)
        await cluster.add_server_pod(ns, "llm", "llm-0", "127.0.0.1", drifted.port)
        await cluster.add_server_pod(ns, "llm", "llm-1", "127.0.0.1", locked.port)
        with run_operator(cluster):
            await cluster.create(kube.POLICIES, policy(ns))
            last = ""
            for round_ in range(3):  # three rounds: the refusal must not repeat

                def decided_again(obj: dict[str, Any], after: str = last) -> bool:
                    decision = (obj.get("status") or {}).get("lastDecision") or {}
                    return decision.get("time", "") > after

                found = await cluster.wait_for(
                    kube.POLICIES,
                    ns,
                    "llm",
                    decided_again,
                    f"round {round_ + 1}",
                    TUNE_DEADLINE_S,
                )
                last = found["status"]["lastDecision"]["time"]
                assert found["status"]["lastDecision"]["action"] == "hold"
        async with aiohttp.ClientSession() as session:
            brought_back = await get_batching(session, drifted.url)
            still = await get_batching(session, locked.url)
    assert (brought_back.max_batch_size, brought_back.batch_timeout_ms) == (1, 0)
    assert still.max_batch_size == 2
    events = await cluster.events_for(ns, "llm")
    resynced = [e["message"] for e in events if e["reason"] == "Resynced"]
    assert resynced == [
        "maxBatchSize 1, batchTimeoutMs 0 pushed again to llm-0: they held other values"
    ]
    refused = [e for e in events if e["reason"] == "PushRefused"]
    assert len(refused) == 1 and refused[0]["type"] == "Warning"
    assert refused[0]["message"].startswith("resync refused by llm-1: HTTP 403")


LLM_SLO = {"ttftMs": 20000, "tpotMs": 2000, "attainment": 0.9, "budgetWindow": "1h"}
LLM_TARGETS = SloTargets(ttft_ms=20000.0, tpot_ms=2000.0)


def llm_policy(namespace: str) -> dict[str, Any]:
    """A policy that states TTFT and TPOT (no e2e target) and lets the budget move."""
    obj = policy(namespace)
    obj["spec"]["slo"] = LLM_SLO
    obj["spec"]["batching"]["prefillTokenBudget"] = {"initial": 1024, "min": 256, "max": 2048}
    return obj


async def test_a_ttft_tpot_policy_hands_its_targets_to_the_pods_and_shows_attainment(
    cluster: Cluster, tmp_path: Path
) -> None:
    """The hand-off (ConfigMap, the pod's live config) and status.slo. The pod's GET and the
    status need the servers' SLO fields and counters, and a tuning rule that takes a goal
    without an e2e target: both arrive with the server and policy work on main."""
    ns = "llmslo"
    async with (
        server_pod(cluster, tmp_path, ns) as server,
        background_load(server.url),
        aiohttp.ClientSession() as session,
    ):
        with run_operator(cluster):
            await cluster.create(kube.POLICIES, llm_policy(ns))
            config_map = await cluster.wait_for(
                kube.CONFIGMAPS, ns, builders.config_map_name("llm"),
                what="the policy's ConfigMap", timeout=TUNE_DEADLINE_S,
            )  # fmt: skip
            written = json.loads(config_map["data"][builders.CONFIG_KEY])
            assert SloTargets.from_dict(written["slo"]) == LLM_TARGETS
            assert written["prefill_token_budget"] == 1024

            # the pod started without targets: a round pushes them
            async def pod_holds_the_targets() -> BatchingConfig | None:
                # a connection the loaded server drops is a probe to repeat, not a failure
                held = await held_config(session, server.url, BatchingConfig())
                return held if held is not None and held.slo == LLM_TARGETS else None

            held = await cluster.wait_until(
                pod_holds_the_targets, "the pod's GET /admin/batching to show the SLO",
                TUNE_DEADLINE_S,
            )  # fmt: skip
            assert held.prefill_token_budget == 1024

            def judged(obj: dict[str, Any]) -> bool:
                slo = (obj.get("status") or {}).get("slo") or {}
                return "attainment" in slo and "errorBudgetRemaining" in slo

            current = await cluster.wait_for(
                kube.POLICIES, ns, "llm", judged,
                "status.slo with the window's attainment and the error budget",
                TUNE_DEADLINE_S,
            )  # fmt: skip
    slo = current["status"]["slo"]
    assert slo["objective"] == "ttft<=20000ms tpot<=2000ms @90%"
    assert (slo["ttftMs"], slo["tpotMs"], slo["attainmentTarget"]) == (20000, 2000, 0.9)
    assert "e2eMs" not in slo and slo["budgetWindow"] == "1h"
    assert 0 <= slo["attainment"] <= 1 and slo["judged"] > 0
    assert -1 <= slo["errorBudgetRemaining"] <= 1
    assert slo["p99TtftMs"] > 0 and slo["p99TpotMs"] > 0
    met = condition(current, "SLOMet")
    assert met is not None and met["reason"] in ("WithinSLO", "BelowAttainment"), met


async def test_a_policy_with_k_hands_it_to_the_configmap_the_pod_and_the_status(
    cluster: Cluster, tmp_path: Path
) -> None:
    """numSpeculativeTokens.initial 2: the ConfigMap carries k, a round pushes it to the
    pod (started without speculation), and the status shows it beside maxBatchSize."""
    ns = "speck"
    obj = policy(ns)
    obj["spec"]["batching"]["numSpeculativeTokens"] = {"initial": 2, "min": 0, "max": 4}
    async with server_pod(cluster, tmp_path, ns) as server, aiohttp.ClientSession() as session:
        with run_operator(cluster):
            await cluster.create(kube.POLICIES, obj)
            config_map = await cluster.wait_for(
                kube.CONFIGMAPS, ns, builders.config_map_name("llm"),
                what="the policy's ConfigMap", timeout=TUNE_DEADLINE_S,
            )  # fmt: skip
            written = json.loads(config_map["data"][builders.CONFIG_KEY])
            assert written["num_speculative_tokens"] == 2

            async def pod_speculates() -> BatchingConfig | None:
                held = await held_config(session, server.url, BatchingConfig())
                return held if held is not None and held.num_speculative_tokens == 2 else None

            await cluster.wait_until(
                pod_speculates, "the pod's GET /admin/batching to show k = 2", TUNE_DEADLINE_S
            )
            shown = await cluster.wait_for(
                kube.POLICIES, ns, "llm",
                lambda found: (found.get("status") or {}).get("numSpeculativeTokens") == 2,
                "status.numSpeculativeTokens 2", TUNE_DEADLINE_S,
            )  # fmt: skip
    assert shown["status"]["maxBatchSize"] == 1


def two_class_policy(namespace: str) -> dict[str, Any]:
    """Two classes beside the top-level targets: `interactive`, whose 1 ms TTFT no request
    meets (so it binds), and `batch`, whose minute end to end every request meets."""
    obj = llm_policy(namespace)
    obj["spec"]["slo"]["classes"] = [
        {"name": "interactive", "priority": 10, "ttftMs": 1, "attainment": 0.99},
        {"name": "batch", "priority": 0, "e2eMs": 60000, "attainment": 0.9},
    ]
    return obj


async def class_load(url: str, slo_class: str, max_tokens: int) -> None:
    """Closed-loop streamed completions naming `slo_class` by the gateway's header, until
    cancelled; a 400 (the pod does not know the class until the operator pushes it) or a
    dropped connection is retried."""
    headers = {"x-gateway-inference-objective": slo_class}
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.post(
                    f"{url}/v1/completions", json=body, headers=headers
                ) as response:
                    await response.read()
                    if response.status != 200:
                        await asyncio.sleep(0.2)
            except aiohttp.ClientError:
                await asyncio.sleep(0.2)


async def test_a_two_class_policy_shows_each_class_and_the_binding_one(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Real traffic for both classes (the x-gateway-inference-objective header) on a real
    pod; the operator's rounds write status.slo.classes[] and name the binding class."""
    ns = "classes"
    async with server_pod(cluster, tmp_path, ns) as server:
        loads = [
            asyncio.create_task(class_load(server.url, slo_class, tokens))
            for slo_class, tokens in (("interactive", 8), ("interactive", 8),
                                      ("batch", 32), ("batch", 32))
        ]  # fmt: skip
        try:
            with run_operator(cluster):
                await cluster.create(kube.POLICIES, two_class_policy(ns))

                def both_judged(obj: dict[str, Any]) -> bool:
                    slo = (obj.get("status") or {}).get("slo") or {}
                    judged = {c["name"]: c.get("judged") for c in slo.get("classes") or []}
                    return bool(judged.get("interactive")) and bool(judged.get("batch"))

                current = await cluster.wait_for(
                    kube.POLICIES, ns, "llm", both_judged,
                    "status.slo.classes with both classes judged", 2 * TUNE_DEADLINE_S,
                )  # fmt: skip
        finally:
            for task in loads:
                task.cancel()
            await asyncio.gather(*loads, return_exceptions=True)
    slo = current["status"]["slo"]
    classes = {c["name"]: c for c in slo["classes"]}
    assert [c["name"] for c in slo["classes"]] == ["default", "interactive", "batch"]
    interactive, batch = classes["interactive"], classes["batch"]
    assert (interactive["priority"], interactive["attainmentTarget"]) == (10, 0.99)
    assert interactive["objective"] == "ttft<=1ms @99%"
    assert interactive["attainment"] == 0  # no first token within 1 ms
    assert batch["attainment"] == 1  # every answer within a minute
    assert 1 < interactive["p99TtftMs"] < 60000 and interactive["p99E2eMs"] > 0
    assert batch["p99E2eMs"] > 0 and batch["p99TpotMs"] > 0
    assert interactive["errorBudgetRemaining"] == -1 and batch["errorBudgetRemaining"] == 1
    assert slo["bindingClass"] == "interactive"
    assert not classes["default"].get("judged")  # no request named no class
    # the single SLO's fields count every class's requests
    assert slo["judged"] >= interactive["judged"] + batch["judged"] - 1e-9
