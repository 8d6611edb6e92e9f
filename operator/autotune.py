"""The operator's driver of the tuning loop: one asyncio task per BatchingPolicy.

Every `autotune.intervalSeconds` (re-read from the policy each round, so a
spec change takes effect at the next one) it runs one round of
`tuning_loop.TuningLoop` with the policy's plug points:
- signals from Prometheus when `autotune.prometheusUrl` or the operator's
  `--prometheus-url` is set, else a direct scrape of the round's ready pods;
- the `KubernetesActuator`: the config in force is the policy's ConfigMap; a
  change is written there first, then pushed to the same ready pods; a round
  without a change pushes it again to pods that hold other values;
- the `KubernetesScaler` (scaler.py) where the policy has `spec.autoscale`:
  the replica rule moves `spec.replicas` through the scale subresource, and
  stands back when an HPA targets the policy;
- the status recorder: `observed`, `slo`'s measured part (the window's
  attainment and p99 TTFT, TPOT and e2e, the error budget left over the
  budget window; reconcile writes the stated targets), `lastDecision`, a
  bounded `history` of changes, the conditions Tuning, SLOMet (attainment
  against its target; the p99 against an e2e target for a server that
  counts no attainment),
  MetricsAvailable and Autoscaling, and Events (Tuned, PushRefused, Resynced,
  Scaled); after a round that decided the replica count, `replicaState` (the
  rule's memory) and, on a change, `lastScaling`. Just before it, the config
  in force (and the mode) through reconcile's `write_in_force`: one writer per
  status key (status_owners.py).

A policy with `batching.mode: auto` also gets the mode choice inside the
round (the `KubernetesModes` plug point): `status.mode` and
`status.modeReason` every round (through `write_in_force`), and on a
switch the ConfigMap's record, the Deployment's `--mode` (a rolling update,
one drained pod at a time) and a ModeChanged Event.

The ready pods are listed once per round and serve both the scrape and the
actuator. The policy's lock (the one reconcile holds) is held from reading
the ConfigMap to the end of the record. Because the config in force is read
from the ConfigMap, a restarted operator resumes from it, never from
`initial`; the tuner's own small state (a ceiling learnt from a breach,
intervals since the last change) lives in memory and starts fresh after a
restart: the first window is then a full one. The replica rule's memory (its
last change, its recent recommendations) is read back from
`status.replicaState` when a policy's loop starts, so a restart in the middle
of a scale step neither repeats it nor cuts a stabilization window short.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import kopf
from batchpilot_operator import builders, kube
from batchpilot_operator.actuators import KubernetesActuator
from batchpilot_operator.handlers import client_of, lock_of
from batchpilot_operator.pods import ReadyPod, ready_pods
from batchpilot_operator.policy.mode import ModeChoice
from batchpilot_operator.policy.round import Decision
from batchpilot_operator.policy.types import ReplicaState, ScaleDecision
from batchpilot_operator.reconcile import (
    ensure_admin_token,
    now_iso,
    read_mode,
    switch_mode,
    write_in_force,
    write_status,
)
from batchpilot_operator.scaler import KubernetesScaler
from batchpilot_operator.signals import Signals, no_data
from batchpilot_operator.signals_prometheus import PrometheusSource, selector_for_policy
from batchpilot_operator.signals_scrape import ScrapeSource
from batchpilot_operator.slo import Slo
from batchpilot_operator.slo_status import slo_condition, slo_fields
from batchpilot_operator.spec import PolicySpec, SpecError, parse_spec
from batchpilot_operator.tuning_loop import PlugPoints, SignalSource, TuneStep, TuningLoop
from batchpilot_server.batching_config import Mode

RETRY_SECONDS = 10.0
HISTORY_LIMIT = 20  # the CRD allows 50; 20 changes cover hours of tuning
TUNING, SLO_MET, METRICS_AVAILABLE = "Tuning", "SLOMet", "MetricsAvailable"
AUTOSCALING = "Autoscaling"
log = logging.getLogger(__name__)


@dataclass
class PolicyTuner:
    """What one policy's task keeps between rounds."""

    loop: TuningLoop = field(default_factory=TuningLoop)
    scrape: ScrapeSource | None = None
    resync_refused: str | None = None  # the last resync refusal reported, not to repeat it
    round_failure: str | None = None  # the last failed round reported, not to repeat it


