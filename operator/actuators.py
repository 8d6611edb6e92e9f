"""Actuators: put a tuning decision into force, and say where it did not take.

- `LocalActuator`: `PUT /admin/batching` to a list of server URLs with a token.
- `KubernetesActuator`: the policy's ConfigMap first (pods that start later
  read it), then the same PUT to every ready pod of the policy, with the
  token from the policy's Secret. `resync` pushes the config in force again
  to the pods that hold other values (one refused a push, or started from
  an older ConfigMap).

Only the tuned knobs are sent (`max_batch_size`, `batch_timeout_ms`); the
queue size stays whatever the server was started with. A refusal never
raises: it is reported per target so the caller can record it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from batchpilot_operator import builders
from batchpilot_operator.kube import PODS, Client
from batchpilot_operator.reconcile import read_admin_token, write_config
from batchpilot_server.batching_config import BatchingConfig

PUT_TIMEOUT_S = 5.0
TUNED_FIELDS = ("max_batch_size", "batch_timeout_ms")


@dataclass(frozen=True)
class Applied:
    target: str  # URL or pod name
    version: int | None  # the server's config version after the PUT


@dataclass(frozen=True)
class Refused:
    target: str
    reason: str


@dataclass
class ActuationReport:
    applied: list[Applied] = field(default_factory=list)
    refused: list[Refused] = field(default_factory=list)
    config_map_written: bool = False

    @property
    def ok(self) -> bool:
        return not self.refused

    def summary(self) -> str:
        parts = [f"applied on {len(self.applied)}"]
        if self.refused:
            parts.append(f"refused by {self.refusals()}")
        return ", ".join(parts)

    def refusals(self) -> str:
        """Each refusing target with its reason; empty when none refused."""
        return "; ".join(f"{r.target}: {r.reason}" for r in self.refused)


def tuned_body(config: BatchingConfig) -> dict[str, Any]:
    return {key: config.to_dict()[key] for key in TUNED_FIELDS}


def same_tuned(a: BatchingConfig, b: BatchingConfig) -> bool:
    return tuned_body(a) == tuned_body(b)


async def put_batching(
    session: aiohttp.ClientSession, url: str, token: str | None, config: BatchingConfig, name: str
) -> Applied | Refused:
    """PUT the tuned knobs to one server; a refusal comes back with the server's words."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with session.put(
            f"{url.rstrip('/')}/admin/batching",
            json=tuned_body(config),
            headers=headers,
            timeout=aiohttp.ClientTimeout(total=PUT_TIMEOUT_S),
        ) as response:
            status, text = response.status, await response.text()
    except TimeoutError:
        return Refused(name, f"timed out: no answer within {PUT_TIMEOUT_S:g} s")
    except aiohttp.ClientError as exc:
        return Refused(name, f"unreachable: {exc or type(exc).__name__}")
    body = _json_or_none(text)
    if status != 200:
        return Refused(name, f"HTTP {status}: {_error_message(body) if body else text[:120]}")
    return Applied(name, body.get("version") if isinstance(body, dict) else None)


def _json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


async def get_batching(session: aiohttp.ClientSession, url: str) -> BatchingConfig:
    """The config a server has in force (GET /admin/batching needs no token)."""
    async with session.get(
        f"{url.rstrip('/')}/admin/batching", timeout=aiohttp.ClientTimeout(total=PUT_TIMEOUT_S)
    ) as response:
        response.raise_for_status()
        body = await response.json()
    return BatchingConfig.from_dict({k: body[k] for k in BatchingConfig().to_dict()})


async def held_config(session: aiohttp.ClientSession, url: str) -> BatchingConfig | None:
    """What a server holds; None when it cannot tell (down, or not answering yet)."""
    try:
        return await get_batching(session, url)
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return None


def _error_message(body: Any) -> str:
    if isinstance(body, Mapping) and isinstance(body.get("error"), Mapping):
        return str(body["error"].get("message"))
    return str(body)


class LocalActuator:
    """Plain server URLs (local mode, the demo, the benchmark)."""

    def __init__(
        self, urls: Sequence[str], token: str | None, session: aiohttp.ClientSession
    ) -> None:
        if not urls:
            raise ValueError("the local actuator needs at least one server URL")
        self.urls = list(urls)
        self.token = token
        self.session = session

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        results = await asyncio.gather(
            *(put_batching(self.session, url, self.token, config, url) for url in self.urls)
        )
        return _report(results)


class KubernetesActuator:
    """A policy's ConfigMap, then its ready pods."""

    def __init__(
        self,
        client: Client,
        session: aiohttp.ClientSession,
        namespace: str,
        policy_name: str,
    ) -> None:
        self.client = client
        self.session = session
        self.namespace = namespace
        self.policy_name = policy_name

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        await write_config(self.client, self.namespace, self.policy_name, config)
        token = await read_admin_token(self.client, self.namespace, self.policy_name)
        pods = await self.ready_pods()
        results = await asyncio.gather(
            *(put_batching(self.session, url, token, config, name) for name, url in pods)
        )
        report = _report(results)
        report.config_map_written = True
        if token is None:
            report.refused.insert(
                0, Refused(builders.secret_name(self.policy_name), "admin token Secret missing")
            )
        return report

    async def resync(self, config: BatchingConfig) -> ActuationReport:
        """PUT `config` to the ready pods whose tuned knobs differ from it; a pod that
        cannot say what it holds is left for the next round."""
        pods = await self.ready_pods()
        held = await asyncio.gather(*(held_config(self.session, url) for _, url in pods))
        drifted = [
            (name, url)
            for (name, url), config_held in zip(pods, held, strict=True)
            if config_held is not None and not same_tuned(config_held, config)
        ]
        if not drifted:
            return ActuationReport()
        token = await read_admin_token(self.client, self.namespace, self.policy_name)
        results = await asyncio.gather(
            *(put_batching(self.session, url, token, config, name) for name, url in drifted)
        )
        return _report(results)

    async def ready_pods(self) -> list[tuple[str, str]]:
        """(pod name, base URL) of every ready pod of the policy that has an IP."""
        pods = await self.client.list(
            PODS, self.namespace, builders.selector_labels(self.policy_name)
        )
        return [
            (pod["metadata"]["name"], f"http://{pod['status']['podIP']}:{pod_port(pod)}")
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


def _report(results: Sequence[Applied | Refused]) -> ActuationReport:
    report = ActuationReport()
    for result in results:
        if isinstance(result, Applied):
            report.applied.append(result)
        else:
            report.refused.append(result)
    return report
