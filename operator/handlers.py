"""Kopf handlers: thin wrappers that call `reconcile` for a policy.

A policy is reconciled when it is created, changed or resumed, and again
whenever one of its owned objects changes or disappears (drift repair by
watching, not by polling). Handlers share a `kube.Client` and the
`PolicyMetrics` (each valid policy's SLO and KV watermark, served for
Prometheus) through Kopf's memo.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Mapping
from typing import Any, Literal

import aiohttp
import kopf
from batchpilot_operator import builders, kube
from batchpilot_operator.policy_metrics import PolicyMetrics
from batchpilot_operator.reconcile import reconcile
from batchpilot_operator.spec import PolicySpec

# The owned kinds watched for drift. Not the admin-token Secret: watching Secrets needs
# list+watch on every Secret of the cluster, which is reading them all. The token is
# read and created by name instead (reconcile.ensure_admin_token), at every reconcile
# and every tuning round.
OWNED_KINDS = (kube.DEPLOYMENTS, kube.SERVICES, kube.CONFIGMAPS, kube.PODDISRUPTIONBUDGETS)
ANNOTATION_PREFIX = "batchpilot.io"
RETRY_DELAY_SECONDS = 10.0
# Memo keys: the port to serve the policy targets on (0 or absent: not served,
# set by `batchpilot operator --metrics-port`), the gauges, and their server.
METRICS_PORT = "metrics_port"
POLICY_METRICS = "policy_metrics"
METRICS_SERVER = "policy_metrics_server"
FAILURES = "reconcile_failures"  # memo key: (namespace, name) -> the last reconcile error

# What Kopf itself calls on the API for these handlers (tests/integration/test_rbac.py checks
# the ClusterRole covers it): list+watch of every handled kind, merge-patches of
# its progress annotations on the policy, and its own Events for handler errors.
KOPF_PERMISSIONS: Mapping[tuple[kube.Kind, str | None], frozenset[kube.Verb]] = {
    (kube.POLICIES, None): frozenset({"list", "watch", "patch"}),
    **{(kind, None): frozenset({"list", "watch"}) for kind in OWNED_KINDS},
    (kube.EVENTS, None): frozenset({"create"}),
}


def configure(settings: kopf.OperatorSettings) -> None:
    """Kopf settings batchpilot relies on, in the operator and in the tests alike."""
    # Progress and diff-base in annotations: the status stays ours (and schema-valid).
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{ANNOTATION_PREFIX}/finalizer"
    # No watching of CRDs and namespaces: exact namespaces only, and no RBAC for either.
    settings.scanning.disabled = True
    # Kopf posts Events only for handler errors; reconcile posts its own Events
    # (an invalid spec's Warning among them), which the logs then only repeat.
    settings.posting.level = logging.ERROR


@kopf.on.login()
def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo:
    return kube.connection_info(settings)


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings)
    if memo.get("kube") is None:
        memo["kube"] = kube.Client.login(settings)
    # One reconcile at a time per policy: the policy's own handler and the drift
    # handlers of its owned objects would otherwise race on create.
    memo["locks"] = {}
    memo[FAILURES] = {}
    memo[POLICY_METRICS] = PolicyMetrics()
    port = int(memo.get(METRICS_PORT) or 0)
    if port:
        try:
            memo[METRICS_SERVER], _ = memo[POLICY_METRICS].serve(port)
        except OSError as exc:  # permanent: retrying would not free the port
            raise kopf.PermanentError(
                f"cannot serve policy metrics on port {port} (--metrics-port): {exc}"
            ) from exc


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    client = memo.get("kube")
    if client is not None:
        await client.close()
    server = memo.get(METRICS_SERVER)
    if server is not None:
        await asyncio.to_thread(server.shutdown)  # waits for its serving thread's poll
        server.server_close()


def client_of(memo: kopf.Memo) -> kube.Client:
    """The operator's API client (created at startup); for every handler module."""
    client: kube.Client = memo["kube"]
    return client


def policy_metrics_of(memo: kopf.Memo) -> PolicyMetrics:
    """The operator's per-policy target gauges (created at startup)."""
    metrics: PolicyMetrics = memo[POLICY_METRICS]
    return metrics


def track_targets(
    metrics: PolicyMetrics, namespace: str, name: str, spec: PolicySpec | None
) -> None:
    """Publish a valid policy's SLO targets, attainment objective and KV watermark; drop
    them when it has no valid spec."""
    if spec is None:
        metrics.forget(namespace, name)
        return
    metrics.publish_slo(namespace, name, spec.slo)


