"""The replica rule's plug point in a cluster: one policy's `spec.replicas`, moved through /scale.

`KubernetesScaler` is the tuning loop's `Scaler` for one BatchingPolicy and
one round (built each round with the round's ready pods, as the actuator is):

- `fleet()`: the count of record is the policy's `spec.replicas`, the ready
  count is the round's ready pods. None, so that the rule stands back, when
  the policy has no `spec.autoscale` (the user's count stands), or when a
  HorizontalPodAutoscaler in the namespace targets the policy: the HPA owns
  the count then, and two owners would fight. A KEDA ScaledObject works
  through an HPA it creates, so this covers KEDA too.
- `scale(decision)`: writes the count through the policy's scale
  subresource, the way `kubectl scale` and an HPA do. Reconcile makes the
  Deployment follow `spec.replicas`; new pods read the tuned config from the
  ConfigMap when they start, so a scale-out never resets tuning. A scale-in
  is the Deployment's: its pods drain on SIGTERM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchpilot_operator import builders, kube
from batchpilot_operator.pods import ReadyPod
from batchpilot_operator.policy.types import Fleet, ScaleDecision
from batchpilot_operator.spec import PolicySpec


def targets_policy(hpa: Mapping[str, Any], policy_name: str) -> bool:
    """Whether the HPA's scaleTargetRef names this BatchingPolicy (its apiVersion is optional
    in autoscaling/v2; when given, its group must be ours)."""
    ref = (hpa.get("spec") or {}).get("scaleTargetRef") or {}
    group = str(ref.get("apiVersion") or "").partition("/")[0]
    return (
        ref.get("kind") == builders.KIND
        and ref.get("name") == policy_name
        and group in ("", builders.GROUP)
    )


async def external_scaler(client: kube.Client, namespace: str, policy_name: str) -> str | None:
    """The name of an HPA that targets the policy, if one does (the first by name)."""
    hpas = await client.list(kube.HORIZONTAL_POD_AUTOSCALERS, namespace)
    names = sorted(h["metadata"]["name"] for h in hpas if targets_policy(h, policy_name))
    return names[0] if names else None


class KubernetesScaler:
    """tuning_loop.Scaler for one policy and one round."""

    def __init__(
        self, client: kube.Client, policy: Mapping[str, Any], spec: PolicySpec,
        pods: list[ReadyPod],
    ) -> None:  # fmt: skip
        self.client = client
        self.namespace = policy["metadata"]["namespace"]
        self.name = policy["metadata"]["name"]
        self.spec = spec
        self.pods = pods
        # The HPA that owns the count, once fleet() found one: the record says so.
        self.external: str | None = None

    async def fleet(self) -> Fleet | None:
        if self.spec.autoscale is None:
            return None
        self.external = await external_scaler(self.client, self.namespace, self.name)
        if self.external is not None:
            return None
        return Fleet(desired=self.spec.replicas, ready=len(self.pods))

    async def scale(self, decision: ScaleDecision) -> None:
        await self.client.scale(kube.POLICIES, self.namespace, self.name, decision.replicas)
