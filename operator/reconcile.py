"""Reconcile one BatchingPolicy: desired owned objects vs. actual, status, Events.

Plain async functions over `kube.Client`; the Kopf handlers only call them.
Every write is conditional on a difference, so running `reconcile` again on
an unchanged world makes no API writes (no event storms from our own patches).
"""

from __future__ import annotations

import base64
import datetime
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpilot_operator import builders
from batchpilot_operator.kube import (
    CONFIGMAPS,
    DEPLOYMENTS,
    PODDISRUPTIONBUDGETS,
    POLICIES,
    SECRETS,
    SERVICES,
    Client,
    Conflict,
    Kind,
    label_selector,
)
from batchpilot_operator.slo_status import target_fields
from batchpilot_operator.spec import PolicySpec, SpecError, parse_spec
from batchpilot_server.batching_config import BatchingConfig, Mode

logger = logging.getLogger(__name__)

READY = "Ready"


@dataclass
class Outcome:
    """What one reconcile did and saw."""

    spec: PolicySpec | None
    config: BatchingConfig | None = None
    mode: Mode | None = None  # the batching mode in force (the ConfigMap's record)
    replicas: int = 0  # the Deployment's pods now (its status.replicas)
    ready_replicas: int = 0
    actions: list[str] = field(default_factory=list)
    error: SpecError | None = None


async def reconcile(client: Client, policy: Mapping[str, Any]) -> Outcome:
    """Bring the owned objects and the status of `policy` to what its spec asks."""
    try:
        spec = parse_spec(policy.get("spec") or {})
    except SpecError as exc:
        await _report_invalid(client, policy, exc)
        return Outcome(spec=None, error=exc)
    outcome = Outcome(spec=spec)
    await _fill_in_replicas(client, policy, spec, outcome)
    if (created := await ensure_admin_token(client, policy)) is not None:
        outcome.actions.append(created)
    outcome.config, outcome.mode = await _ensure_config_map(client, policy, spec, outcome)
    await _ensure(client, SERVICES, builders.build_service(policy), outcome)
    deployment = await _ensure(
        client, DEPLOYMENTS, builders.build_deployment(policy, spec, outcome.mode), outcome
    )
    await _ensure_disruption_budget(client, policy, spec, outcome)
    deployment_status = deployment.get("status") or {}
    outcome.replicas = int(deployment_status.get("replicas") or 0)
    outcome.ready_replicas = int(deployment_status.get("readyReplicas") or 0)
    for action in outcome.actions:
        await client.create_event(policy, "Reconciled", action)
    await write_status(client, policy, _status_fields(policy, outcome), [_ready(spec, outcome)])
    return outcome


async def _report_invalid(client: Client, policy: Mapping[str, Any], exc: SpecError) -> None:
    condition = {"type": READY, "status": "False", "reason": exc.reason, "message": exc.message}
    fields = reconcile_fields(policy, Outcome(spec=None, error=exc))
    if await write_status(client, policy, fields, [condition]):
        # Only on a change of status: a re-sent invalid spec does not repeat the Event.
        await client.create_event(policy, exc.reason, exc.message, "Warning")


async def _ensure(
    client: Client, kind: Kind, desired: dict[str, Any], outcome: Outcome
) -> dict[str, Any]:
    """Create `desired` if absent, patch it if it drifted; return the object as it is now."""
    meta = desired["metadata"]
    actual = await client.get(kind, meta["namespace"], meta["name"])
    if actual is None:
        try:
            created = await client.create(kind, meta["namespace"], desired)
        except Conflict:  # a concurrent reconcile created it first: converge on the next pass
            return await client.get(kind, meta["namespace"], meta["name"]) or desired
        outcome.actions.append(f"created {kind.kind} {meta['name']}")
        return created
    if is_subset(desired, actual):
        return actual
    patched = await client.patch(kind, meta["namespace"], meta["name"], desired)
    outcome.actions.append(f"updated {kind.kind} {meta['name']}")
    return patched