@kopf.on.resume(builders.GROUP, builders.VERSION, builders.PLURAL)
@kopf.on.create(builders.GROUP, builders.VERSION, builders.PLURAL)
@kopf.on.update(builders.GROUP, builders.VERSION, builders.PLURAL)
async def on_policy(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, retry: int, **_: Any
) -> None:
    # An invalid spec is reported in status by reconcile and not raised: Kopf
    # must not retry it; the next spec change triggers this handler again.
    policy = _plain(body)
    failures: dict[tuple[str, str], str] = memo[FAILURES]
    key = (policy["metadata"]["namespace"], policy["metadata"]["name"])
    try:
        await _reconcile_locked(memo, policy, logger)
    except kube.KubeError as exc:
        failures[key] = str(exc)
        await post_event_quietly(
            client_of(memo), policy, "ReconcileFailed",
            f"{exc}; retrying in {RETRY_DELAY_SECONDS:g} s", logger,
        )
        raise kopf.TemporaryError(str(exc), delay=RETRY_DELAY_SECONDS) from exc
    last_failure = failures.pop(key, None)
    if retry and last_failure:
        # The failures may not have been reportable (the API refused Events too).
        await post_event_quietly(
            client_of(memo), policy, "ReconcileRecovered",
            f"reconciled after {retry} failed attempt(s); the last: {last_failure}",
            logger, "Normal",
        )


async def post_event_quietly(
    client: kube.Client,
    policy: Mapping[str, Any],
    reason: str,
    message: str,
    logger: logging.Logger | kopf.Logger,
    type_: Literal["Normal", "Warning"] = "Warning",
) -> None:
    """An Event about a failure that must not fail in turn: the API may be what is failing."""
    try:
        await client.create_event(policy, reason, message, type_)
    except (kube.KubeError, aiohttp.ClientError, TimeoutError) as exc:
        logger.warning(f"could not post the {reason} Event ({message}): {exc}")


async def on_owned_event(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any
) -> None:
    """An owned object was added, changed or deleted: reconcile its policy."""
    meta = body.metadata
    if not any(ref.get("kind") == builders.KIND for ref in meta.get("ownerReferences", [])):
        return  # labelled by hand, not ours
    client = client_of(memo)
    namespace = meta.namespace or ""
    policy = await client.get(kube.POLICIES, namespace, meta.labels[builders.POLICY_LABEL])
    if policy is None or policy["metadata"].get("deletionTimestamp"):
        return  # the garbage collector takes the owned objects away
    try:
        await _reconcile_locked(memo, policy, logger)
    except kube.KubeError as exc:
        logger.warning(f"drift repair of {namespace}/{meta.name} failed: {exc}")


@kopf.on.event(builders.GROUP, builders.VERSION, builders.PLURAL)
async def on_policy_event(
    event: Mapping[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    # A plain event, not kopf.on.delete: that would put a finalizer on every policy.
    if event.get("type") == "DELETED":
        async with lock_of(memo, (namespace, name)):  # after a reconcile in flight publishes
            track_targets(policy_metrics_of(memo), namespace, name, None)


for _kind in OWNED_KINDS:
    kopf.on.event(
        _kind.group,
        _kind.version,
        _kind.plural,
        labels={builders.POLICY_LABEL: kopf.PRESENT, builders.APP_LABEL: builders.APP_NAME},
    )(on_owned_event)


async def _reconcile_locked(
    memo: kopf.Memo, policy: Mapping[str, Any], logger: kopf.Logger
) -> None:
    key = (policy["metadata"]["namespace"], policy["metadata"]["name"])
    async with lock_of(memo, key):
        outcome = await reconcile(client_of(memo), policy)
        track_targets(policy_metrics_of(memo), *key, outcome.spec)
    if outcome.error is not None:
        logger.warning(f"invalid spec ({outcome.error.reason}): {outcome.error.message}")
    for action in outcome.actions:
        logger.info(action)


def lock_of(memo: Mapping[str, Any], key: tuple[str, str]) -> asyncio.Lock:
    """The lock every writer of a policy's ConfigMap and status holds (reconcile, the tuner):
    a read-then-write must not interleave with another's write."""
    locks: dict[tuple[str, str], asyncio.Lock] = memo["locks"]
    return locks.setdefault(key, asyncio.Lock())


def _plain(body: kopf.Body) -> dict[str, Any]:
    """A plain-dict copy of a Kopf body (its views are live and read-only)."""
    return copy.deepcopy(dict(body))
