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
from tests.support.manifests import (
    ENTRY_POINTS,
    OPERATOR,
    operator_object,
    render,
    render_manifests,
    served_namespaces,
    service_url_target,
)

pytestmark = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    return render_manifests()


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


def test_every_object_parses_with_identity(rendered: list[dict[str, Any]]) -> None:
    assert {d["kind"] for d in rendered} >= {
        "Namespace",
        "CustomResourceDefinition",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Deployment",
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


@pytest.fixture(scope="module")
def entry_points() -> dict[str, list[dict[str, Any]]]:
    return {name: render(directory) for name, directory in ENTRY_POINTS.items()}


def operator_args(docs: list[dict[str, Any]]) -> list[str]:
    return operator_object(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]["args"]


def server_image_default(docs: list[dict[str, Any]]) -> str:
    (version,) = one(docs, "CustomResourceDefinition")["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return spec["properties"]["server"]["properties"]["image"]["default"]


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_every_entry_point_renders_the_operator_in_its_namespace(
    entry_points: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = entry_points[name]
    namespace = one(docs, "Namespace")["metadata"]["name"]
    cluster_scoped = {"Namespace", "CustomResourceDefinition", "ClusterRole", "ClusterRoleBinding"}
    # manifests/namespaced/: the operator's Role and its binding live where it serves
    served = served_namespaces(operator_args(docs))
    for doc in docs:
        if doc["kind"] in ("Role", "RoleBinding") and doc["metadata"]["name"] == OPERATOR:
            assert doc["metadata"].get("namespace") in served, (name, doc["metadata"])
        elif doc["kind"] not in cluster_scoped:
            assert doc["metadata"].get("namespace") == namespace, (name, doc["metadata"])
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "batchpilot"
    assert operator_args(docs)[0] == "operator"


def image_entry() -> str:
    """The one `images:` entry the manifests name the image by, as NAME:TAG."""
    (entry,) = yaml.safe_load((ROOT / "manifests" / "base" / "kustomization.yaml").read_text())[
        "images"
    ]
    return f"{entry['newName']}:{entry['newTag']}"


@pytest.mark.parametrize("name", ENTRY_POINTS)
def test_the_image_is_set_in_one_place_for_the_operator_and_the_servers(
    entry_points: dict[str, list[dict[str, Any]]], name: str
) -> None:
    docs = entry_points[name]
    (container,) = operator_object(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert container["image"] == image_entry()
    # A policy without server.image gets the CRD's default: the same entry.
    assert server_image_default(docs) == image_entry()


def test_a_changed_image_entry_reaches_the_operator_and_the_crd_default(tmp_path: Path) -> None:
    # What docs/kubernetes.md says to do: edit the entry in a copy of the repository.
    for folder in ("manifests", "crds"):
        shutil.copytree(ROOT / folder, tmp_path / folder)
    base = tmp_path / "manifests" / "base" / "kustomization.yaml"
    kustomization = yaml.safe_load(base.read_text())
    kustomization["images"] = [
        {"name": "batchpilot", "newName": "registry.example/bp", "newTag": "9.9"}
    ]
    base.write_text(yaml.safe_dump(kustomization))
    for directory in (tmp_path / "manifests", tmp_path / "manifests" / "kube-prometheus-stack"):
        docs = render(directory)
        (container,) = operator_object(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
        assert container["image"] == "registry.example/bp:9.9"
        assert server_image_default(docs) == "registry.example/bp:9.9"


def test_monitoring_is_a_component_the_base_does_without(
    entry_points: dict[str, list[dict[str, Any]]],
) -> None:
    def kinds(docs: list[dict[str, Any]]) -> set[tuple[str, str]]:
        return {(d["kind"], d["metadata"]["name"]) for d in docs}

    base, full = entry_points["base"], entry_points["with-monitoring"]
    monitoring = kinds(full) - kinds(base)
    assert ("Service", "batchpilot-prometheus") in monitoring
    assert ("ConfigMap", "batchpilot-grafana-dashboards") in monitoring
    assert not [d for d in base if "prometheus" in d["metadata"]["name"]]
    # Without a Prometheus the operator scrapes the pods itself: it names none.
    assert "--prometheus-url" not in operator_args(base)
    assert "--prometheus-url" in operator_args(full)


def test_the_kube_prometheus_stack_path_uses_podmonitors_and_the_charts_prometheus(
    entry_points: dict[str, list[dict[str, Any]]],
) -> None:
    docs = entry_points["kube-prometheus-stack"]
    assert not [d for d in docs if d["kind"] == "Service"]  # no Prometheus of its own
    monitors = [d for d in docs if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["kind"] for d in monitors} == {"PodMonitor", "PrometheusRule"}
    for monitor in monitors:  # what the chart's Prometheus selects them by
        assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    dashboards = [d for d in docs if d["metadata"]["name"] == "batchpilot-grafana-dashboards"]
    assert dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    args = operator_args(docs)
    url = args[args.index("--prometheus-url") + 1]
    assert url == "http://kube-prometheus-stack-prometheus.monitoring.svc:9090"


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
    assert service_url_target(rendered, url) == (service, port)


# Every example policy: a plain file (a preset) or a kustomize directory (weights in a claim).
EXAMPLES_DIR = ROOT / "manifests" / "examples"
EXAMPLES = sorted([*EXAMPLES_DIR.glob("*.yaml"), *EXAMPLES_DIR.glob("*/kustomization.yaml")])


def example_policy(path: Path) -> dict[str, Any]:
    docs = render(path.parent) if path.name == "kustomization.yaml" else [
        yaml.safe_load(path.read_text())
    ]  # fmt: skip
    return one(docs, "BatchingPolicy")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.relative_to(EXAMPLES_DIR).as_posix())
def test_every_example_policy_reads_a_prometheus_the_manifests_run(
    rendered: list[dict[str, Any]], path: Path
) -> None:
    policy = example_policy(path)
    url = policy["spec"].get("autotune", {}).get("prometheusUrl", "")
    if not url:  # the operator's own --prometheus-url
        args = operator_args(rendered)
        url = args[args.index("--prometheus-url") + 1]
    services = [
        (d["metadata"]["name"], d["metadata"].get("namespace"))
        for d in rendered
        if d["kind"] == "Service"
    ]
    assert service_url_target(rendered, url) is not None, (
        f"{path.name}: prometheusUrl {url} reaches none of the Services "
        f"`kubectl kustomize manifests/` renders: {services}"
    )


def test_a_url_to_no_rendered_service_is_not_resolved(rendered: list[dict[str, Any]]) -> None:
    # the URL gpu-policy.yaml once carried: no Service is called `prometheus`
    assert service_url_target(rendered, "http://prometheus.batchpilot-system:9090") is None
    assert service_url_target(rendered, "http://batchpilot-prometheus.default.svc:9090") is None
    wrong_port = "http://batchpilot-prometheus.batchpilot-system:9091"
    assert service_url_target(rendered, wrong_port) is None


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


GATEWAY_DIR = ROOT / "manifests" / "examples" / "inference-gateway"


def test_the_gateway_objectives_are_the_classes_of_the_policy_the_pool_selects() -> None:
    """An InferenceObjective per class of the policy behind the InferencePool, named as the
    class (the x-gateway-inference-objective header the pods read), with its priority."""
    pool = one(list(yaml.safe_load_all((GATEWAY_DIR / "inferencepool.yaml").read_text())),
               "InferencePool")  # fmt: skip
    policy = yaml.safe_load((ROOT / "manifests" / "examples" / "cpu-policy.yaml").read_text())
    assert refusals(policy) == []
    assert (
        pool["spec"]["selector"]["matchLabels"]["batchpilot.io/policy"]
        == (policy["metadata"]["name"])
    )
    objectives = list(yaml.safe_load_all((GATEWAY_DIR / "inferenceobjectives.yaml").read_text()))
    assert {o["kind"] for o in objectives} == {"InferenceObjective"}
    assert {o["apiVersion"] for o in objectives} == {"inference.networking.x-k8s.io/v1alpha2"}
    classes = parse_spec(with_defaults(SCHEMA, policy)["spec"]).slo.classes
    assert len(classes) == 2
    assert {o["metadata"]["name"]: o["spec"]["priority"] for o in objectives} == {
        c.name: c.priority for c in classes
    }
    for objective in objectives:
        assert objective["metadata"]["namespace"] == pool["metadata"]["namespace"]
        assert objective["spec"]["poolRef"] == {
            "group": pool["apiVersion"].split("/")[0],
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
