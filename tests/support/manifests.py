"""The manifests as `kubectl kustomize` renders them, and the operator's objects among them."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

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
    return render(ROOT / "manifests")


def operator_object(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """The operator's object of `kind`: the base holds Prometheus's account, role and more too."""
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == OPERATOR]
    return found


def cluster_role() -> dict[str, Any]:
    return operator_object(render_manifests(), "ClusterRole")


def granted_by_cluster_role() -> set[Grant]:
    return {
        (group, resource, verb)
        for rule in cluster_role()["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
