"""Kopf runs for real, in its own thread, against the Kubernetes API emulator over HTTP."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
from batchpilot_operator import builders, kube
from batchpilot_operator.reconcile import reconcile
from batchpilot_operator.spec import parse_spec
from batchpilot_server.batching_config import BatchingConfig, SloTargets

from tests.support.k8s_emulator import Cluster, condition, run_cluster, run_operator
from tests.support.manifests import granted_by_cluster_role
from tests.support.policies import policy_object

OWNED = (
    (kube.DEPLOYMENTS, ""),
    (kube.SERVICES, ""),
    (kube.CONFIGMAPS, "-batching"),
    (kube.SECRETS, "-admin"),
    (kube.PODDISRUPTIONBUDGETS, ""),  # the policies below run 2 replicas
)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running, run_operator(running):
        yield running


def policy(namespace: str, name: str = "llm", **spec: Any) -> dict[str, Any]:
    return policy_object(
        name, namespace, {"replicas": 2, "server": {"image": "batchpilot:test"}, **spec}
    )


async def owned_objects(cluster: Cluster, namespace: str, name: str) -> dict[str, dict[str, Any]]:
    found = {}
    for kind, suffix in OWNED:
        found[kind.kind] = await cluster.wait_for(kind, namespace, name + suffix)
    return found


async def test_policy_creates_owned_objects_with_owner_references(cluster: Cluster) -> None:
    created = await cluster.create(kube.POLICIES, policy("create"))
    objects = await owned_objects(cluster, "create", "llm")

    uid = created["metadata"]["uid"]
    for obj in objects.values():
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "BatchingPolicy", "llm", uid, True,
        )
        assert obj["metadata"]["labels"][builders.POLICY_LABEL] == "llm"

    expected = parse_spec(created["spec"]).initial_config()
    config_map = objects["ConfigMap"]
    assert json.loads(config_map["data"][builders.CONFIG_KEY]) == expected.to_dict()
    token = base64.b64decode(objects["Secret"]["data"][builders.TOKEN_KEY]).decode()
    assert len(token) >= 32

    deployment = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    template = deployment["spec"]["template"]
    assert template["metadata"]["labels"][builders.APP_LABEL] == "batchpilot-server"
    assert template["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    (container,) = template["spec"]["containers"]
    assert container["image"] == "batchpilot:test"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["batching"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert volumes["admin-token"]["secret"]["secretName"] == "llm-admin"
    assert objects["Service"]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]

    ready = await cluster.wait_for_condition("create", "llm", "Ready", "False", "ReplicasNotReady")
    assert ready["message"] == "0/2 replicas ready" and ready["lastTransitionTime"]
    status = (await cluster.get(kube.POLICIES, "create", "llm") or {})["status"]
    assert (status["maxBatchSize"], status["batchTimeoutMs"]) == (
        expected.max_batch_size, expected.batch_timeout_ms,
    )
    assert status["observedGeneration"] == created["metadata"]["generation"]
    await cluster.wait_for_events(
        "create", "llm", lambda e: e["reason"] == "Reconciled", "a Reconciled Event"
    )


async def test_ready_follows_the_deployment_status(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("ready"))
    await cluster.wait_for(kube.DEPLOYMENTS, "ready", "llm")
    # What the Deployment controller would write once both pods pass /readyz.
    await cluster.patch(
        kube.DEPLOYMENTS, "ready", "llm", {"status": {"readyReplicas": 2}}, "status"
    )
    ready = await cluster.wait_for_condition("ready", "llm", "Ready", "True", "ReplicasReady")
    assert ready["message"] == "2/2 replicas ready"
    status = (await cluster.get(kube.POLICIES, "ready", "llm") or {})["status"]
    assert status["readyReplicas"] == 2


async def test_spec_changes_are_followed_and_token_kept(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("scale"))
    secret = await cluster.wait_for(kube.SECRETS, "scale", "llm-admin")
    await cluster.wait_for(kube.DEPLOYMENTS, "scale", "llm")

    await cluster.patch(
        kube.POLICIES, "scale", "llm", {"spec": {"replicas": 5, "server": {"image": "bp:2"}}}
    )

    def rolled(deployment: dict[str, Any]) -> bool:
        (container,) = deployment["spec"]["template"]["spec"]["containers"]
        return deployment["spec"]["replicas"] == 5 and container["image"] == "bp:2"

    await cluster.wait_for(kube.DEPLOYMENTS, "scale", "llm", rolled, "5 replicas of bp:2")
    fresh = await cluster.wait_for(
        kube.POLICIES, "scale", "llm",
        lambda p: (p.get("status") or {}).get("observedGeneration") == 2, "observedGeneration 2",
    )
    assert fresh["metadata"]["generation"] == 2
    after = await cluster.get(kube.SECRETS, "scale", "llm-admin")
    assert after is not None and after["data"] == secret["data"]


async def test_deleted_admin_token_is_recreated_at_the_next_tuning_round(
    cluster: Cluster,
) -> None:
    # Secrets are not watched (that would read every Secret of the cluster): nothing
    # reconciles on the deletion, and the round after it puts a new token in place.
    await cluster.create(
        kube.POLICIES,
        policy("token", autotune={"enabled": False, "intervalSeconds": 5, "windowSeconds": 10}),
    )
    first = await cluster.wait_for(kube.SECRETS, "token", "llm-admin")
    await cluster.wait_for_condition("token", "llm", "Tuning", "False", "Disabled")
    await cluster.delete(kube.SECRETS, "token", "llm-admin")
    again = await cluster.wait_for(
        kube.SECRETS, "token", "llm-admin",
        lambda s: s["metadata"]["uid"] != first["metadata"]["uid"], "a recreated Secret",
    )
    assert again["data"][builders.TOKEN_KEY] != first["data"][builders.TOKEN_KEY]
    assert again["metadata"]["ownerReferences"] == first["metadata"]["ownerReferences"]
    await cluster.wait_for_events(
        "token", "llm", lambda e: e["reason"] == "AdminTokenCreated", "an AdminTokenCreated Event"
    )


async def test_deleted_deployment_comes_back(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("drift"))
    first = await cluster.wait_for(kube.DEPLOYMENTS, "drift", "llm")
    await cluster.delete(kube.DEPLOYMENTS, "drift", "llm")
    again = await cluster.wait_for(
        kube.DEPLOYMENTS, "drift", "llm",
        lambda d: d["metadata"]["uid"] != first["metadata"]["uid"], "a recreated Deployment",
    )
    assert again["spec"] == first["spec"]


async def test_hand_edited_service_is_restored(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("edit"))
    service = await cluster.wait_for(kube.SERVICES, "edit", "llm")
    hijacked = {builders.POLICY_LABEL: "someone-else"}
    await cluster.patch(kube.SERVICES, "edit", "llm", {"spec": {"selector": hijacked}})
    restored = await cluster.wait_for(
        kube.SERVICES, "edit", "llm",
        lambda s: s["spec"]["selector"] == service["spec"]["selector"], "the restored selector",
    )
    assert restored["metadata"]["uid"] == service["metadata"]["uid"]


@pytest.mark.parametrize(
    ("namespace", "spec", "reason", "words"),
    [
        ("bad-model", {"server": {"model": "gpt-9"}}, "UnknownModel", "gpt-9"),
        (
            "bad-model-path",
            {"server": {"model": {"persistentVolumeClaim": {"claimName": "weights"},
                                  "path": "../etc/passwd"}}},
            "InvalidModelReference",
            "..",
        ),
        (
            "bad-bounds",
            {"batching": {"maxBatchSize": {"initial": 80, "min": 1, "max": 64}}},
            "InvalidBounds",
            "min <= initial <= max",
        ),
        (
            "bad-slo",
            {"batching": {"batchTimeoutMs": {"initial": 50, "min": 40, "max": 60}},
             "slo": {"p99LatencyMs": 30}},
            "InvalidBounds",
            "slo.p99LatencyMs",
        ),
    ],
)
async def test_invalid_spec_says_why_and_creates_nothing(
    cluster: Cluster, namespace: str, spec: dict[str, Any], reason: str, words: str
) -> None:
    await cluster.create(kube.POLICIES, policy(namespace, **spec))
    ready = await cluster.wait_for_condition(namespace, "llm", "Ready", "False", reason)
    assert words in ready["message"]
    for kind, suffix in OWNED:
        assert await cluster.get(kind, namespace, "llm" + suffix) is None
    warnings = await cluster.wait_for_events(
        namespace, "llm", lambda e: e["type"] == "Warning", f"a {reason} Warning"
    )
    assert [e["reason"] for e in warnings] == [reason]
    # Kopf recorded the spec as handled: it schedules no retry of an invalid spec.
    fresh = await cluster.get(kube.POLICIES, namespace, "llm") or {}
    handled = fresh["metadata"]["annotations"]["batchpilot.io/last-handled-configuration"]
    assert json.loads(handled)["spec"] == fresh["spec"]


async def test_fixing_an_invalid_spec_creates_the_objects(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("fixed", server={"model": "nope"}))
    await cluster.wait_for_condition("fixed", "llm", "Ready", "False", "UnknownModel")
    await cluster.patch(kube.POLICIES, "fixed", "llm", {"spec": {"server": {"model": "tiny"}}})
    await owned_objects(cluster, "fixed", "llm")
    await cluster.wait_for_condition("fixed", "llm", "Ready", "False", "ReplicasNotReady")


async def test_bounds_change_reclamps_the_config_in_force(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("clamp"))
    await cluster.wait_for(kube.CONFIGMAPS, "clamp", "llm-batching")
    # What the tuner would have written: a batch of 48 and a 30 ms timeout.
    tuned = BatchingConfig(max_batch_size=48, batch_timeout_ms=30.0, max_queue_size=256)
    await cluster.patch(
        kube.CONFIGMAPS, "clamp", "llm-batching", {"data": builders.config_data(tuned)}
    )
    await cluster.patch(
        kube.POLICIES, "clamp", "llm", {"spec": {"batching": {"maxBatchSize": {"max": 16}}}}
    )

    def config(cm: dict[str, Any]) -> BatchingConfig | None:
        return builders.parse_config_data(cm.get("data"))

    clamped = await cluster.wait_for(
        kube.CONFIGMAPS, "clamp", "llm-batching",
        lambda cm: (config(cm) or tuned).max_batch_size == 16, "maxBatchSize re-clamped to 16",
    )
    # The timeout is inside its bounds: the tuned value survives; the targets are the spec's.
    assert config(clamped) == BatchingConfig(16, 30.0, 256, slo=SloTargets(e2e_ms=500.0))
    await cluster.wait_for(
        kube.POLICIES, "clamp", "llm",
        lambda p: (p.get("status") or {}).get("maxBatchSize") == 16, "status.maxBatchSize 16",
    )
    await cluster.wait_for_events(
        "clamp", "llm", lambda e: "re-clamped" in e["message"], "an Event saying re-clamped"
    )


async def test_deleting_the_policy_deletes_what_it_owns(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("gone"))
    await owned_objects(cluster, "gone", "llm")
    await cluster.delete(kube.POLICIES, "gone", "llm")
    for kind, suffix in OWNED:
        await cluster.wait_gone(kind, "gone", "llm" + suffix)


async def test_server_pods_are_listed_by_their_policy_labels(cluster: Cluster) -> None:
    # What the tuner does to find the servers to push a decision to.
    await cluster.add_server_pod("pods", "llm", "llm-a", "127.0.0.1", 18001)
    await cluster.add_server_pod("pods", "llm", "llm-b", "127.0.0.1", 18002, ready=False)
    await cluster.add_server_pod("pods", "other", "other-a", "127.0.0.1", 18003)
    client = kube.Client.for_url(cluster.url)
    try:
        pods = await client.list(kube.PODS, "pods", builders.selector_labels("llm"))
    finally:
        await client.close()
    assert sorted(p["metadata"]["name"] for p in pods) == ["llm-a", "llm-b"]
    ready = [p for p in pods if condition(p, "Ready") == {"type": "Ready", "status": "True"}]
    assert [(p["status"]["podIP"], p["spec"]["containers"][0]["ports"][0]["containerPort"])
            for p in ready] == [("127.0.0.1", 18001)]


async def test_reconciling_a_converged_policy_writes_nothing(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("idem"))
    await cluster.wait_for(
        kube.POLICIES, "idem", "llm",
        lambda p: "batchpilot.io/last-handled-configuration" in p["metadata"].get("annotations", {})
        and condition(p, "Ready") is not None,
        "Kopf to finish handling the policy",
    )
    converged = await cluster.get(kube.POLICIES, "idem", "llm")
    assert converged is not None
    before = len(cluster.emulator.calls)
    client = kube.Client.for_url(cluster.url)
    try:
        outcome = await reconcile(client, converged)
    finally:
        await client.close()
    writes = [
        call for call in cluster.emulator.calls[before:]
        if call.namespace == "idem" and call.verb in ("create", "patch")
    ]
    assert (outcome.actions, writes) == ([], [])


def test_every_call_the_operator_made_is_granted(cluster: Cluster) -> None:
    # Runs after the scenarios above (file order): Kopf's calls and ours are all recorded.
    made = {
        (call.group, call.resource, call.verb)
        for call in cluster.emulator.calls
        if call.user_agent.startswith(("kopf/", kube.USER_AGENT))
    }
    assert {("batchpilot.io", "batchingpolicies/status", "patch"),
            ("apps", "deployments", "create"), ("", "events", "create")} <= made
    assert made <= granted_by_cluster_role()