async def _fill_in_replicas(
    client: Client, policy: Mapping[str, Any], spec: PolicySpec, outcome: Outcome
) -> None:
    """Write an omitted spec.replicas (the parsed default) into the policy: the scale
    subresource, and so kubectl scale and an HPA, refuses a policy without one."""
    if (policy.get("spec") or {}).get("replicas") is not None:
        return
    meta = policy["metadata"]
    filled = {"spec": {"replicas": spec.replicas}}
    await client.patch(POLICIES, meta["namespace"], meta["name"], filled)
    origin = "autoscale.minReplicas" if spec.autoscale is not None else "the default"
    outcome.actions.append(f"set spec.replicas to {spec.replicas} ({origin}: it was omitted)")


async def _ensure_disruption_budget(
    client: Client, policy: Mapping[str, Any], spec: PolicySpec, outcome: Outcome
) -> None:
    """The PodDisruptionBudget while the policy runs 2 or more replicas; removed below that."""
    desired = builders.build_disruption_budget(policy, spec)
    if desired is not None:
        await _ensure(client, PODDISRUPTIONBUDGETS, desired, outcome)
        return
    meta = policy["metadata"]
    actual = await client.get(PODDISRUPTIONBUDGETS, meta["namespace"], meta["name"])
    if actual is None or not _owned_by(actual, policy):
        return  # none, or someone else's: never delete what we did not create
    if await client.delete(PODDISRUPTIONBUDGETS, meta["namespace"], meta["name"]):
        outcome.actions.append(
            f"deleted PodDisruptionBudget {meta['name']}: {spec.replicas} replica(s) "
            f"(a budget needs {builders.DISRUPTION_BUDGET_MIN_REPLICAS})"
        )


def _owned_by(obj: Mapping[str, Any], policy: Mapping[str, Any]) -> bool:
    uid = policy["metadata"].get("uid")
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid for ref in refs)


async def ensure_admin_token(client: Client, policy: Mapping[str, Any]) -> str | None:
    """Create the policy's admin-token Secret when it is missing; the action taken, or None.

    Read by name, never listed or watched: the operator may not read other Secrets.
    Reconcile and every tuning round call it, so a deleted token is back within one
    tuning interval (or at the next reconcile, if that comes first). An existing token is
    never regenerated: running pods hold it."""
    name = builders.secret_name(policy["metadata"]["name"])
    namespace = policy["metadata"]["namespace"]
    if await client.get(SECRETS, namespace, name) is not None:
        return None
    try:
        secret = builders.build_secret(policy, builders.new_admin_token())
        await client.create(SECRETS, namespace, secret)
    except Conflict:
        return None  # another writer created it meanwhile
    return f"created Secret {name}"


async def _ensure_config_map(
    client: Client, policy: Mapping[str, Any], spec: PolicySpec, outcome: Outcome
) -> tuple[BatchingConfig, Mode]:
    """The config in force, kept inside the spec's bounds (tuned values survive otherwise),
    and the mode in force: the spec's, or under auto the one the operator last chose."""
    metadata = policy["metadata"]
    data = await _config_map_data(client, metadata["namespace"], metadata["name"])
    in_force = builders.parse_config_data(data)
    config = spec.clamp(in_force) if in_force is not None else spec.initial_config()
    mode = builders.serving_mode(spec, builders.parse_mode_data(data))
    await _ensure(client, CONFIGMAPS, builders.build_config_map(policy, config, mode), outcome)
    if in_force is not None and config != in_force:
        outcome.actions.append(
            f"re-clamped batching config to maxBatchSize={config.max_batch_size} "
            f"batchTimeoutMs={config.batch_timeout_ms:g} maxQueueSize={config.max_queue_size} "
            f"numSpeculativeTokens={config.num_speculative_tokens}"
        )
    return config, mode


def _status_fields(policy: Mapping[str, Any], outcome: Outcome) -> dict[str, Any]:
    assert outcome.config is not None and outcome.spec is not None and outcome.mode is not None
    return {
        **in_force_fields(outcome.config, outcome.mode, outcome.spec),
        **reconcile_fields(policy, outcome),
    }


