"""`batching.mode: auto` for real: Kopf against the emulator, pods that are real local servers.

Two auto policies side by side, each with a real server as its pod and a
steady load: equal output lengths at low load (the map's one region where
dynamic leads) and a spread of lengths (continuous's). The first switches to
dynamic once, recorded in status, an Event, the ConfigMap and the
Deployment's rollout; the second stays continuous, and neither flips back.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from batchpilot_operator import builders, kube
from batchpilot_operator.policy.mode import ModeParams
from batchpilot_operator.spec import parse_spec
from batchpilot_tools.loadgen import LengthDist, LoadSpec, run_load

from tests.support.k8s_emulator import Cluster, run_cluster, run_operator
from tests.support.policies import policy_object
from tests.support.servers import spawn_server

TOKEN = "mode-auto-test-token"
INTERVAL_S = 5  # the CRD's minimum
BATCH = 64  # pinned: the tuner holds, so every window is a whole one
TIMEOUT_MS = 10.0
# A baseline scrape, then the evidence rounds, with slack for a shared machine.
SWITCH_DEADLINE_S = INTERVAL_S * (ModeParams().evidence_rounds + 8)
STEADY_ROUNDS = 4  # rounds watched after the switch


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running:
        yield running


def auto_policy(namespace: str, **server: Any) -> dict[str, Any]:
    return policy_object("llm", namespace, {
        "replicas": 1,
        "server": {"image": "batchpilot:test", **server},
        "batching": {
            "mode": "auto",
            "maxBatchSize": {"initial": BATCH, "min": BATCH, "max": BATCH},
            "batchTimeoutMs": {"initial": TIMEOUT_MS, "min": TIMEOUT_MS, "max": TIMEOUT_MS},
        },
        "slo": {"p99LatencyMs": 30000},
        "autotune": {"intervalSeconds": INTERVAL_S, "windowSeconds": 2 * INTERVAL_S},
    })


@contextlib.asynccontextmanager
async def loaded_pod(
    cluster: Cluster, tmp_path: Path, namespace: str, output_len: LengthDist
) -> AsyncIterator[None]:
    """A real server as the policy's pod llm-0 (sharing its admin token), under steady load:
    enough requests for every window, far below what a batch of 64 serves."""
    await cluster.create(kube.SECRETS, {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": {"name": builders.secret_name("llm"), "namespace": namespace},
        "data": {builders.TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()},
    })
    with spawn_server(
        tmp_path=tmp_path, max_batch_size=BATCH, batch_timeout_ms=TIMEOUT_MS, admin_token=TOKEN
    ) as server:
        await cluster.add_server_pod(namespace, "llm", "llm-0", "127.0.0.1", server.port)
        load = LoadSpec(
            urls=[server.url], rate=10.0, duration_s=10 * SWITCH_DEADLINE_S,
            prompt_len=LengthDist("fixed", 8), output_len=output_len,
        )
        task = asyncio.create_task(run_load(load))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def status_of(policy: dict[str, Any]) -> dict[str, Any]:
    return dict(policy.get("status") or {})


async def mode_events(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    return [e for e in await cluster.events_for(namespace, "llm") if e["reason"] == "ModeChanged"]


async def deployment_mode(cluster: Cluster, namespace: str) -> tuple[str, dict[str, Any]]:
    deployment = await cluster.get(kube.DEPLOYMENTS, namespace, "llm")
    assert deployment is not None
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args[args.index("--mode") + 1], deployment["spec"]["strategy"]


async def test_auto_switches_once_to_the_mode_the_workload_favours(
    cluster: Cluster, tmp_path: Path
) -> None:
    equal, spread = "auto-equal", "auto-spread"
    async with (
        loaded_pod(cluster, tmp_path, equal, LengthDist("fixed", 8)),
        loaded_pod(cluster, tmp_path, spread, LengthDist("uniform", 2, 64)),
    ):
        with run_operator(cluster):
            for namespace in (equal, spread):
                await cluster.create(kube.POLICIES, auto_policy(namespace))
            # Before any choice an auto policy serves the default mode.
            initial = await cluster.wait_for(
                kube.POLICIES, spread, "llm", lambda p: "mode" in status_of(p),
                "status.mode from the first reconcile",
            )
            assert status_of(initial)["mode"] == "continuous"

            switched = await cluster.wait_for(
                kube.POLICIES, equal, "llm", lambda p: status_of(p).get("mode") == "dynamic",
                "the switch to dynamic", SWITCH_DEADLINE_S,
            )
            reason = status_of(switched)["modeReason"]
            assert reason.startswith("continuous -> dynamic: equal output lengths at low load")
            (event,) = await cluster.wait_for_events(
                equal, "llm", lambda e: e["reason"] == "ModeChanged", "the ModeChanged Event"
            )
            assert event["type"] == "Normal" and event["message"].startswith(reason)
            config_map = await cluster.get(
                kube.CONFIGMAPS, equal, builders.config_map_name("llm")
            )
            assert config_map is not None
            assert builders.parse_mode_data(config_map["data"]) == "dynamic"
            # The tuned knobs are untouched by the switch.
            assert builders.parse_config_data(config_map["data"]) == parse_spec(
                auto_policy(equal)["spec"]
            ).initial_config()
            mode, strategy = await deployment_mode(cluster, equal)
            assert mode == "dynamic"
            assert strategy["rollingUpdate"]["maxUnavailable"] == 0

            # Steady workloads, more rounds: no flip back, no switch on the other policy.
            seen = {status_of(switched)["lastDecision"]["time"]}
            while len(seen) <= STEADY_ROUNDS:
                await asyncio.sleep(INTERVAL_S)
                for namespace, expected in ((equal, "dynamic"), (spread, "continuous")):
                    policy = await cluster.get(kube.POLICIES, namespace, "llm")
                    assert policy is not None
                    assert status_of(policy)["mode"] == expected, status_of(policy)
                    if namespace == equal:
                        seen.add(status_of(policy)["lastDecision"]["time"])
            assert len(await mode_events(cluster, equal)) == 1
            assert await mode_events(cluster, spread) == []
            steady = await cluster.get(kube.POLICIES, spread, "llm")
            assert steady is not None
            assert status_of(steady)["modeReason"].startswith("continuous: output lengths vary")
            assert (await deployment_mode(cluster, spread))[0] == "continuous"
