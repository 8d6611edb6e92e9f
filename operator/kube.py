"""The operator's own Kubernetes API calls, through the official `kubernetes` client.

Every request goes through `Client._call`, which refuses any (kind, verb) not
declared in `PERMISSIONS`: that table is the operator's whole footprint on the
API, and tests/integration/test_rbac.py checks the ClusterRole in manifests/ against it.
Kopf's own calls (watching, its progress annotations, its events) are listed
separately in `batchpilot_operator.handlers.KOPF_PERMISSIONS`.

Login (`load_configuration`) is the client's, as kubectl finds credentials: the
pod's service account in a cluster, else the kubeconfig ($KUBECONFIG or
~/.kube/config) with whatever its user holds: a token, client certificates, an
`exec` plugin (EKS, GKE, AKS) or an auth provider (OIDC, GCP). Kopf logs in
through the same loader (`connection_info`, its login handler), so one set of
credentials serves both. A token that carries an expiry is fetched again by the
client once it expires; Kopf asks `connection_info` again after a 401.

The synchronous client runs in a small thread pool rather than
kubernetes_asyncio (or `kubernetes.aio`), because:
- its login is synchronous and refreshes itself: before each call a hook runs
  the exec plugin again, or re-reads the service account token, once the old
  one expired. The asyncio loaders (`kubernetes.aio.config`) set no such hook;
  refreshing is a background task left to the caller.
- it is the client Kopf prefers when it piggybacks (`kopf.login_via_client`
  comes before the asyncio one), and it keeps `connection_info` and
  `Client.login` plain functions, callable from Kopf's login handler and from
  its async startup alike.
- the operator makes a handful of calls per reconcile or tuning round; a few
  threads cost nothing at that rate.
The price: cancelling a handler does not stop a request in flight (it ends
within REQUEST_TIMEOUT_S), and transport errors are urllib3's, which `_call`
turns into `Unreachable`, a `KubeError` like every other failed call.
"""

from __future__ import annotations

import asyncio
import datetime
import functools
import json
import os
import secrets
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import kopf
import pydantic
import urllib3
from kubernetes import client as k8s
from kubernetes import config as k8s_config

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
PODDISRUPTIONBUDGETS = Kind("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget")
EVENTS = Kind("", "v1", "events", "Event")
HORIZONTAL_POD_AUTOSCALERS = Kind(
    "autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler"
)

# (kind, subresource) -> the verbs the operator's code uses. Nothing else can be called.
PERMISSIONS: Mapping[tuple[Kind, str | None], frozenset[Verb]] = {
    # patch: an omitted spec.replicas is written once (the scale subresource needs one).
    (POLICIES, None): frozenset({"get", "patch"}),
    (POLICIES, "status"): frozenset({"patch"}),
    # The replica rule writes spec.replicas as kubectl scale and an HPA do (scaler.py).
    (POLICIES, "scale"): frozenset({"patch"}),
    # An HPA (KEDA's too) that targets a policy owns its replica count: the rule stands back.
    (HORIZONTAL_POD_AUTOSCALERS, None): frozenset({"list"}),
    (DEPLOYMENTS, None): frozenset({"get", "create", "patch"}),
    (SERVICES, None): frozenset({"get", "create", "patch"}),
    (CONFIGMAPS, None): frozenset({"get", "create", "patch"}),
    # Never patched: an existing admin token is never regenerated.
    (SECRETS, None): frozenset({"get", "create"}),
    # The tuner lists a policy's pods to push decisions to each ready one.
    (PODS, None): frozenset({"list"}),
    (EVENTS, None): frozenset({"create"}),
    # Owned while the policy runs 2 or more replicas, deleted below that.
    (PODDISRUPTIONBUDGETS, None): frozenset({"get", "create", "patch", "delete"}),
}

EVENT_COMPONENT = "batchpilot-operator"
USER_AGENT = "batchpilot-operator"
# (connect, read): a hung API server fails the call instead of holding a thread.
REQUEST_TIMEOUT_S = (5.0, 30.0)
# client-go's rule: a GET answered 429 or 5xx with Retry-After is sent again after
# that delay, this many times. Writes are not retried: the handlers retry them whole.
MAX_RETRIES = 3
MAX_CONCURRENT_CALLS = 8
MERGE_PATCH = "application/merge-patch+json"
DEFAULT_KUBECONFIG = "~/.kube/config"

