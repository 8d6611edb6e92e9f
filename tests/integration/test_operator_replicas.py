"""Reconcile's replica parts, Kopf on the emulator: the status an HPA reads (replicas,
selector), the PodDisruptionBudget's life, and an omitted replica count under autoscale.

A module of its own (its own emulator and operator): these run beside no other test's
policies and their tuning rounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest
from batchpilot_operator import kube

from tests.support.k8s_emulator import Cluster, run_cluster, run_operator
from tests.support.manifests import granted_by_cluster_role
from tests.support.policies import policy_object


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running, run_operator(running):
        yield running


def policy(namespace: str, **spec: Any) -> dict[str, Any]:
    """2 replicas (a budget) and no tuning rounds, unless `spec` says otherwise."""
    return policy_object("llm", namespace, {
        "replicas": 2, "server": {"image": "batchpilot:test"}, "autotune": {"enabled": False},
        **spec,
    })


async def test_status_shows_the_pods_and_the_selector_that_finds_them(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy("selector"))
    await cluster.wait_for(kube.DEPLOYMENTS, "selector", "llm")
    await cluster.add_server_pod("selector", "llm", "llm-a", "127.0.0.1", 18011)
    await cluster.add_server_pod("selector", "other", "other-a", "127.0.0.1", 18012)
    # What the Deployment controller writes while one of its two pods is still starting.
    await cluster.patch(
        kube.DEPLOYMENTS, "selector", "llm",
        {"status": {"replicas": 2, "readyReplicas": 1}}, "status",
    )
    fresh = await cluster.wait_for(
        kube.POLICIES, "selector", "llm",
        lambda p: (p.get("status") or {}).get("replicas") == 2, "status.replicas 2",
    )
    status = fresh["status"]
    assert status["readyReplicas"] == 1
    # The scale subresource's selector (what an HPA counts pods by) selects this policy's pods.
    labels = dict(pair.split("=", 1) for pair in status["selector"].split(","))
    pods = await cluster.list(kube.PODS, "selector", labels)
    assert [p["metadata"]["name"] for p in pods] == ["llm-a"]


async def test_the_disruption_budget_lives_while_two_or_more_replicas_run(
    cluster: Cluster,
) -> None:
    await cluster.create(kube.POLICIES, policy("budget"))
    budget = await cluster.wait_for(kube.PODDISRUPTIONBUDGETS, "budget", "llm")
    deployment = await cluster.wait_for(kube.DEPLOYMENTS, "budget", "llm")
    assert budget["spec"] == {"maxUnavailable": 1, "selector": deployment["spec"]["selector"]}

    await cluster.patch(kube.POLICIES, "budget", "llm", {"spec": {"replicas": 1}})
    await cluster.wait_gone(kube.PODDISRUPTIONBUDGETS, "budget", "llm")

    await cluster.wait_for_events(
        "budget", "llm", lambda e: e["message"].startswith("deleted PodDisruptionBudget llm"),
        "an Event for the deleted budget",
    )

    await cluster.patch(kube.POLICIES, "budget", "llm", {"spec": {"replicas": 3}})
    again = await cluster.wait_for(kube.PODDISRUPTIONBUDGETS, "budget", "llm")
    # deleted by hand, it comes back: the operator watches it like its other objects
    await cluster.delete(kube.PODDISRUPTIONBUDGETS, "budget", "llm")
    await cluster.wait_for(
        kube.PODDISRUPTIONBUDGETS, "budget", "llm",
        lambda b: b["metadata"]["uid"] != again["metadata"]["uid"], "a recreated budget",
    )


async def test_a_budget_the_operator_did_not_create_is_never_deleted(cluster: Cluster) -> None:
    theirs = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "llm", "namespace": "foreign"},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"team": "a"}}},
    }
    await cluster.create(kube.PODDISRUPTIONBUDGETS, theirs)
    await cluster.create(kube.POLICIES, policy("foreign", replicas=1))
    await cluster.wait_for_condition("foreign", "llm", "Ready", "False", "ReplicasNotReady")
    kept = await cluster.get(kube.PODDISRUPTIONBUDGETS, "foreign", "llm")
    assert kept is not None and kept["spec"] == theirs["spec"]


async def test_an_autoscaled_policy_without_replicas_starts_at_min_replicas(
    cluster: Cluster,
) -> None:
    body = policy("autoscaled", autoscale={"minReplicas": 3, "maxReplicas": 6})
    del body["spec"]["replicas"]
    await cluster.create(kube.POLICIES, body)
    # Written into the spec: the scale subresource (kubectl scale, an HPA) needs a count.
    filled = await cluster.wait_for(
        kube.POLICIES, "autoscaled", "llm",
        lambda p: p["spec"].get("replicas") == 3, "spec.replicas filled in with minReplicas",
    )
    assert filled["spec"]["autoscale"] == {"minReplicas": 3, "maxReplicas": 6}
    await cluster.wait_for(
        kube.DEPLOYMENTS, "autoscaled", "llm", lambda d: d["spec"]["replicas"] == 3,
        "a Deployment of 3 replicas",
    )
    await cluster.wait_for(kube.PODDISRUPTIONBUDGETS, "autoscaled", "llm")
    filled_in = "set spec.replicas to 3 (autoscale.minReplicas: it was omitted)"
    await cluster.wait_for_events(
        "autoscaled", "llm", lambda e: e["message"] == filled_in, f"the Event {filled_in!r}"
    )


def test_every_call_the_operator_made_is_granted(cluster: Cluster) -> None:
    # Runs after the scenarios above (file order): the budget's create, patch and delete too.
    made = {(c.group, c.resource, c.verb) for c in cluster.emulator.operator_calls(0, math.inf)}
    budget_calls = {("policy", "poddisruptionbudgets", v) for v in ("create", "delete", "watch")}
    assert budget_calls <= made
    assert ("batchpilot.io", "batchingpolicies", "patch") in made  # the filled-in replicas
    assert made <= granted_by_cluster_role()
