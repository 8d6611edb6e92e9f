"""A policy's ready pods: listed once per tuning round, for the signals and the actuator alike.

The direct scrape reads each pod's `/metrics` and the actuator pushes to each
pod's `/admin/batching`; both take this one list, so a round lists the pods
once and both act on the same pods.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchpilot_operator import builders
from batchpilot_operator.kube import PODS, Client


@dataclass(frozen=True)
class ReadyPod:
    name: str
    url: str  # the server's base URL


async def ready_pods(client: Client, namespace: str, policy_name: str) -> list[ReadyPod]:
    """Every ready pod of the policy that has an IP."""
    pods = await client.list(PODS, namespace, builders.selector_labels(policy_name))
    return [
        ReadyPod(pod["metadata"]["name"], f"http://{pod['status']['podIP']}:{pod_port(pod)}")
        for pod in pods
        if is_ready(pod) and (pod.get("status") or {}).get("podIP")
    ]


def is_ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def pod_port(pod: Mapping[str, Any]) -> int:
    """The server's container port named `http` (the Deployment's), else the default."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == "http" and port.get("containerPort"):
                return int(port["containerPort"])
    return builders.SERVER_PORT
