"""`kubectl kustomize manifests/` renders, and what it renders is what the operator needs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from batchpilot_operator.spec import ModelReference, parse_spec

from tests.support import ROOT
from tests.support.crd import SCHEMA, refusals, with_defaults
from tests.support.manifests import operator_object, render, render_manifests

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return render_manifests()


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def test_every_object_parses_with_identity(rendered: list[dict[str, Any]]) -> None:
    assert {d["kind"] for d in rendered} >= {
        "Namespace", "CustomResourceDefinition", "ServiceAccount", "ClusterRole",
        "ClusterRoleBinding", "Deployment",
    }
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    namespace = one(rendered, "Namespace")["metadata"]["name"]
    for doc in rendered:
        assert doc["apiVersion"] and doc["metadata"]["name"]
        if doc["kind"] not in cluster_scoped:
            assert doc["metadata"]["namespace"] == namespace, doc["metadata"]


def test_the_crd_is_the_one_in_crds(rendered: list[dict[str, Any]]) -> None:
    crd = one(rendered, "CustomResourceDefinition")
    source = yaml.safe_load((ROOT / "crds" / "batchingpolicy.yaml").read_text())
    assert crd["spec"] == source["spec"]


def test_operator_runs_locked_down_with_probes_on_its_liveness_port(
    rendered: list[dict[str, Any]],
) -> None:
    deployment = operator_object(rendered, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["args"][0] == "operator"
    port = int(container["args"][container["args"].index("--liveness-port") + 1])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["path"] == "/healthz"
        assert ports[container[probe]["httpGet"]["port"]] == port
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert not security["allowPrivilegeEscalation"]
    assert pod["securityContext"]["runAsNonRoot"]
    assert deployment["spec"]["replicas"] == 1


def test_operator_reads_signals_from_the_prometheus_the_base_ships(
    rendered: list[dict[str, Any]],
) -> None:
    args = operator_object(rendered, "Deployment")["spec"]["template"]["spec"]["containers"][0][
        "args"
    ]
    url = args[args.index("--prometheus-url") + 1]
    services = [
        d for d in rendered if d["kind"] == "Service" and "prometheus" in d["metadata"]["name"]
    ]
    (service,) = services
    meta = service["metadata"]
    port = service["spec"]["ports"][0]["port"]
    assert url == f"http://{meta['name']}.{meta['namespace']}.svc:{port}"


# Policies of weights in a volume: kustomize directories with the claim and a Job that fills it.
MODEL_EXAMPLES = sorted(
    p.parent for p in (ROOT / "manifests" / "examples").glob("*/kustomization.yaml")
)


def test_there_are_real_model_examples() -> None:
    assert [d.name for d in MODEL_EXAMPLES] == ["llama3-8b-gpu", "smollm2-cpu"]


@pytest.mark.parametrize("directory", MODEL_EXAMPLES, ids=lambda d: d.name)
def test_a_real_model_example_brings_the_claim_its_policy_reads(directory: Path) -> None:
    docs = render(directory)
    policy = one(docs, "BatchingPolicy")
    assert refusals(policy) == []
    spec = parse_spec(with_defaults(SCHEMA, policy)["spec"])
    reference = spec.server.model
    assert isinstance(reference, ModelReference)
    claim = one(docs, "PersistentVolumeClaim")
    assert claim["metadata"]["name"] == reference.claim_name
    assert claim["metadata"]["namespace"] == policy["metadata"]["namespace"]
    # The Job that fills the claim writes where the server will read.
    pod = one(docs, "Job")["spec"]["template"]["spec"]
    (volume,) = pod["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == reference.claim_name
    (container,) = pod["containers"]
    (mount,) = container["volumeMounts"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TARGET"] == f"{mount['mountPath']}/{reference.path}"
    assert reference.sub_path is None  # the Job fills the volume's root