# -- pure parts: what a round writes ------------------------------------------------------


def observed(signals: Signals) -> dict[str, float]:
    values = {
        "p99LatencyMs": None if signals.p99_latency_s is None else signals.p99_latency_s * 1000,
        "kvCacheUsage": signals.kv_usage,
        "requestRate": signals.request_rate,
        "tokensPerSecond": signals.tokens_per_s,
    }
    return {key: round(value, 3) for key, value in values.items() if value is not None}


def decision_record(decision: Decision, at: str) -> dict[str, Any]:
    return {
        "time": at,
        "action": decision.action,
        "reason": decision.reason,
        "maxBatchSize": decision.config.max_batch_size,
        "batchTimeoutMs": decision.config.batch_timeout_ms,
    }


def conditions(signals: Signals, slo: Slo, decision: Decision) -> list[dict[str, str]]:
    if signals.status == "no_data":
        metrics = {"status": "False", "reason": "MetricsUnavailable", "message": signals.detail}
    else:
        metrics = {"status": "True", "reason": "MetricsRead",
                   "message": f"{signals.requests:.0f} requests in the last "
                              f"{signals.window_s:.0f} s"}
    slo_met = slo_condition(signals, slo)
    tuning = {"status": "True", "reason": "Enabled",
              "message": f"{decision.action}: {decision.reason}"}
    return [
        {"type": TUNING, **tuning},
        {"type": SLO_MET, **slo_met},
        {"type": METRICS_AVAILABLE, **metrics},
    ]


def status_fields(
    step: TuneStep, history: list[dict[str, Any]], at: str, slo: Slo
) -> dict[str, Any]:
    """The round's own record, the only writer of these keys (status_owners.py). Not the
    config in force: reconcile's `in_force_fields` writes that from the ConfigMap (the
    round has it written through `write_in_force`). Of `slo`, only what the window
    measured: reconcile writes the stated targets."""
    record = decision_record(step.decision, at)
    return {
        "observed": observed(step.signals),
        "slo": slo_fields(step.signals, slo),
        "lastDecision": record,
        "history": ([*history, record] if step.changed else list(history))[-HISTORY_LIMIT:],
        **scaling_fields(step, at),
    }


def scaling_fields(step: TuneStep, at: str) -> dict[str, Any]:
    """The replica rule's memory after a round that decided the count (a restarted
    operator resumes from it), and the change, if the round made one."""
    if step.scale is None or step.fleet is None:
        return {}
    fields: dict[str, Any] = {"replicaState": step.scale.state.to_dict()}
    if step.scale.replicas != step.fleet.desired:
        fields["lastScaling"] = scaling_record(step.fleet.desired, step.scale, at)
    return fields


def scaling_record(before: int, scale: ScaleDecision, at: str) -> dict[str, Any]:
    return {
        "time": at,
        "action": scale.action,
        "from": before,
        "to": scale.replicas,
        "reason": scale.reason,
    }


def autoscaling_condition(
    spec: PolicySpec, external: str | None, scale: ScaleDecision | None
) -> dict[str, str] | None:
    """Who sets the replica count, and the rule's last word when it is the operator;
    None when the round did not reach the rule (nothing new to say)."""
    if spec.autoscale is None:
        return {"type": AUTOSCALING, "status": "False", "reason": "NotConfigured",
                "message": "no spec.autoscale: replicas are set by spec.replicas; "
                           "batching is still tuned"}
    if external is not None:
        return {"type": AUTOSCALING, "status": "False", "reason": "ExternallyScaled",
                "message": f"HorizontalPodAutoscaler {external} targets this policy and sets "
                           "its replicas, so the operator does not; batching is still tuned"}
    if scale is None:
        return None
    return {"type": AUTOSCALING, "status": "True", "reason": "Enabled",
            "message": f"{scale.action}: {scale.reason}"}


# -- the daemon -----------------------------------------------------------------------------


TASKS = "autotune_tasks"  # memo key: (namespace, name) -> the policy's running loop


