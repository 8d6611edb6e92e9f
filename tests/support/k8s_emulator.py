"""A Kubernetes API emulator over real HTTP, and Kopf running for real against it.

    with run_cluster() as cluster, run_operator(cluster):
        await cluster.create(kube.POLICIES, policy_body)
        cm = await cluster.wait_for(kube.CONFIGMAPS, "ns", "p-batching")

`Emulator` is kmock 0.8's `KubernetesEmulator` plus what Kopf and the operator
rely on and kmock lacks: uid / resourceVersion /
generation / creationTimestamp / namespace stamping, `generateName`, 422 on a
failed JSON-patch test, label selectors on list, a garbage collector that
deletes the dependents of a deleted owner, and the scale subresource of a
custom resource whose CRD declares one (GET and merge-PATCH of an
autoscaling/v1 Scale mapped through the CRD's specReplicasPath,
statusReplicasPath and labelSelectorPath, as `kubectl scale` and an HPA use
it; kmock would patch the object itself and answer it whole). The emulator and Kopf each run in
their own thread with their own event loop; tests talk to both over HTTP only.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import itertools
import os
import secrets
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import aiohttp.web
import jsonpatch
import kmock
import kopf
import yaml
from batchpilot_operator import builders, kube
from batchpilot_operator.handlers import configure
from batchpilot_operator.main import load_handlers
from typing_extensions import override

from tests.support import ROOT

CRD_PATH = ROOT / "crds" / "batchingpolicy.yaml"
BUILTIN_KINDS = (
    kube.DEPLOYMENTS,
    kube.SERVICES,
    kube.CONFIGMAPS,
    kube.SECRETS,
    kube.PODS,
    kube.EVENTS,
    kube.PODDISRUPTIONBUDGETS,
)
# Served for the operator's HPA lookup (scaler.py) and for tests that create one.
LISTED_KINDS = (kube.HORIZONTAL_POD_AUTOSCALERS,)
ALL_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete")
SCALE = "scale"
DEFAULT_TIMEOUT = 10.0
MUTATIONS = (kmock.action.CREATE, kmock.action.UPDATE, kmock.action.DELETE)
T = TypeVar("T")


@dataclass(frozen=True)
class ApiCall:
    """One resource request as RBAC sees it: (apiGroup, resource[/subresource], verb)."""

    user_agent: str
    namespace: str | None
    group: str
    resource: str
    verb: str
    at: float = field(default=0.0, compare=False)  # time.monotonic() on arrival

    @property
    def from_operator(self) -> bool:
        """Made by the operator (its own client or Kopf's), not by a test's helpers."""
        return self.user_agent.startswith((kube.USER_AGENT, "kopf/"))


@dataclass
class Fault:
    """An error the emulator answers to the operator's matching calls instead of serving them.

    Matches on `ApiCall.verb` and `ApiCall.resource` (e.g. "configmaps",
    "batchingpolicies/status"); None matches any. `times` limits how many calls
    get it (None: until removed from `Emulator.faults`).
    """

    status: int
    verbs: frozenset[str] | None = None
    resources: frozenset[str] | None = None
    times: int | None = None
    retry_after_s: int | None = None
    hits: int = 0
    hit_by: list[str] = field(default_factory=list)  # the User-Agent of each call answered

    def takes(self, call: ApiCall) -> bool:
        if not call.from_operator or (self.times is not None and self.hits >= self.times):
            return False
        return (self.verbs is None or call.verb in self.verbs) and (
            self.resources is None or call.resource in self.resources
        )

    def response(self, call: ApiCall) -> aiohttp.web.Response:
        self.hits += 1
        self.hit_by.append(call.user_agent)
        reason = {409: "Conflict", 429: "TooManyRequests"}.get(self.status, "InternalError")
        headers = {"Retry-After": str(self.retry_after_s)} if self.retry_after_s else None
        status = {
            "apiVersion": "v1",
            "kind": "Status",
            "metadata": {},
            "status": "Failure",
            "code": self.status,
            "reason": reason,
            "message": f"injected fault {self.status}",
        }
        return aiohttp.web.json_response(status, status=self.status, headers=headers)


class Emulator(kmock.KubernetesEmulator):
    """kmock's emulator, closer to a real API server in the ways the operator relies on."""

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._versions = itertools.count(1)
        # Every request as kmock parsed it (method, path, headers), in order of arrival.
        self.requests: list[kmock.Request] = []
        # Every resource request, for RBAC tests to compare with the ClusterRole.
        self.calls: list[ApiCall] = []
        # Errors to answer instead of serving (chaos tests); appended from the test thread.
        self.faults: list[Fault] = []
        self._watches: set[asyncio.Task[Any]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        # (group, version, plural) -> the CRD's scale subresource paths.
        self._scale_paths: dict[tuple[str, str, str], dict[str, str]] = {}

    def drop_watches(self) -> None:
        """Cut every open watch stream, as an API server restart or a proxy would."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(lambda: [t.cancel() for t in list(self._watches)])

    def operator_calls(self, since: float, until: float) -> list[ApiCall]:
        return [c for c in self.calls if c.from_operator and since <= c.at < until]

    def register_kinds(self) -> None:
        """Serve discovery for the built-in kinds and the BatchingPolicy CRD."""
        for kind in (*BUILTIN_KINDS, *LISTED_KINDS):
            self.resources[f"{kind.api_version}/{kind.plural}"] = kmock.ResourceInfo(
                kind=kind.kind, namespaced=True, verbs=set(ALL_VERBS)
            )
        # Kopf waits for these two to appear in discovery before it starts watching,
        # even cluster-wide and with scanning disabled (it then never lists them).
        self.resources["v1/namespaces"] = kmock.ResourceInfo(
            kind="Namespace", namespaced=False, verbs=set(ALL_VERBS)
        )
        self.resources["apiextensions.k8s.io/v1/customresourcedefinitions"] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs=set(ALL_VERBS)
        )
        crd = yaml.safe_load(CRD_PATH.read_text())
        names = crd["spec"]["names"]
        for version in crd["spec"]["versions"]:
            self.resources[f"{crd['spec']['group']}/{version['name']}/{names['plural']}"] = (
                kmock.ResourceInfo(
                    kind=names["kind"],
                    singular=names["singular"],
                    namespaced=True,
                    shortnames=set(names.get("shortNames", [])),
                    verbs=set(ALL_VERBS),
                    subresources=set(version.get("subresources", {})),
                )
            )
            scale = (version.get("subresources") or {}).get(SCALE)
            if scale is not None:
                key = (crd["spec"]["group"], version["name"], names["plural"])
                self._scale_paths[key] = dict(scale)

    @override
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self.requests.append(request)
        try:
            return await self._serve(request)
        finally:
            # kmock finds a request's reaction by scanning every request its root holds, from
            # the first: an emulator that lives for a module of tests got slower with each
            # call. The root holds only the requests in flight; `requests` keeps the history.
            self._requests[:] = [held for held in self._requests if held is not request]

    async def _serve(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is not None and request.action is not None:
            call = self._record(request)
            fault = next((f for f in self.faults if call is not None and f.takes(call)), None)
            if fault is not None and call is not None:
                return fault.response(call)
            if request.subresource == SCALE:
                return await self._serve_scale(request)
            if request.action == kmock.action.CREATE:
                self._stamp_new(request)
            elif request.action == kmock.action.UPDATE:
                self._stamp_patch(request)
        if request.action == kmock.action.WATCH:
            return await self._watch(request)
        response = await super()._handle(request)
        if request.resource is not None and request.action in MUTATIONS:
            await self._collect_garbage()
        return response

    async def _watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        self._watches.add(task)
        try:
            return await super()._handle(request)
        finally:
            self._watches.discard(task)

    def _record(self, request: kmock.Request) -> ApiCall | None:
        assert request.resource is not None and request.action is not None
        if not request.resource.plural:
            return None  # discovery, open to every client
        verb = str(request.action.value).lower()
        call = ApiCall(
            user_agent=request.headers.get("User-Agent", ""),
            namespace=request.namespace,
            group=request.resource.group or "",
            resource=request.resource.plural
            + (f"/{request.subresource}" if request.subresource else ""),
            verb={"fetch": "get", "update": "patch"}.get(verb, verb),
            at=time.monotonic(),
        )
        self.calls.append(call)
        return call

    def _stamp_new(self, request: kmock.Request) -> None:
        if not isinstance(request.data, dict):
            return  # kmock refuses it itself
        meta = request.data.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace
        meta["uid"] = str(uuid.uuid4())
        meta["resourceVersion"] = str(next(self._versions))
        meta["generation"] = 1
        meta["creationTimestamp"] = _now()

    def _stamp_patch(self, request: kmock.Request) -> None:
        current = self._current(request)
        if current is None:
            return  # kmock answers 404 itself
        version = str(next(self._versions))
        if isinstance(request.data, list):  # JSON-patch: a failed test is a conflict, not a crash
            try:
                jsonpatch.apply_patch(current, [op for op in request.data if op["op"] == "test"])
            except jsonpatch.JsonPatchTestFailed as exc:
                raise kmock.KubernetesError(status=422, reason="Invalid", message=str(exc)) from exc
            request.data.append(
                {"op": "replace", "path": "/metadata/resourceVersion", "value": version}
            )
            return
        if not isinstance(request.data, dict):
            return
        meta = request.data.setdefault("metadata", {})
        meta["resourceVersion"] = version
        if request.subresource is None and "spec" in request.data:
            meta["generation"] = int(current.get("metadata", {}).get("generation") or 0) + 1

    async def _serve_scale(self, request: kmock.Request) -> aiohttp.web.Response:
        """GET or merge-PATCH `.../NAME/scale`: the Scale read from the object through the
        CRD's paths; a PATCH sets the object's replicas (a spec change: a new generation)."""
        assert request.resource is not None
        resource = request.resource
        key = (resource.group or "", resource.version or "", resource.plural or "")
        paths = self._scale_paths.get(key)
        if paths is None:
            raise kmock.KubernetesError(
                status=404, reason="NotFound", message=f"{resource.plural} has no scale subresource"
            )
        if request.action not in (kmock.action.FETCH, kmock.action.UPDATE):
            raise kmock.KubernetesError(
                status=405, reason="MethodNotAllowed", message="the emulator serves GET and PATCH"
            )
        async with self._lock:
            current = self._current(request)
            if current is None:
                raise kmock.KubernetesError(
                    status=404, reason="NotFound", message=f"{request.name} not found"
                )
            scale = _scale_of(current, paths)
            if request.action == kmock.action.UPDATE:
                replicas = _scaled_replicas(request.data, scale["spec"]["replicas"])
                await self._set_replicas(request, current, paths["specReplicasPath"], replicas)
                scale = _scale_of(self._current(request) or current, paths)
        return aiohttp.web.json_response(scale)

    async def _set_replicas(
        self, request: kmock.Request, current: dict[str, Any], path: str, replicas: int
    ) -> None:
        """Write `replicas` at the CRD's spec path, as the API server does for a Scale update."""
        meta = current.get("metadata", {})
        change = _nested(_path_keys(path), replicas)
        change["metadata"] = {
            "resourceVersion": str(next(self._versions)),
            "generation": int(meta.get("generation") or 0) + 1,
        }
        obj = self.objects[(request.resource, request.namespace, request.name)]
        obj.patch(change)
        await self._buses[request.resource].put({"type": "MODIFIED", "object": obj.raw})

    def _current(self, request: kmock.Request) -> dict[str, Any] | None:
        key = (request.resource, request.namespace, request.name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        raw: dict[str, Any] = self.objects[key].raw
        return raw

    async def _collect_garbage(self) -> None:
        """Delete every object whose owners are all gone, as Kubernetes' garbage collector does.

        Run after every write: a dependent created by a reconcile that raced with its
        owner's deletion is collected too.
        """
        async with self._lock:
            live = {
                obj.raw.get("metadata", {}).get("uid")
                for obj in self.objects.values()
                if not obj.deleted
            }
            orphans = [
                (resource, obj)
                for (resource, _, _), obj in self.objects.items()
                if not obj.deleted
                and (refs := obj.raw.get("metadata", {}).get("ownerReferences"))
                and not any(ref.get("uid") in live for ref in refs)
            ]
            for resource, obj in orphans:
                raw = obj.raw
                obj.delete()
                await self._buses[resource].put({"type": "DELETED", "object": raw})
        if orphans:
            await self._collect_garbage()  # dependents of the dependents

    @override
    async def _serve_list(self, request: kmock.Request) -> kmock.Payload:
        payload: dict[str, Any] = await super()._serve_list(request)
        selector = _parse_selector(request.params.get("labelSelector", ""))
        payload["items"] = [
            item
            for item in payload["items"]
            if all(
                item.get("metadata", {}).get("labels", {}).get(k) == v for k, v in selector.items()
            )
        ]
        return payload


def _path_keys(path: str) -> list[str]:
    """A CRD's dotted JSON path (`.spec.replicas`) as keys."""
    return [key for key in path.split(".") if key]


def _at(obj: Mapping[str, Any], path: str) -> Any:
    value: Any = obj
    for key in _path_keys(path):
        value = value.get(key) if isinstance(value, Mapping) else None
    return value


def _nested(keys: list[str], value: Any) -> dict[str, Any]:
    return {keys[0]: value if len(keys) == 1 else _nested(keys[1:], value)}


def _scale_of(obj: Mapping[str, Any], paths: Mapping[str, str]) -> dict[str, Any]:
    """The object's autoscaling/v1 Scale. As documented for CRDs: no value at
    specReplicasPath is an error, none at statusReplicasPath reads 0, none at
    labelSelectorPath an empty selector."""
    replicas = _at(obj, paths["specReplicasPath"])
    if not isinstance(replicas, int):
        raise kmock.KubernetesError(
            status=500, reason="InternalError",
            message=f"no replica count at {paths['specReplicasPath']}",
        )  # fmt: skip
    meta = obj.get("metadata", {})
    status: dict[str, Any] = {"replicas": _at(obj, paths["statusReplicasPath"]) or 0}
    selector = _at(obj, paths["labelSelectorPath"]) if "labelSelectorPath" in paths else None
    if selector:
        status["selector"] = selector
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            key: meta[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if key in meta
        },
        "spec": {"replicas": replicas},
        "status": status,
    }


def _scaled_replicas(body: Any, current: int) -> int:
    """spec.replicas of a merge patch of the Scale (kubectl scale sends only that)."""
    spec = body.get("spec") if isinstance(body, Mapping) else None
    replicas = spec.get("replicas", current) if isinstance(spec, Mapping) else current
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise kmock.KubernetesError(
            status=422, reason="Invalid",
            message=f"spec.replicas must be a non-negative integer, got {replicas!r}",
        )  # fmt: skip
    return replicas


def _parse_selector(text: str) -> dict[str, str]:
    """Equality-based label selectors (`a=b,c=d`): the only kind the operator sends."""
    pairs = [part.split("=", 1) for part in text.split(",") if part]
    return {key.strip(): value.strip() for key, value in pairs}


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Cluster:
    """A running emulator: its URL, a kubeconfig for it, and kubectl-like async helpers."""

    url: str
    kubeconfig: Path
    emulator: Emulator
    timeout: float = DEFAULT_TIMEOUT

    async def request(
        self, method: str, path: str, body: Any = None, content_type: str = "application/json"
    ) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                method,
                self.url + path,
                json=body,
                headers={"Content-Type": content_type} if body is not None else {},
            ) as response,
        ):
            return response.status, await response.json(content_type=None)

    async def create(self, kind: kube.Kind, body: Mapping[str, Any]) -> dict[str, Any]:
        status, data = await self.request("POST", kind.path(body["metadata"]["namespace"]), body)
        _expect(status, data, "create", 201, 200)
        return dict(data)

    async def get(self, kind: kube.Kind, namespace: str, name: str) -> dict[str, Any] | None:
        status, data = await self.request("GET", kind.path(namespace, name))
        if status == 404:
            return None
        _expect(status, data, "get", 200)
        return dict(data)

    async def list(
        self, kind: kube.Kind, namespace: str, labels: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        selector = ",".join(f"{k}={v}" for k, v in (labels or {}).items())
        query = f"?labelSelector={selector}" if selector else ""
        status, data = await self.request("GET", kind.path(namespace) + query)
        _expect(status, data, "list", 200)
        return list(data["items"])

    async def patch(
        self,
        kind: kube.Kind,
        namespace: str,
        name: str,
        patch: Mapping[str, Any],
        subresource: str | None = None,
    ) -> dict[str, Any]:
        status, data = await self.request(
            "PATCH",
            kind.path(namespace, name, subresource),
            patch,
            "application/merge-patch+json",
        )
        _expect(status, data, "patch", 200)
        return dict(data)

    async def delete(self, kind: kube.Kind, namespace: str, name: str) -> None:
        status, data = await self.request("DELETE", kind.path(namespace, name))
        _expect(status, data, "delete", 200)

    async def delete_policies(self) -> None:
        """Delete every BatchingPolicy. Tests sharing a cluster call it after each test: the
        next test's operator would otherwise resume their tuning loops beside its own,
        against pods that are gone, and share the test process's CPU with them."""
        kind = kube.POLICIES
        status, data = await self.request("GET", f"/apis/{kind.group}/{kind.version}/{kind.plural}")
        _expect(status, data, "list", 200)
        for policy in data["items"]:
            await self.delete(kind, policy["metadata"]["namespace"], policy["metadata"]["name"])

    async def wait_until(
        self,
        probe: Callable[[], Awaitable[T | None]],
        what: str,
        timeout: float | None = None,
        seen: Callable[[], object] | None = None,
    ) -> T:
        """Poll `probe` until it returns something truthy; fail naming `what` at the
        deadline, with `seen()` (what the last probe saw) when given, so that CI's log
        alone says what came instead."""
        deadline = time.monotonic() + (timeout or self.timeout)
        while True:
            result = await probe()
            if result:
                return result
            if time.monotonic() > deadline:
                waited = timeout or self.timeout
                detail = f"; last seen: {shorten(seen())}" if seen is not None else ""
                raise AssertionError(f"timed out after {waited:g}s waiting for {what}{detail}")
            await asyncio.sleep(0.05)

    async def wait_for(
        self,
        kind: kube.Kind,
        namespace: str,
        name: str,
        predicate: Callable[[dict[str, Any]], bool] = lambda _: True,
        what: str = "",
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The object once it exists and satisfies `predicate`."""
        last: list[dict[str, Any] | None] = [None]

        async def probe() -> dict[str, Any] | None:
            obj = await self.get(kind, namespace, name)
            last[0] = obj
            return obj if obj is not None and predicate(obj) else None

        def seen() -> object:
            obj = last[0]
            if obj is None:
                return "no such object"
            return {key: obj[key] for key in ("spec", "status", "data") if key in obj}

        return await self.wait_until(
            probe, what or f"{kind.kind} {namespace}/{name}", timeout, seen
        )

    async def wait_for_events(
        self,
        namespace: str,
        name: str,
        predicate: Callable[[dict[str, Any]], bool],
        what: str,
        timeout: float | None = None,
        count: int = 1,
    ) -> list[dict[str, Any]]:
        """The object's Events that satisfy `predicate`, once there are at least `count`.
        The operator posts an Event after the change it reports: a test that saw the
        change has not necessarily seen its Event yet."""
        posted: list[dict[str, Any]] = []

        async def probe() -> list[dict[str, Any]]:
            posted[:] = await self.events_for(namespace, name)
            matching = [e for e in posted if predicate(e)]
            return matching if len(matching) >= count else []

        def seen() -> object:
            return [f"{e.get('type')} {e.get('reason')}: {e.get('message')}" for e in posted]

        return await self.wait_until(
            probe, f"{what} (an Event of {namespace}/{name})", timeout, seen
        )

    async def wait_for_in_force(
        self, namespace: str, name: str, timeout: float | None = None
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """The policy and its ConfigMap once the policy's status shows the ConfigMap's
        config in force. One writer puts it there (reconcile.in_force_fields, status_owners.py),
        after a round's own record of its decision: a test that saw the record waits here
        for the config it put in force, rather than reading it beside the record."""
        found: list[dict[str, Any] | None] = [None, None]

        async def probe() -> tuple[dict[str, Any], dict[str, Any]] | None:
            found[0] = await self.get(kube.POLICIES, namespace, name)
            found[1] = await self.get(kube.CONFIGMAPS, namespace, builders.config_map_name(name))
            policy, cm = found
            if policy is None or cm is None:
                return None
            return (policy, cm) if _shows_in_force(policy, cm) else None

        def seen() -> object:
            policy, cm = found
            return {"status": (policy or {}).get("status"), "data": (cm or {}).get("data")}

        return await self.wait_until(
            probe, f"{namespace}/{name}'s status to show its ConfigMap's config", timeout, seen
        )

    async def wait_gone(
        self, kind: kube.Kind, namespace: str, name: str, timeout: float | None = None
    ) -> None:
        async def probe() -> bool:
            return await self.get(kind, namespace, name) is None

        await self.wait_until(probe, f"{kind.kind} {namespace}/{name} to be gone", timeout)

    async def wait_for_condition(
        self,
        namespace: str,
        name: str,
        type_: str,
        status: str,
        reason: str | None = None,
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The policy's condition `type_` once it has `status` (and `reason`, if given)."""

        def matches(policy: dict[str, Any]) -> bool:
            found = condition(policy, type_)
            if found is None or found["status"] != status:
                return False
            return reason is None or found.get("reason") == reason

        policy = await self.wait_for(
            kube.POLICIES,
            namespace,
            name,
            matches,
            f"condition {type_}={status} ({reason or 'any reason'}) on {namespace}/{name}",
            timeout,
        )
        found = condition(policy, type_)
        assert found is not None
        return found

    async def add_server_pod(
        self, namespace: str, policy_name: str, name: str, ip: str, port: int, ready: bool = True
    ) -> dict[str, Any]:
        """A Pod as the policy's Deployment would run it, but served at `ip:port`
        (e.g. a real local `batchpilot serve`): labels, container port "http", podIP, Ready."""
        await self.create(kube.PODS, server_pod(namespace, policy_name, name, port))
        status = {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        }
        return await self.patch(kube.PODS, namespace, name, {"status": status}, "status")

    async def events_for(self, namespace: str, name: str) -> list[dict[str, Any]]:
        events = await self.list(kube.EVENTS, namespace)
        return [e for e in events if e.get("involvedObject", {}).get("name") == name]


def server_pod(namespace: str, policy_name: str, name: str, port: int) -> dict[str, Any]:
    """The body of a server Pod of `policy_name` whose "http" port is `port`."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": builders.selector_labels(policy_name),
        },
        "spec": {
            "containers": [
                {
                    "name": "server",
                    "image": "batchpilot:test",
                    "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
                }
            ],
        },
    }


def shorten(value: object, limit: int = 2000) -> str:
    """`value` as text for a failure message, cut to `limit` characters."""
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _shows_in_force(policy: Mapping[str, Any], cm: Mapping[str, Any]) -> bool:
    stored = builders.parse_config_data(dict(cm.get("data") or {}))
    status = policy.get("status") or {}
    return stored is not None and (
        status.get("maxBatchSize"), status.get("batchTimeoutMs"),
        status.get("numSpeculativeTokens"),
    ) == (stored.max_batch_size, stored.batch_timeout_ms, stored.num_speculative_tokens)


def condition(obj: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for found in (obj.get("status") or {}).get("conditions") or []:
        if found.get("type") == type_:
            return dict(found)
    return None


def _expect(status: int, data: Any, what: str, *ok: int) -> None:
    if status not in ok:
        raise AssertionError(f"{what} answered HTTP {status}: {data}")


def _write_kubeconfig(path: Path, url: str) -> None:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "emulator",
                "clusters": [{"name": "emulator", "cluster": {"server": url}}],
                "users": [{"name": "emulator", "user": {"token": "emulator"}}],
                "contexts": [
                    {"name": "emulator", "context": {"cluster": "emulator", "user": "emulator"}}
                ],
            }
        )
    )


@contextlib.contextmanager
def run_cluster() -> Iterator[Cluster]:
    """Start the emulator on 127.0.0.1 (random port) in its own thread; stop it on exit."""
    emulator = Emulator()
    emulator.register_kinds()
    loop = asyncio.new_event_loop()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    started = threading.Event()
    stop = asyncio.Event()
    errors: list[BaseException] = []

    async def serve() -> None:
        async with emulator:
            # Watch streams never end by themselves: cancel them when clients leave or at exit.
            server = aiohttp.web.Server(emulator, handler_cancellation=True)
            runner = aiohttp.web.ServerRunner(server, handle_signals=False, shutdown_timeout=1.0)
            await runner.setup()
            await aiohttp.web.SockSite(runner, sock).start()
            started.set()
            try:
                await stop.wait()
            finally:
                await runner.cleanup()

    def main() -> None:
        try:
            loop.run_until_complete(serve())
        except BaseException as exc:  # surfaced by the test thread
            errors.append(exc)
            started.set()
        finally:
            loop.close()

    thread = threading.Thread(target=main, name="k8s-emulator", daemon=True)
    thread.start()
    started.wait(DEFAULT_TIMEOUT)
    if errors or not started.is_set():
        raise RuntimeError(f"the Kubernetes emulator did not start: {errors}")
    host, port = sock.getsockname()
    url = f"http://{host}:{port}"
    with tempfile.TemporaryDirectory(prefix="batchpilot-k8s-") as directory:
        kubeconfig = Path(directory) / "kubeconfig"
        _write_kubeconfig(kubeconfig, url)
        try:
            yield Cluster(url=url, kubeconfig=kubeconfig, emulator=emulator)
        finally:
            loop.call_soon_threadsafe(stop.set)
            thread.join(DEFAULT_TIMEOUT)


@dataclass
class OperatorThread:
    """Kopf running in its own thread against a `Cluster`."""

    thread: threading.Thread
    stop_flag: threading.Event
    errors: list[BaseException]

    def check(self) -> None:
        if self.errors:
            raise RuntimeError(f"the operator crashed: {self.errors[0]!r}") from self.errors[0]


@contextlib.contextmanager
def run_operator(
    cluster: Cluster,
    memo: Mapping[str, Any] | None = None,
    configure_settings: Callable[[kopf.OperatorSettings], None] | None = None,
) -> Iterator[OperatorThread]:
    """Run every batchpilot Kopf handler (registry.HANDLER_MODULES), cluster-wide, until exit.

    `memo` seeds Kopf's memo (e.g. `{"prometheus_url": ...}`); `configure_settings`
    may adjust Kopf's settings after batchpilot's own (handlers.configure).
    The operator logs in with the cluster's kubeconfig through $KUBECONFIG.
    """
    load_handlers()
    settings = kopf.OperatorSettings()
    configure(settings)
    if configure_settings is not None:
        configure_settings(settings)
    ready, stop = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def main() -> None:
        try:
            asyncio.run(
                kopf.operator(
                    clusterwide=True,
                    standalone=True,
                    settings=settings,
                    memo=kopf.Memo(**(memo or {})),
                    ready_flag=ready,
                    stop_flag=stop,
                )
            )
        except BaseException as exc:  # surfaced by OperatorThread.check
            errors.append(exc)
            ready.set()

    previous = os.environ.get("KUBECONFIG")
    os.environ["KUBECONFIG"] = str(cluster.kubeconfig)
    thread = threading.Thread(target=main, name="kopf-operator", daemon=True)
    thread.start()
    try:
        if not ready.wait(DEFAULT_TIMEOUT):
            raise RuntimeError("Kopf did not become ready within the deadline")
        operator = OperatorThread(thread=thread, stop_flag=stop, errors=errors)
        operator.check()
        yield operator
        operator.check()
    finally:
        stop.set()
        thread.join(DEFAULT_TIMEOUT)
        if previous is None:
            os.environ.pop("KUBECONFIG", None)
        else:
            os.environ["KUBECONFIG"] = previous
