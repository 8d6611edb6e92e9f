"""The manifests as `kubectl kustomize` renders them, and the operator's objects among them."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from tests.support import ROOT

Grant = tuple[str, str, str]  # (apiGroup, resource[/subresource], verb)
OPERATOR = "batchpilot-operator"  # its ServiceAccount, ClusterRole, binding and Deployment


def render(directory: Path) -> list[dict[str, Any]]:
    out = subprocess.run(
        ["kubectl", "kustomize", str(directory)],
        check=True, capture_output=True, text=True, timeout=60,
    ).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_manifests() -> list[dict[str, Any]]:
    """`kubectl apply -k manifests/`: the operator with the bundled monitoring component."""
    return render(ROOT / "manifests")


# What a user applies with `kubectl apply -k`: each renders the whole operator.
ENTRY_POINTS = {
    "with-monitoring": ROOT / "manifests",
    "base": ROOT / "manifests" / "base",
    "kube-prometheus-stack": ROOT / "manifests" / "kube-prometheus-stack",
    "namespaced": ROOT / "manifests" / "namespaced",
}


def service_url_target(docs: list[dict[str, Any]], url: str) -> tuple[dict[str, Any], int] | None:
    """The Service and port that an in-cluster URL (http://NAME.NAMESPACE[.svc...]:PORT) reaches
    among `docs`, or None."""
    parsed = urlparse(url)
    host, port = parsed.hostname or "", parsed.port
    name, _, rest = host.partition(".")
    namespace, _, domain = rest.partition(".")
    if domain not in ("", "svc", "svc.cluster.local"):
        return None
    for doc in docs:
        meta = doc["metadata"]
        if doc["kind"] != "Service" or meta["name"] != name:
            continue
        if namespace and meta.get("namespace") != namespace:
            continue
        ports = [p["port"] for p in doc["spec"]["ports"]]
        if port in ports:
            return doc, port
    return None


def operator_object(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The operator's object of `kind`: the base holds Prometheus's account, role and more too."""
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == OPERATOR]
    return found


def served_namespaces(operator_args: list[str]) -> set[str]:
    """The namespaces `batchpilot operator ARGS` serves by name (none with --all-namespaces)."""
    return {value for flag, value in itertools.pairwise(operator_args) if flag == "--namespace"}


def grants(role: dict[str, Any]) -> set[Grant]:
    """What a Role or ClusterRole grants, one (apiGroup, resource, verb) at a time."""
    return {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }


def cluster_role() -> dict[str, Any]:
    return operator_object(render_manifests(), "ClusterRole")


def granted_by_cluster_role() -> set[Grant]:
    return grants(cluster_role())
