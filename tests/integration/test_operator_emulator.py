"""The emulator fills kmock's gaps the way a real API server behaves (the gaps
k8s_emulator.py's docstring lists)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from batchpilot_operator import kube

from tests.support.k8s_emulator import Cluster, run_cluster
from tests.support.policies import policy_object


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running:
        yield running


def config_map(name: str, **meta: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": "emu", **meta}, "data": {"k": "v"}}


async def test_created_objects_get_identity_and_versions(cluster: Cluster) -> None:
    first = await cluster.create(kube.CONFIGMAPS, config_map("a"))
    meta = first["metadata"]
    assert meta["uid"] and meta["creationTimestamp"] and meta["generation"] == 1
    patched = await cluster.patch(kube.CONFIGMAPS, "emu", "a", {"data": {"k": "w"}})
    assert int(patched["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert patched["metadata"]["uid"] == meta["uid"]


async def test_spec_patches_bump_generation_status_patches_do_not(cluster: Cluster) -> None:
    await cluster.create(kube.POLICIES, policy_object("g", "emu", {"replicas": 1}))
    await cluster.patch(kube.POLICIES, "emu", "g", {"status": {"readyReplicas": 1}}, "status")
    after_status = await cluster.get(kube.POLICIES, "emu", "g")
    assert after_status is not None and after_status["metadata"]["generation"] == 1
    spec = await cluster.patch(kube.POLICIES, "emu", "g", {"spec": {"replicas": 2}})
    assert spec["metadata"]["generation"] == 2


async def test_generate_name_gives_distinct_names(cluster: Cluster) -> None:
    made = [
        await cluster.create(kube.EVENTS, {"metadata": {"generateName": "ev-", "namespace": "emu"}})
        for _ in range(2)
    ]
    names = {m["metadata"]["name"] for m in made}
    assert len(names) == 2 and all(n.startswith("ev-") for n in names)


async def test_failed_json_patch_test_is_a_422_conflict(cluster: Cluster) -> None:
    await cluster.create(kube.CONFIGMAPS, config_map("j"))
    ops = [{"op": "test", "path": "/metadata/resourceVersion", "value": "stale"},
           {"op": "add", "path": "/data/x", "value": "y"}]
    status, body = await cluster.request(
        "PATCH", kube.CONFIGMAPS.path("emu", "j"), ops, "application/json-patch+json"
    )
    assert (status, body["code"]) == (422, 422)
    unchanged = await cluster.get(kube.CONFIGMAPS, "emu", "j")
    assert unchanged is not None and "x" not in unchanged["data"]


async def test_list_honours_label_selectors(cluster: Cluster) -> None:
    await cluster.create(kube.CONFIGMAPS, config_map("l1", labels={"team": "a"}))
    await cluster.create(kube.CONFIGMAPS, config_map("l2", labels={"team": "b"}))
    found = await cluster.list(kube.CONFIGMAPS, "emu", {"team": "a"})
    assert [item["metadata"]["name"] for item in found] == ["l1"]


async def test_deleting_an_owner_collects_its_dependents(cluster: Cluster) -> None:
    owner = await cluster.create(kube.CONFIGMAPS, config_map("owner"))
    ref = {"apiVersion": "v1", "kind": "ConfigMap", "name": "owner",
           "uid": owner["metadata"]["uid"]}
    await cluster.create(kube.CONFIGMAPS, config_map("child", ownerReferences=[ref]))
    await cluster.delete(kube.CONFIGMAPS, "emu", "owner")
    assert await cluster.get(kube.CONFIGMAPS, "emu", "child") is None