# The client's typed API of each built-in kind and the noun in its method names
# (read_namespaced_config_map, ...). Any other kind is a custom resource.
_BUILT_IN: Mapping[Kind, tuple[Callable[[k8s.ApiClient], Any], str]] = {
    DEPLOYMENTS: (k8s.AppsV1Api, "deployment"),
    SERVICES: (k8s.CoreV1Api, "service"),
    CONFIGMAPS: (k8s.CoreV1Api, "config_map"),
    SECRETS: (k8s.CoreV1Api, "secret"),
    PODS: (k8s.CoreV1Api, "pod"),
    EVENTS: (k8s.CoreV1Api, "event"),
    HORIZONTAL_POD_AUTOSCALERS: (k8s.AutoscalingV2Api, "horizontal_pod_autoscaler"),
    PODDISRUPTIONBUDGETS: (k8s.PolicyV1Api, "pod_disruption_budget"),
}
_BUILT_IN_VERBS: Mapping[str, str] = {
    "get": "read", "list": "list", "create": "create", "patch": "patch", "delete": "delete",
}


class KubeError(Exception):
    def __init__(self, status: int, reason: str, message: str) -> None:
        super().__init__(f"Kubernetes API error {status} {reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Conflict(KubeError):
    """HTTP 409: the object already exists or changed meanwhile."""


class Unreachable(KubeError):
    """No HTTP answer (status 0): the connection failed or timed out, or TLS refused it."""


class UndeclaredCall(RuntimeError):
    """The code tried a call missing from PERMISSIONS (and so from the ClusterRole)."""


def load_configuration() -> k8s.Configuration:
    """The client's endpoint and credentials: the pod's service account, else the kubeconfig.

    Raises kopf.PermanentError when there are none: retrying would not bring them.
    """
    configuration = k8s.Configuration()
    try:
        k8s_config.load_incluster_config(client_configuration=configuration)
    except k8s_config.ConfigException as not_in_pod:
        _load_kubeconfig(configuration, not_in_pod)
    return configuration


def _load_kubeconfig(
    configuration: k8s.Configuration, not_in_pod: k8s_config.ConfigException
) -> None:
    paths = _kubeconfig_paths()
    if not paths:
        raise kopf.PermanentError(
            "no Kubernetes credentials: not in a pod, and neither $KUBECONFIG nor "
            f"{DEFAULT_KUBECONFIG} (service account: {not_in_pod})"
        )
    for path in paths:  # the client skips unreadable files; a file named in vain is an error
        try:
            Path(path).read_bytes()
        except OSError as exc:
            raise kopf.PermanentError(
                f"cannot read kubeconfig {exc.filename}: {exc.strerror}"
            ) from exc
    try:
        k8s_config.load_kube_config(
            config_file=os.pathsep.join(paths),
            client_configuration=configuration,
            persist_config=False,  # never write refreshed tokens into the user's file
        )
    except Exception as exc:  # any flaw in the file: retrying would not mend it
        raise kopf.PermanentError(
            f"cannot log in with kubeconfig {os.pathsep.join(paths)}: {exc}"
        ) from exc


def _kubeconfig_paths() -> list[str]:
    """$KUBECONFIG's files, read at login (not at import), else ~/.kube/config if present."""
    listed = os.environ.get("KUBECONFIG", "")
    if listed:
        return [os.path.expanduser(path) for path in listed.split(os.pathsep) if path]
    default = os.path.expanduser(DEFAULT_KUBECONFIG)
    return [default] if os.path.exists(default) else []


def connection_info(settings: kopf.OperatorSettings) -> kopf.ConnectionInfo:
    """Kopf's credentials, from the client's loader: what `Client.login` uses too.

    Kopf calls this again after a 401, so a rejected token is fetched anew
    (an exec plugin runs again).
    """
    configuration = load_configuration()
    header = configuration.get_api_key_with_prefix("BearerToken")  # refreshes if expired
    parts = header.split(" ", 1) if header else []
    scheme, token = (parts[0], parts[1]) if len(parts) == 2 else (None, header or None)
    return kopf.ConnectionInfo(
        server=configuration.host,
        ca_path=configuration.ssl_ca_cert,
        insecure=not configuration.verify_ssl,
        scheme=scheme,
        token=token,
        certificate_path=configuration.cert_file,
        private_key_path=configuration.key_file,
        proxy_url=configuration.proxy,
        trust_env=settings.networking.trust_env,
    )


def label_selector(labels: Mapping[str, str]) -> str:
    """An equality-based label selector, `k=v,k=v` (list calls, a scale's status.selector)."""
    return ",".join(f"{key}={value}" for key, value in labels.items())


def _with_retries(configuration: k8s.Configuration) -> k8s.Configuration:
    configuration.retries = MAX_RETRIES
    configuration.client_go_retries = True
    configuration.connection_pool_maxsize = MAX_CONCURRENT_CALLS
    return configuration


class Client:
    """Namespaced get/list/create/merge-patch/delete for the kinds in PERMISSIONS, plus Events."""

    def __init__(self, api: k8s.ApiClient) -> None:
        api.user_agent = USER_AGENT
        self._api = api
        self._threads = ThreadPoolExecutor(MAX_CONCURRENT_CALLS, thread_name_prefix="kube-api")

    @classmethod
    def for_url(cls, base_url: str, token: str | None = None) -> Client:
        configuration = k8s.Configuration(host=base_url.rstrip("/"))
        if token:
            configuration.api_key["BearerToken"] = f"Bearer {token}"
        return cls(k8s.ApiClient(_with_retries(configuration)))

    @classmethod
    def login(cls, settings: kopf.OperatorSettings) -> Client:
        """Logged in as Kopf is (`connection_info`); `settings` keeps the two signatures alike."""
        return cls(k8s.ApiClient(_with_retries(load_configuration())))

    async def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._api.close()

    async def get(self, kind: Kind, namespace: str, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        try:
            return await self._call("get", kind, namespace, name=name)
        except KubeError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(
        self, kind: Kind, namespace: str, labels: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        selector = label_selector(labels or {})
        body = await self._call("list", kind, namespace, label_selector=selector or None)
        return list(body.get("items") or [])

    async def create(self, kind: Kind, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("create", kind, namespace, body=dict(body))

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
            "patch", kind, namespace, name=name, subresource=subresource, body=dict(patch),
            _content_type=MERGE_PATCH,
        )

    async def scale(self, kind: Kind, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Set the object's replica count through its scale subresource, as kubectl scale
        and an HPA do (the API server maps it to the kind's own field); the Scale answered."""
        return await self.patch(kind, namespace, name, {"spec": {"replicas": replicas}}, "scale")

    async def delete(self, kind: Kind, namespace: str, name: str) -> bool:
        """Delete the object; False when it was already gone."""
        try:
            await self._call("delete", kind, namespace, name=name)
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

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
        subresource: str | None = None,
        **arguments: Any,
    ) -> dict[str, Any]:
        if verb not in PERMISSIONS.get((kind, subresource), frozenset()):
            raise UndeclaredCall(
                f"{verb} {kind.plural}{'/' + subresource if subresource else ''} is not in "
                "batchpilot_operator.kube.PERMISSIONS (and so not granted by the ClusterRole)"
            )
        method, names_the_kind = self._method(verb, kind, subresource)
        send = functools.partial(
            method, namespace=namespace, **names_the_kind, **arguments,
            _preload_content=False, _request_timeout=REQUEST_TIMEOUT_S,
        )
        return await asyncio.get_running_loop().run_in_executor(self._threads, _send, send)

    def _method(
        self, verb: Verb, kind: Kind, subresource: str | None
    ) -> tuple[Callable[..., Any], dict[str, str]]:
        """The client's typed method for the call, and the arguments that name the kind."""
        suffix = f"_{subresource}" if subresource else ""
        if kind in _BUILT_IN:
            api, noun = _BUILT_IN[kind]
            return getattr(api(self._api), f"{_BUILT_IN_VERBS[verb]}_namespaced_{noun}{suffix}"), {}
        custom = k8s.CustomObjectsApi(self._api)
        return getattr(custom, f"{verb}_namespaced_custom_object{suffix}"), {
            "group": kind.group, "version": kind.version, "plural": kind.plural,
        }


def _send(send: Callable[[], urllib3.BaseHTTPResponse]) -> dict[str, Any]:
    """One request, in a worker thread; the answer's JSON, or the error it stands for."""
    try:
        response = send()
    except k8s.ApiException as exc:
        raise _error(exc.status or 0, exc.reason or "", exc.body) from None
    except urllib3.exceptions.HTTPError as exc:
        raise Unreachable(0, type(exc).__name__, str(exc)) from exc
    except pydantic.ValidationError as exc:  # the client checks a create's body against its model
        raise KubeError(422, "Invalid", f"refused by the client before sending: {exc}") from exc
    try:
        return _json_or_text(response.data)
    finally:
        response.release_conn()


def _json_or_text(raw: bytes | str | None) -> dict[str, Any]:
    try:
        data = json.loads(raw or "{}")
    except ValueError:
        return {"message": raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)}
    return data if isinstance(data, dict) else {"message": str(data)}


def _error(status: int, http_reason: str, body: bytes | str | None) -> KubeError:
    payload = _json_or_text(body)
    reason = str(payload.get("reason") or http_reason)
    message = str(payload.get("message") or payload)
    cls = {0: Unreachable, 409: Conflict}.get(status, KubeError)
    return cls(status, reason, message)