@kopf.on.startup()
async def start_autotune(memo: kopf.Memo, **_: Any) -> None:
    # Per-object memos are shallow copies of this one: they all share this dict.
    memo[TASKS] = {}


@kopf.on.cleanup()
async def stop_autotune(memo: kopf.Memo, **_: Any) -> None:
    tasks: dict[tuple[str, str], asyncio.Task[None]] = memo.get(TASKS) or {}
    for task in tasks.values():
        task.cancel()
    await asyncio.gather(*tasks.values(), return_exceptions=True)
    tasks.clear()


@kopf.on.event(builders.GROUP, builders.VERSION, builders.PLURAL)
async def autotune_policy(
    event: Mapping[str, Any], name: str, namespace: str, memo: kopf.Memo, **_: Any
) -> None:
    """Keep exactly one tuning loop per existing policy.

    A plain event handler rather than a Kopf timer or daemon: those put a
    finalizer on every policy, so a policy could not be deleted while the
    operator is down. The loop ends by itself once the policy is gone.
    """
    tasks: dict[tuple[str, str], asyncio.Task[None]] = memo[TASKS]
    key = (namespace, name)
    running = tasks.get(key)
    if event.get("type") == "DELETED":
        if running is not None:
            running.cancel()
        return
    if running is None or running.done():
        tasks[key] = asyncio.create_task(
            drive_policy(client_of(memo), namespace, name, memo),
            name=f"autotune {namespace}/{name}",
        )


async def drive_policy(
    client: kube.Client, namespace: str, name: str, memo: Mapping[str, Any]
) -> None:
    """Round after round until the policy is deleted; a failed round is logged and retried.

    The first decision comes one interval after the start: a window needs data.
    """
    tuner = PolicyTuner()
    async with aiohttp.ClientSession() as session:
        started = False
        interval: float | None = 0.0
        while interval is not None:
            await asyncio.sleep(interval)
            try:
                if started:
                    interval = await tune_once(client, session, namespace, name, memo, tuner)
                else:
                    interval = await first_interval(client, session, namespace, name, memo, tuner)
                    started = True
                tuner.round_failure = None
            except Exception as exc:  # a failed round must not end tuning for good
                await report_failed_round(client, namespace, name, tuner, exc)
                interval = RETRY_SECONDS


async def report_failed_round(
    client: kube.Client, namespace: str, name: str, tuner: PolicyTuner, exc: Exception
) -> None:
    """Log the failure; a new one also as a Warning Event and the Tuning condition
    (best effort: the API may be what fails)."""
    expected = isinstance(exc, kube.KubeError | aiohttp.ClientError | TimeoutError)
    log.log(
        logging.WARNING if expected else logging.ERROR,
        "autotune %s/%s: round failed, retrying in %g s: %s",
        namespace, name, RETRY_SECONDS, exc, exc_info=not expected,
    )
    message = f"{exc or type(exc).__name__}; retrying in {RETRY_SECONDS:g} s"
    if message == tuner.round_failure:
        return
    try:
        policy = await client.get(kube.POLICIES, namespace, name)
        if policy is None:
            return
        await client.create_event(policy, "TuningRoundFailed", message, "Warning")
        await write_status(client, policy, {}, [{
            "type": TUNING, "status": "False", "reason": "RoundFailed", "message": message,
        }])
    except (kube.KubeError, aiohttp.ClientError, TimeoutError) as report_exc:
        log.warning("autotune %s/%s: could not report the failed round: %s",
                    namespace, name, report_exc)
        return
    tuner.round_failure = message


async def first_interval(
    client: kube.Client,
    session: aiohttp.ClientSession,
    namespace: str,
    name: str,
    memo: Mapping[str, Any],
    tuner: PolicyTuner,
) -> float | None:
    """Read-only start: the policy's interval, and a scrape baseline where pods are scraped."""
    read = await read_policy(client, namespace, name)
    if not isinstance(read, tuple):
        return read
    policy, spec = read
    # The rule's memory from before a restart: a scale step in flight is not repeated.
    tuner.loop.resume(ReplicaState.from_dict((policy.get("status") or {}).get("replicaState")))
    if spec.autotune.enabled and not prometheus_url_of(spec, memo):
        urls = [pod.url for pod in await ready_pods(client, namespace, name)]
        if urls:
            tuner.scrape = ScrapeSource(urls, session, budget_window_s=spec.slo.budget_window_s)
            await tuner.scrape.scrape()
    return float(spec.autotune.interval_seconds)


