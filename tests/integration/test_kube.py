"""The operator's API client (`kube.Client`) over real HTTP to the emulator.

Each declared call reaches the API as the ClusterRole sees it, an undeclared
call never leaves the process, and the API's errors keep their status.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from batchpilot_operator import kube

from tests.support.k8s_emulator import Cluster, Fault, run_cluster
from tests.support.servers import free_port


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running:
        yield running


@pytest.fixture
async def client(cluster: Cluster) -> AsyncIterator[kube.Client]:
    made = kube.Client.for_url(cluster.url)
    yield made
    await made.close()


@pytest.fixture
def fault(cluster: Cluster, request: pytest.FixtureRequest) -> Iterator[Fault]:
    """The `Fault` the test is parametrized with, answered by the emulator meanwhile."""
    injected: Fault = request.param
    cluster.emulator.faults.append(injected)
    try:
        yield injected
    finally:
        cluster.emulator.faults.remove(injected)


def bare(kind: kube.Kind, namespace: str, name: str) -> dict[str, Any]:
    return {
        "apiVersion": kind.api_version,
        "kind": kind.kind,
        "metadata": {"name": name, "namespace": namespace},
    }


def valid(kind: kube.Kind, namespace: str, name: str) -> dict[str, Any]:
    """The least body the client's models accept for `kind` (it checks creates before sending)."""
    body = bare(kind, namespace, name)
    if kind == kube.DEPLOYMENTS:
        labels = {"app": name}
        body["spec"] = {
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        }
    if kind == kube.EVENTS:
        body["involvedObject"] = {"kind": "ConfigMap", "name": name, "namespace": namespace}
    if kind == kube.POLICIES:  # the scale subresource reads spec.replicas
        body["spec"] = {"replicas": 1}
    return body


def config_map(namespace: str, name: str) -> dict[str, Any]:
    return {**bare(kube.CONFIGMAPS, namespace, name), "data": {"a": "1", "b": "1"}}


async def call(
    client: kube.Client, kind: kube.Kind, sub: str | None, verb: str, namespace: str, name: str
) -> None:
    if verb == "get":
        assert await client.get(kind, namespace, name) is not None
    elif verb == "list":
        assert [o["metadata"]["name"] for o in await client.list(kind, namespace)] == [name]
    elif verb == "create":
        await client.create(kind, namespace, valid(kind, namespace, name + "-new"))
    elif verb == "delete":  # what "create" made (sorted, it comes first): the rest need `name`
        assert await client.delete(kind, namespace, name + "-new")
    elif sub == "scale":  # a replica count, as kubectl scale writes one
        assert (await client.scale(kind, namespace, name, 2))["spec"]["replicas"] == 2
    else:
        patch = {"status": {"seen": True}} if sub else {"metadata": {"labels": {"seen": "yes"}}}
        patched = await client.patch(kind, namespace, name, patch, sub)
        assert patched["metadata"]["name"] == name


async def test_every_declared_call_reaches_the_api_as_declared(
    cluster: Cluster, client: kube.Client
) -> None:
    namespace = "declared"
    for kind in {kind for kind, _ in kube.PERMISSIONS}:
        await cluster.create(kind, valid(kind, namespace, kind.plural))
    since = time.monotonic()
    for (kind, sub), verbs in kube.PERMISSIONS.items():
        for verb in sorted(verbs):
            await call(client, kind, sub, verb, namespace, kind.plural)
    made = {
        (c.group, c.resource, c.verb)
        for c in cluster.emulator.operator_calls(since, time.monotonic())
    }
    declared = {
        (kind.group, kind.plural + (f"/{sub}" if sub else ""), verb)
        for (kind, sub), verbs in kube.PERMISSIONS.items()
        for verb in verbs
    }
    assert made == declared