def in_force_fields(
    config: BatchingConfig, mode: Mode, spec: PolicySpec, mode_reason: str | None = None
) -> dict[str, Any]:
    """The only writer of the config and mode in force in the status (status_owners.py):
    reconcile calls it with the ConfigMap's values, and a tuning round through
    `write_in_force` once its decision is in the ConfigMap, so both show one source.

    Under `mode: auto` the reason is the round's choice (`mode_reason`); reconcile passes
    none and leaves the round's reason standing."""
    fields: dict[str, Any] = {
        "maxBatchSize": config.max_batch_size,
        "batchTimeoutMs": config.batch_timeout_ms,
        "numSpeculativeTokens": config.num_speculative_tokens,
        "mode": mode,
    }
    if spec.batching.mode != "auto":
        mode_reason = f"batching.mode is {spec.batching.mode}"
    if mode_reason is not None:
        fields["modeReason"] = mode_reason
    return fields


def reconcile_fields(policy: Mapping[str, Any], outcome: Outcome) -> dict[str, Any]:
    """The status keys only reconcile writes (status_owners.py): the generation acted on,
    and for a valid spec the Deployment's replicas and the stated SLO targets (so that
    `kubectl get bp` shows the objective before any round has measured)."""
    fields: dict[str, Any] = {"observedGeneration": _generation(policy)}
    if outcome.spec is None:  # invalid: nothing else is known
        return fields
    return {
        **fields,
        "replicas": outcome.replicas,
        "readyReplicas": outcome.ready_replicas,
        "selector": label_selector(builders.selector_labels(policy["metadata"]["name"])),
        "slo": target_fields(outcome.spec.slo),
    }


async def write_in_force(
    client: Client, policy: Mapping[str, Any], spec: PolicySpec, mode_reason: str | None = None
) -> bool:
    """Show the ConfigMap's config and mode in force in the status now (a tuning round
    calls it after its decision, inside the policy's lock), through the same
    `in_force_fields` reconcile uses; whether anything was written."""
    meta = policy["metadata"]
    data = await _config_map_data(client, meta["namespace"], meta["name"])
    in_force = builders.parse_config_data(data)
    if in_force is None:  # no ConfigMap yet: reconcile writes it, and the status with it
        return False
    mode = builders.serving_mode(spec, builders.parse_mode_data(data))
    return await write_status(
        client, policy, in_force_fields(spec.clamp(in_force), mode, spec, mode_reason)
    )


def _ready(spec: PolicySpec, outcome: Outcome) -> dict[str, str]:
    ready, wanted = outcome.ready_replicas, spec.replicas
    message = f"{ready}/{wanted} replicas ready"
    if ready >= wanted:
        return {"type": READY, "status": "True", "reason": "ReplicasReady", "message": message}
    return {"type": READY, "status": "False", "reason": "ReplicasNotReady", "message": message}