async def read_policy(
    client: kube.Client, namespace: str, name: str
) -> tuple[dict[str, Any], PolicySpec] | float | None:
    """The policy and its spec, else what the loop does next: None when the policy is
    gone, RETRY_SECONDS when its spec is invalid (reconcile reports that; look again later)."""
    policy = await client.get(kube.POLICIES, namespace, name)
    if policy is None:
        return None
    try:
        return policy, parse_spec(policy.get("spec") or {})
    except SpecError:
        return RETRY_SECONDS


def prometheus_url_of(spec: PolicySpec, memo: Mapping[str, Any]) -> str:
    return spec.autotune.prometheus_url or str(memo.get("prometheus_url") or "")


async def tune_once(
    client: kube.Client,
    session: aiohttp.ClientSession,
    namespace: str,
    name: str,
    memo: Mapping[str, Any],
    tuner: PolicyTuner,
) -> float | None:
    """One round for one policy; returns the seconds until the next (None: policy deleted)."""
    read = await read_policy(client, namespace, name)
    if not isinstance(read, tuple):
        return read
    policy, spec = read
    interval = float(spec.autotune.interval_seconds)
    await restore_admin_token(client, policy)
    if not spec.autotune.enabled:
        await write_status(client, policy, {}, [{
            "type": TUNING, "status": "False", "reason": "Disabled",
            "message": "autotune.enabled is false: the config stays as it is",
        }])
        return interval
    pods = await ready_pods(client, namespace, name)  # the round's one listing
    scaler = KubernetesScaler(client, policy, spec, pods)
    modes = KubernetesModes(client, policy, spec) if spec.batching.mode == "auto" else None
    status = StatusRecorder(client, policy, spec, tuner, scaler)

    async def record(step: TuneStep) -> None:
        # The config (and mode) just put in force, shown now rather than at the reconcile
        # the ConfigMap's change triggers, through reconcile's own writer of those keys;
        # under auto with the choice's reason, in the same patch as the mode. Before the
        # round's record, so that whoever sees a decision sees its config in force.
        choice = step.decision.mode
        await write_in_force(client, policy, spec, None if choice is None else choice.reason)
        await status.record(step)

    plugs = PlugPoints(
        source=signal_source(spec, memo, session, tuner, pods, namespace, name),
        actuator=KubernetesActuator(client, session, namespace, name, pods),
        recorder=record,
        scaler=scaler,
        modes=modes,
    )
    # Without the lock, a reconcile that read the ConfigMap before this round's write
    # could write its old value back: status and pods would then disagree with it.
    lock = lock_of(memo, (namespace, name))
    await tuner.loop.round(spec.goal, spec.cadence, plugs, guard=lock)
    return interval


async def restore_admin_token(client: kube.Client, policy: Mapping[str, Any]) -> None:
    """A deleted admin token comes back at the round after (every round, tuning enabled or
    not): the pods' mounted Secret needs it, and no watch on Secrets would say it is gone."""
    created = await ensure_admin_token(client, policy)
    if created is None:
        return
    meta = policy["metadata"]
    log.warning("autotune %s/%s: the admin token was missing: %s", meta["namespace"],
                meta["name"], created)
    await client.create_event(
        policy, "AdminTokenCreated",
        f"the admin token was missing: {created}; running pods read the new token once "
        "the kubelet refreshes their mounted Secret", "Warning",
    )  # fmt: skip


@dataclass
class KubernetesModes:
    """`mode: auto`'s plug point: the mode the Deployment serves, and a switch put in force
    (the ConfigMap's record, the Deployment's `--mode`) and announced."""

    client: kube.Client
    policy: Mapping[str, Any]
    spec: PolicySpec

    async def in_force(self) -> Mode:
        meta = self.policy["metadata"]
        return builders.serving_mode(
            self.spec, await read_mode(self.client, meta["namespace"], meta["name"])
        )

    async def switch(self, choice: ModeChoice) -> None:
        await switch_mode(self.client, self.policy, self.spec, choice.mode)
        await self.client.create_event(
            self.policy, "ModeChanged",
            f"{choice.reason}; the pods roll to --mode {choice.mode} one at a time",
        )  # fmt: skip