async def test_an_undeclared_call_never_leaves_the_process(
    cluster: Cluster, client: kube.Client
) -> None:
    before = len(cluster.emulator.calls)
    with pytest.raises(kube.UndeclaredCall, match="create batchingpolicies is not in"):
        await client.create(kube.POLICIES, "undeclared", bare(kube.POLICIES, "undeclared", "p"))
    with pytest.raises(kube.UndeclaredCall, match="patch secrets is not in"):
        await client.patch(kube.SECRETS, "undeclared", "s", {"data": {}})
    assert len(cluster.emulator.calls) == before


async def test_a_body_the_client_refuses_is_a_422_that_never_leaves_the_process(
    cluster: Cluster, client: kube.Client
) -> None:
    before = len(cluster.emulator.calls)
    with pytest.raises(kube.KubeError) as raised:  # a Deployment needs a spec
        await client.create(kube.DEPLOYMENTS, "invalid", bare(kube.DEPLOYMENTS, "invalid", "d"))
    assert (raised.value.status, raised.value.reason) == (422, "Invalid")
    assert "spec" in raised.value.message
    assert len(cluster.emulator.calls) == before


async def test_patches_are_json_merge_patches(cluster: Cluster, client: kube.Client) -> None:
    # Not the client's default for built-in kinds (strategic merge): None must remove a key.
    await cluster.create(kube.CONFIGMAPS, config_map("merge", "cm"))
    patched = await client.patch(kube.CONFIGMAPS, "merge", "cm", {"data": {"a": None, "b": "2"}})
    assert patched["data"] == {"b": "2"}
    requests = [
        r for r in cluster.emulator.requests if r.method == "PATCH" and r.namespace == "merge"
    ]
    assert [r.headers.get("Content-Type") for r in requests] == [kube.MERGE_PATCH]


async def test_a_missing_object_is_none(client: kube.Client) -> None:
    assert await client.get(kube.CONFIGMAPS, "nowhere", "absent") is None


@pytest.mark.parametrize(
    ("fault", "error"),
    [
        (Fault(409, verbs=frozenset({"create"})), kube.Conflict),
        (Fault(422, verbs=frozenset({"create"})), kube.KubeError),
        (Fault(429, verbs=frozenset({"create"}), retry_after_s=1), kube.KubeError),
        (Fault(500, verbs=frozenset({"create"})), kube.KubeError),
        (Fault(503, verbs=frozenset({"create"})), kube.KubeError),
    ],
    indirect=["fault"],
    ids=["409", "422", "429", "500", "503"],
)
async def test_a_refused_write_is_a_typed_error_and_not_resent(
    client: kube.Client, fault: Fault, error: type[kube.KubeError]
) -> None:
    with pytest.raises(kube.KubeError) as raised:
        await client.create(kube.CONFIGMAPS, "refused", config_map("refused", "cm"))
    assert type(raised.value) is error
    assert raised.value.status == fault.status
    assert f"injected fault {fault.status}" in str(raised.value)
    assert fault.hits == 1  # a write that may have happened is the caller's to retry


@pytest.mark.parametrize(
    "fault",
    [Fault(429, verbs=frozenset({"get"}), retry_after_s=1, times=2)],
    indirect=True,
)
async def test_a_read_answered_429_is_sent_again_after_retry_after(
    cluster: Cluster, client: kube.Client, fault: Fault
) -> None:
    await cluster.create(kube.CONFIGMAPS, config_map("patient", "cm"))
    start = time.monotonic()
    found = await client.get(kube.CONFIGMAPS, "patient", "cm")
    waited = time.monotonic() - start
    assert found is not None and fault.hits == 2
    assert waited >= 2 * fault.retry_after_s  # type: ignore[operator]


async def test_an_api_server_that_does_not_answer_is_unreachable() -> None:
    client = kube.Client.for_url(f"http://127.0.0.1:{free_port()}")
    try:
        with pytest.raises(kube.Unreachable) as raised:
            await client.get(kube.CONFIGMAPS, "any", "cm")
    finally:
        await client.close()
    assert isinstance(raised.value, kube.KubeError) and raised.value.status == 0
