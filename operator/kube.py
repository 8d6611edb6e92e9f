"""A small async Kubernetes API client for the operator's own calls (aiohttp).

Every request goes through `Client._call`, which refuses any (kind, verb) not
declared in `PERMISSIONS`: that table is the operator's whole footprint on the
API, and tests/test_rbac.py checks the ClusterRole in manifests/ against it.
Kopf's own calls (watching, its progress annotations, its events) are listed
separately in `batchpilot_operator.handlers.KOPF_PERMISSIONS`.
"""

from __future__ import annotations

import datetime
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import kopf

Verb = Literal["get", "list", "watch", "create", "patch", "delete"]


@dataclass(frozen=True)
class Kind:
    group: str  # "" for the core API
    version: str
    plural: str
    kind: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    def path(self, namespace: str, name: str | None = None, subresource: str | None = None) -> str:
        prefix = f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"
        parts = [prefix, "namespaces", namespace, self.plural]
        parts += [name] if name else []
        parts += [subresource] if subresource else []
        return "/".join(parts)


POLICIES = Kind("batchpilot.io", "v1alpha1", "batchingpolicies", "BatchingPolicy")
DEPLOYMENTS = Kind("apps", "v1", "deployments", "Deployment")
SERVICES = Kind("", "v1", "services", "Service")
CONFIGMAPS = Kind("", "v1", "configmaps", "ConfigMap")
SECRETS = Kind("", "v1", "secrets", "Secret")
PODS = Kind("", "v1", "pods", "Pod")
EVENTS = Kind("", "v1", "events", "Event")

# (kind, subresource) -> the verbs the operator's code uses. Nothing else can be called.
PERMISSIONS: Mapping[tuple[Kind, str | None], frozenset[Verb]] = {
    (POLICIES, None): frozenset({"get"}),
    (POLICIES, "status"): frozenset({"patch"}),
    (DEPLOYMENTS, None): frozenset({"get", "create", "patch"}),
    (SERVICES, None): frozenset({"get", "create", "patch"}),
    (CONFIGMAPS, None): frozenset({"get", "create", "patch"}),
    # Never patched: an existing admin token is never regenerated.
    (SECRETS, None): frozenset({"get", "create"}),
    # The tuner lists a policy's pods to push decisions to each ready one.
    (PODS, None): frozenset({"list"}),
    (EVENTS, None): frozenset({"create"}),
}

EVENT_COMPONENT = "batchpilot-operator"
USER_AGENT = "batchpilot-operator"


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"Kubernetes API error {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Conflict(KubeError):
    """HTTP 409: the object already exists or changed meanwhile."""


class UndeclaredCall(RuntimeError):
    """The code tried a call missing from PERMISSIONS (and so from the ClusterRole)."""


def connection_info(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Credentials as Kopf's built-in logins find them: the pod's service account, else
    $KUBECONFIG or ~/.kube/config. Kopf and `Client` both use this, read at login time."""
    try:
        info = kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(
            settings=settings
        )
    except OSError as exc:  # a $KUBECONFIG that names no readable file
        raise kopf.PermanentError(f"cannot read kubeconfig {exc.filename}: {exc.strerror}") from exc
    if info is None:
        raise kopf.PermanentError(
            "no Kubernetes credentials: not in a pod, and neither $KUBECONFIG nor ~/.kube/config"
        )
    return info


class Client:
    """Namespaced get/list/create/merge-patch for the kinds in PERMISSIONS, plus Events."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session = session
        self._base_url = base_url.rstrip("/")

    @classmethod
    def for_url(cls, base_url: str, token: str | None = None) -> Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return cls(aiohttp.ClientSession(headers={**headers, "User-Agent": USER_AGENT}), base_url)

    @classmethod
    def from_connection(cls, info: kopf.ConnectionInfo) -> Client:
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=info.as_ssl_context()),
            headers={**info.as_http_headers(), "User-Agent": USER_AGENT},
            trust_env=info.trust_env,
        )
        return cls(session, info.server)

    @classmethod
    def login(cls, settings: kopf.OperatorSettings) -> Client:
        return cls.from_connection(connection_info(settings))

    async def close(self) -> None:
        await self._session.close()

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call("get", kind, namespace, "GET", name=name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, kind: Kind, namespace: str, labels: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        selector = ",".join(f"{key}={value}" for key, value in (labels or {}).items())
        params = {"labelSelector": selector} if selector else {}
        body = await self._call("list", kind, namespace, "GET", params=params)
        return list(body.get("items") or [])

    async def create(self, kind: Kind, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("create", kind, namespace, "POST", body=body)

    async def patch(
        self,
        kind: Kind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        """JSON merge-patch (RFC 7386): lists are replaced whole, `None` removes a key."""
        return await self._call(
            "patch", kind, namespace, "PATCH", name=name, subresource=subresource, body=patch,
            content_type="application/merge-patch+json",
        )

    async def create_event(
        self,
        involved: Mapping[str, Any],
        reason: str,
        message: str,
        type_: Literal["Normal", "Warning"] = "Normal",
    ) -> dict[str, Any]:
        """A core/v1 Event about `involved` (a full object), shown by `kubectl describe`."""
        meta = involved["metadata"]
        now = datetime.datetime.now(datetime.UTC).isoformat()
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {
                "name": f"{meta['name']}.{secrets.token_hex(8)}",
                "namespace": meta["namespace"],
            },
            "involvedObject": {
                "apiVersion": involved.get("apiVersion"),
                "kind": involved.get("kind"),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message,
            "source": {"component": EVENT_COMPONENT},
            "reportingComponent": EVENT_COMPONENT,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        return await self.create(EVENTS, meta["namespace"], event)

    async def _call(
        self,
        verb: Verb,
        kind: Kind,
        namespace: str,
        method: str,
        *,
        name: str | None = None,
        subresource: str | None = None,
        body: Mapping[str, Any] | None = None,
        params: Mapping[str, str] | None = None,
        content_type: str = "application/json",
    ) -> dict[str, Any]:
        if verb not in PERMISSIONS.get((kind, subresource), frozenset()):
            raise UndeclaredCall(
                f"{verb} {kind.plural}{'/' + subresource if subresource else ''} is not in "
                "batchpilot_operator.kube.PERMISSIONS (and so not granted by the ClusterRole)"
            )
        url = self._base_url + kind.path(namespace, name, subresource)
        headers = {"Content-Type": content_type} if body is not None else {}
        async with self._session.request(
            method, url, json=body, params=params, headers=headers
        ) as response:
            payload = await _json_or_text(response)
            if response.status >= 400:
                raise _error(response.status, payload)
            return payload


async def _json_or_text(response: aiohttp.ClientResponse) -> dict[str, Any]:
    try:
        data = await response.json(content_type=None)
    except ValueError:
        return {"message": await response.text()}
    return data if isinstance(data, dict) else {"message": str(data)}


def _error(status: int, payload: Mapping[str, Any]) -> KubeError:
    reason = str(payload.get("reason") or "")
    message = str(payload.get("message") or payload)
    cls = Conflict if status == 409 else KubeError
    return cls(status, reason, message)