def _generation(policy: Mapping[str, Any]) -> int:
    return int(policy["metadata"].get("generation") or 0)


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def set_conditions(
    existing: Sequence[Mapping[str, Any]], updates: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """`existing` with `updates` merged by type.

    lastTransitionTime moves only when a condition's status changes.
    """
    merged = {c["type"]: dict(c) for c in existing if "type" in c}
    for update in updates:
        before = merged.get(update["type"], {})
        changed = before.get("status") != update["status"]
        stamp = before.get("lastTransitionTime") if not changed else None
        merged[update["type"]] = {**update, "lastTransitionTime": stamp or now_iso()}
    return list(merged.values())


async def write_status(
    client: Client,
    policy: Mapping[str, Any],
    fields: Mapping[str, Any],
    conditions: Sequence[Mapping[str, Any]] = (),
) -> bool:
    """Merge `fields` and `conditions` into the policy's status; write only what changed.

    Reads the policy afresh so that conditions others wrote (Tuning, SLOMet, ...)
    are kept. Returns whether anything was written.
    """
    meta = policy["metadata"]
    fresh = await client.get(POLICIES, meta["namespace"], meta["name"])
    if fresh is None:
        return False
    status = fresh.get("status") or {}
    patch = {key: value for key, value in fields.items() if _changes(status.get(key), value)}
    old_conditions = status.get("conditions") or []
    new_conditions = set_conditions(old_conditions, conditions)
    if _without_times(new_conditions) != _without_times(old_conditions):
        patch["conditions"] = new_conditions
    if not patch:
        return False
    await client.patch(POLICIES, meta["namespace"], meta["name"], {"status": patch}, "status")
    return True


def _changes(current: Any, merged: Any) -> bool:
    """Whether merging `merged` into `current` changes it (a merge patch: objects merge
    key by key, a null removes a key)."""
    if isinstance(current, Mapping) and isinstance(merged, Mapping):
        return any(
            key in current if value is None else _changes(current.get(key), value)
            for key, value in merged.items()
        )
    return current != merged


def _without_times(conditions: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return sorted(
        ({k: v for k, v in c.items() if k != "lastTransitionTime"} for c in conditions),
        key=lambda c: str(c.get("type")),
    )


async def _config_map_data(client: Client, namespace: str, policy_name: str) -> dict[str, str]:
    cm = await client.get(CONFIGMAPS, namespace, builders.config_map_name(policy_name))
    return dict((cm or {}).get("data") or {})


async def read_config(client: Client, namespace: str, policy_name: str) -> BatchingConfig | None:
    """The batching config in force for a policy (its ConfigMap), or None if absent/unreadable."""
    return builders.parse_config_data(await _config_map_data(client, namespace, policy_name))


async def read_mode(client: Client, namespace: str, policy_name: str) -> Mode | None:
    """The batching mode the policy's ConfigMap records, or None if it records none."""
    return builders.parse_mode_data(await _config_map_data(client, namespace, policy_name))


async def switch_mode(
    client: Client, policy: Mapping[str, Any], spec: PolicySpec, mode: Mode
) -> None:
    """Put `mode` in force: recorded in the ConfigMap first (a reconcile in between keeps
    it), then the Deployment's `--mode`, which rolls the pods one drained pod at a time."""
    metadata = policy["metadata"]
    await client.patch(
        CONFIGMAPS,
        metadata["namespace"],
        builders.config_map_name(metadata["name"]),
        {"data": builders.mode_data(mode)},
    )
    await _ensure(client, DEPLOYMENTS, builders.build_deployment(policy, spec, mode), Outcome(spec))


async def write_config(
    client: Client, namespace: str, policy_name: str, config: BatchingConfig
) -> None:
    """Record a new config in force in the policy's ConfigMap (the first step of a decision)."""
    await client.patch(
        CONFIGMAPS,
        namespace,
        builders.config_map_name(policy_name),
        {"data": builders.config_data(config)},
    )


async def read_admin_token(client: Client, namespace: str, policy_name: str) -> str | None:
    """The policy's admin token for `PUT /admin/batching`; never log it."""
    secret = await client.get(SECRETS, namespace, builders.secret_name(policy_name))
    encoded = ((secret or {}).get("data") or {}).get(builders.TOKEN_KEY)
    return base64.b64decode(encoded).decode() if encoded else None


def is_subset(desired: Any, actual: Any) -> bool:
    """Whether `actual` already holds everything `desired` says (the API server adds defaults).

    A key added by hand to a map (a label, a selector entry) is therefore not drift;
    a changed or missing value, or a list of another length, is.
    """
    if isinstance(desired, Mapping):
        return isinstance(actual, Mapping) and all(
            key in actual and is_subset(value, actual[key]) for key, value in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(actual, list)
            and len(desired) == len(actual)
            and all(is_subset(d, a) for d, a in zip(desired, actual, strict=True))
        )
    return bool(desired == actual)