def signal_source(
    spec: PolicySpec,
    memo: Mapping[str, Any],
    session: aiohttp.ClientSession,
    tuner: PolicyTuner,
    pods: list[ReadyPod],
    namespace: str,
    name: str,
) -> SignalSource:
    prometheus_url = prometheus_url_of(spec, memo)
    if prometheus_url:
        return PrometheusSource(
            prometheus_url, selector_for_policy(namespace, name), session,
            budget_window_s=spec.slo.budget_window_s,
        )  # fmt: skip
    return PodScrape(tuner, session, [pod.url for pod in pods], spec.slo.budget_window_s)


@dataclass
class PodScrape:
    """The direct scrape of the round's ready pods; the snapshots live on in the policy's
    tuner, so that each window is measured from an earlier round's scrape."""

    tuner: PolicyTuner
    session: aiohttp.ClientSession
    urls: list[str]
    budget_window_s: float

    async def read(self, window_s: float) -> Signals:
        if not self.urls:
            return no_data("no ready pod to scrape", window_s)
        if self.tuner.scrape is None:
            self.tuner.scrape = ScrapeSource(
                self.urls, self.session, budget_window_s=self.budget_window_s
            )
            await self.tuner.scrape.scrape()
            return no_data("first scrape of the pods: the next round opens the window", window_s)
        # Pods come and go; deltas only count pods seen at both ends.
        self.tuner.scrape.urls = self.urls
        self.tuner.scrape.budget_window_s = self.budget_window_s  # the spec may have changed
        return await self.tuner.scrape.read(window_s)


@dataclass
class StatusRecorder:
    """A round's record: the policy's status, and Events for changes and resyncs."""

    client: kube.Client
    policy: Mapping[str, Any]
    spec: PolicySpec
    tuner: PolicyTuner
    scaler: KubernetesScaler

    async def record(self, step: TuneStep) -> None:
        history = list((self.policy.get("status") or {}).get("history") or [])
        fields = status_fields(step, history, now_iso(), self.spec.slo)
        found = conditions(step.signals, self.spec.goal.slo, step.decision)
        autoscaling = autoscaling_condition(self.spec, self.scaler.external, step.scale)
        await write_status(
            self.client, self.policy, fields, found + ([autoscaling] if autoscaling else [])
        )
        if step.changed:
            await self._changed(step)
        else:
            await self._resynced(step)
        if "lastScaling" in fields:  # the round changed the replica count
            await self.client.create_event(self.policy, "Scaled", fields["lastScaling"]["reason"])

    async def _changed(self, step: TuneStep) -> None:
        before, after, report = step.before, step.decision.config, step.report
        message = (
            f"maxBatchSize {before.max_batch_size} -> {after.max_batch_size}, "
            f"batchTimeoutMs {before.batch_timeout_ms:g} -> {after.batch_timeout_ms:g} "
            f"({step.decision.action}): {step.decision.reason}; {report.summary()}"
        )
        await self.client.create_event(self.policy, "Tuned", message)
        if report.refused:
            await self.client.create_event(self.policy, "PushRefused", report.summary(), "Warning")

    async def _resynced(self, step: TuneStep) -> None:
        """Pods brought back to the config in force; a refusal is reported once, not every
        round, until it changes or clears."""
        in_force, report = step.decision.config, step.report
        if report.applied:
            pods = ", ".join(a.target for a in report.applied)
            await self.client.create_event(
                self.policy,
                "Resynced",
                f"maxBatchSize {in_force.max_batch_size}, batchTimeoutMs "
                f"{in_force.batch_timeout_ms:g} pushed again to {pods}: they held other values",
            )
        refused = report.refusals() or None
        if refused is not None and refused != self.tuner.resync_refused:
            await self.client.create_event(
                self.policy, "PushRefused", f"resync refused by {refused}", "Warning"
            )
        self.tuner.resync_refused = refused
