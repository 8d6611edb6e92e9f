"""BatchingPolicy objects as a user would apply them, for tests of the CRD and the operator."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def policy_object(
    name: str, namespace: str, spec: Mapping[str, Any], **metadata: str
) -> dict[str, Any]:
    """A BatchingPolicy named `namespace/name` with `spec`; `metadata` adds fields such as uid."""
    return {
        "apiVersion": "batchpilot.io/v1alpha1",
        "kind": "BatchingPolicy",
        "metadata": {"name": name, "namespace": namespace, **metadata},
        "spec": dict(spec),
    }
