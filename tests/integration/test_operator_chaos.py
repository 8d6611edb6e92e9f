"""The operator under faults: Kopf for real on the emulator, with a fake Prometheus and pod.

Faults: the API server answering 500, 409 and 429 and dropping its watch
streams; Prometheus refusing, slow or answering garbage; a pod answering the
admin PUT with 500 or hanging. Throughout, the operator must not crash or
call the API in a hot loop, must keep status and the ConfigMap in step (the
config in force is what the ConfigMap says), must not apply a decision twice,
and must report each fault in a condition or an Event. Each test prints one
`chaos:` line with its figures (requests during the fault, time to recover).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from batchpilot_operator import builders, kube
from batchpilot_server import metric_names as names

from tests.support.k8s_emulator import Cluster, Fault, run_cluster, run_operator
from tests.support.policies import policy_object

TOKEN = "chaos-token"
INTERVAL_S = 5  # the CRD's minimum
MAX_BATCH = 2  # one grow step (1 -> 2) reaches it: then the tuner holds
SLO_MS = 1000.0
# The one PUT a pod takes: the decision's knobs, with the budget and the SLO targets it
# judges requests by.
DECIDED_PUT = {
    "max_batch_size": MAX_BATCH, "batch_timeout_ms": 0.0, "prefill_token_budget": 2048,
    "num_speculative_tokens": 0,  # sent at 0 too, so a speculating pod turns it off
    "slo": {"ttft_ms": None, "tpot_ms": None, "e2e_ms": SLO_MS},
}  # fmt: skip
DEADLINE_S = 40.0
# Kopf re-watches each of its five kinds with backoff (1, 1, 2, 3, 5 ... s) and the
# operator retries every 10 s: a few calls per second at worst. A hot loop makes hundreds.
HOT_LOOP_CALLS_PER_S = 20.0

pytestmark = pytest.mark.timeout(240)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    """One emulator per test: policies left by another test would start operator work
    (tuning rounds against fakes that are gone) that blurs the figures."""
    with run_cluster() as running:
        yield running


# -- fakes --------------------------------------------------------------------------------


@dataclass
class FakePrometheus:
    """Answers the operator's instant queries with signals that make the tuner grow the batch,
    or with the fault `mode` names: "shape" (success without data), "garbage" (not JSON),
    "slow" (never answers in time), "error" (HTTP 503)."""

    mode: str = "ok"
    queries: list[float] = field(default_factory=list)  # arrival times

    def samples(self, query: str) -> list[dict[str, Any]]:
        """The answer to one of the source's queries (signals_prometheus.queries)."""

        def sample(value: float, **labels: str) -> dict[str, Any]:
            return {"metric": labels, "value": [time.time(), str(value)]}

        if "sum by (le)" in query:  # p99s with headroom under the 1 s SLO; queueing at 40 %
            bound = "0.4" if names.QUEUE_WAIT in query else "0.5"
            return [sample(1000.0, le=bound), sample(1000.0, le="+Inf")]
        if "sum by (result, target)" in query:
            return [sample(1000.0, result="met", target=names.SLO_ALL)]
        if names.PREEMPTIONS_TOTAL in query:
            return [sample(0.0)]
        if f"{names.BATCH_SIZE}_sum" in query:
            return [sample(1_000_000.0)]  # a mean batch of 1000: every batch full
        if " / " in query:
            return [sample(1.0)]  # the error budget's attainment
        value = {"increase(": 1000.0, "max_over_time": 0.1}.get(
            next((k for k in ("increase(", "max_over_time") if k in query), ""), 10.0
        )
        return [sample(value)]

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.queries.append(time.monotonic())
        if self.mode == "slow":
            await asyncio.sleep(60)
        if self.mode == "garbage":
            return web.Response(text="<html>502 Bad Gateway</html>")
        if self.mode == "shape":
            return web.json_response({"status": "success", "data": {}})
        if self.mode == "error":
            return web.Response(status=503, text="Service Unavailable")
        result = self.samples(request.query["query"])
        return web.json_response({"status": "success", "data": {"resultType": "vector",
                                                                 "result": result}})


@dataclass
class FakePod:
    """A server's admin API: holds a config; `put_mode` "ok", "error" (500, text body) or
    "hang" (never answers a PUT)."""

    put_mode: str = "ok"
    config: dict[str, Any] = field(default_factory=lambda: {
        "max_batch_size": 1, "batch_timeout_ms": 0.0, "max_queue_size": 256})
    version: int = 1
    applied: list[dict[str, Any]] = field(default_factory=list)  # PUT bodies taken

    async def get(self, request: web.Request) -> web.Response:
        return web.json_response({**self.config, "mode": "continuous", "version": self.version})

    async def put(self, request: web.Request) -> web.Response:
        assert request.headers.get("Authorization") == f"Bearer {TOKEN}"
        if self.put_mode == "hang":
            await asyncio.sleep(60)
        if self.put_mode == "error":
            return web.Response(status=500, text="500 Internal Server Error")
        body = await request.json()
        self.applied.append(body)
        self.config.update(body)
        self.version += 1
        return await self.get(request)

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(text="")


@contextlib.asynccontextmanager
async def serving(routes: list[web.RouteDef]) -> AsyncIterator[TestServer]:
    app = web.Application()
    app.add_routes(routes)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield server
    finally:
        await server.close()


@dataclass
class World:
    cluster: Cluster
    namespace: str
    prometheus: FakePrometheus
    pod: FakePod


@contextlib.asynccontextmanager
async def tuned_world(cluster: Cluster, namespace: str) -> AsyncIterator[World]:
    """A policy tuned through a fake Prometheus, with one fake pod, the operator running."""
    prometheus, pod = FakePrometheus(), FakePod()
    async with (
        serving([web.get("/api/v1/query", prometheus.handle)]) as prom_server,
        serving([web.get("/admin/batching", pod.get), web.put("/admin/batching", pod.put),
                 web.get("/metrics", pod.metrics)]) as pod_server,
    ):
        await cluster.create(kube.SECRETS, {
            "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": builders.secret_name("llm"), "namespace": namespace},
            "data": {builders.TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()},
        })
        assert pod_server.port is not None
        await cluster.add_server_pod(namespace, "llm", "llm-0", "127.0.0.1", pod_server.port)
        with run_operator(cluster) as operator:
            url = str(prom_server.make_url("")).rstrip("/")
            await cluster.create(kube.POLICIES, policy(namespace, prometheusUrl=url))
            yield World(cluster, namespace, prometheus, pod)
            operator.check()


def policy(namespace: str, **autotune: Any) -> dict[str, Any]:
    return policy_object("llm", namespace, {
        "replicas": 1,
        "server": {"image": "batchpilot:test"},
        "batching": {
            "maxBatchSize": {"initial": 1, "min": 1, "max": MAX_BATCH},
            "batchTimeoutMs": {"initial": 0, "min": 0, "max": 50},
        },
        "slo": {"p99LatencyMs": SLO_MS},
        "autotune": {"intervalSeconds": INTERVAL_S, "windowSeconds": 10, **autotune},
    })  # fmt: skip


# -- checks ---------------------------------------------------------------------------------


async def in_force(cluster: Cluster, namespace: str) -> tuple[int, int]:
    """(status.maxBatchSize, the ConfigMap's max_batch_size) once status shows the
    ConfigMap's config: a round's record of its decision and the config it put in force
    have separate writers (status_owners.py), so the second is waited for."""
    found, cm = await cluster.wait_for_in_force(namespace, "llm", DEADLINE_S)
    return found["status"]["maxBatchSize"], _stored_batch(cm)


def _stored_batch(cm: dict[str, Any]) -> int:
    return int(json.loads(cm["data"][builders.CONFIG_KEY])["max_batch_size"])


async def next_round(world: World, what: str) -> dict[str, Any]:
    """The policy once a tuning round after this moment has written its decision."""
    before = time.time()

    def decided(obj: dict[str, Any]) -> bool:
        stamp = ((obj.get("status") or {}).get("lastDecision") or {}).get("time", "")
        return stamp > time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(before))

    return await world.cluster.wait_for(
        kube.POLICIES, world.namespace, "llm", decided, what, DEADLINE_S
    )


async def events(cluster: Cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    """The `reason` Events posted so far: for counting them once one has come."""
    return [e for e in await cluster.events_for(namespace, "llm") if e["reason"] == reason]


async def wait_events(cluster: Cluster, namespace: str, reason: str) -> list[dict[str, Any]]:
    """The `reason` Events, once one has come."""
    return await cluster.wait_for_events(
        namespace, "llm", lambda e: e["reason"] == reason, f"a {reason} Event", DEADLINE_S
    )


def calls_per_s(cluster: Cluster, since: float, until: float) -> float:
    return len(cluster.emulator.operator_calls(since, until)) / (until - since)


def report(fault: str, **figures: float | int | str) -> None:
    text = ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in figures.items())
    print(f"\nchaos: {fault}: {text}")


async def grown(world: World) -> None:
    """Waits for the first decision (1 -> MAX_BATCH) to be in force everywhere."""
    await world.cluster.wait_for(
        kube.POLICIES, world.namespace, "llm",
        lambda o: bool((o.get("status") or {}).get("history")), "the first decision", DEADLINE_S,
    )
    assert await in_force(world.cluster, world.namespace) == (MAX_BATCH, MAX_BATCH)


# -- Prometheus ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "says"),
    [("shape", "malformed result"), ("garbage", "not JSON"), ("slow", "timed out"),
     ("error", "HTTP 503")],
)
async def test_prometheus_faults_hold_the_config_and_are_reported(
    cluster: Cluster, mode: str, says: str
) -> None:
    ns = f"prom-{mode}"
    async with tuned_world(cluster, ns) as world:
        await grown(world)
        world.prometheus.mode = mode
        start = time.monotonic()
        down = await cluster.wait_for_condition(
            ns, "llm", "MetricsAvailable", "False", "MetricsUnavailable", DEADLINE_S
        )
        detected = time.monotonic() - start
        held = await next_round(world, "a round after the fault was seen: the loop lives")
        during = time.monotonic()
        queries = sum(1 for t in world.prometheus.queries if start <= t < during)
        api_rate = calls_per_s(cluster, start, during)
        assert held["status"]["lastDecision"]["action"] == "hold"
        assert await in_force(cluster, ns) == (MAX_BATCH, MAX_BATCH)
        assert says in down["message"], down
        world.prometheus.mode = "ok"
        await cluster.wait_for_condition(
            ns, "llm", "MetricsAvailable", "True", "MetricsRead", DEADLINE_S
        )
        recovered = time.monotonic() - during
        assert world.pod.applied == [DECIDED_PUT]
    assert api_rate < HOT_LOOP_CALLS_PER_S
    report(f"prometheus {mode}", seen_after_s=detected, prometheus_queries=queries,
           fault_s=during - start, api_calls_per_s=api_rate, recovered_after_s=recovered)


# -- the pod --------------------------------------------------------------------------------


async def test_a_pod_refusing_or_hanging_on_the_admin_put_is_reported_and_caught_up(
    cluster: Cluster,
) -> None:
    ns = "pod-faults"
    async with tuned_world(cluster, ns) as world:
        world.pod.put_mode = "error"
        first = await world.cluster.wait_for(
            kube.POLICIES, ns, "llm", lambda o: bool((o.get("status") or {}).get("history")),
            "the first decision", DEADLINE_S,
        )
        # The ConfigMap holds the decision, status says so, the pod still runs the old one.
        assert first["status"]["history"][-1]["maxBatchSize"] == MAX_BATCH
        assert await in_force(cluster, ns) == (MAX_BATCH, MAX_BATCH)
        assert world.pod.config["max_batch_size"] == 1
        refused = await wait_events(cluster, ns, "PushRefused")
        assert refused[0]["type"] == "Warning"
        assert "llm-0: HTTP 500" in refused[0]["message"], refused[0]["message"]

        world.pod.put_mode = "hang"
        start = time.monotonic()

        await cluster.wait_for_events(
            ns, "llm", lambda e: e["reason"] == "PushRefused" and "timed out" in e["message"],
            "the hanging pod reported", DEADLINE_S,
        )  # fmt: skip
        await next_round(world, "a round while the pod hangs")
        hang_s = time.monotonic() - start
        hang_rate = calls_per_s(cluster, start, start + hang_s)
        assert await in_force(cluster, ns) == (MAX_BATCH, MAX_BATCH)

        world.pod.put_mode = "ok"
        start = time.monotonic()
        await wait_events(cluster, ns, "Resynced")
        recovered = time.monotonic() - start
        await next_round(world, "a round after the catch-up")
        await wait_events(cluster, ns, "Tuned")
    # Applied once, by the resync: neither the refusals nor the rounds after repeat it.
    assert world.pod.applied == [DECIDED_PUT]
    assert world.pod.config["max_batch_size"] == MAX_BATCH
    assert len(await events(cluster, ns, "Tuned")) == 1
    assert hang_rate < HOT_LOOP_CALLS_PER_S
    report("pod PUT 500 then hang", api_calls_per_s_while_hanging=hang_rate,
           hang_reported_within_s=hang_s, recovered_after_s=recovered)


# -- the API server -------------------------------------------------------------------------


@contextlib.contextmanager
def injected(cluster: Cluster, fault: Fault) -> Iterator[Fault]:
    cluster.emulator.faults.append(fault)
    try:
        yield fault
    finally:
        cluster.emulator.faults.remove(fault)


@pytest.mark.parametrize(
    "fault",
    [
        Fault(500, verbs=frozenset({"create"}), resources=frozenset({"deployments"})),
        Fault(429, retry_after_s=2),
    ],
    ids=["500-on-deployment-create", "429-on-everything"],
)
async def test_api_errors_back_off_are_reported_and_converge(
    cluster: Cluster, fault: Fault
) -> None:
    ns = f"api-{fault.status}"
    fault_s = 8.0
    with run_operator(cluster) as operator:
        with injected(cluster, fault):
            start = time.monotonic()
            await cluster.create(kube.POLICIES, policy_object(
                "llm", ns, {"replicas": 1, "autotune": {"enabled": False}}))
            await asyncio.sleep(fault_s)  # the fault lasts this long whatever the operator does
            end = time.monotonic()
        rate = calls_per_s(cluster, start, end)
        await cluster.wait_for(kube.DEPLOYMENTS, ns, "llm", timeout=DEADLINE_S)
        await cluster.wait_for_condition(ns, "llm", "Ready", "False", "ReplicasNotReady",
                                         DEADLINE_S)
        recovered = time.monotonic() - end
        # Kopf logs the faults its own watch met; those our client met must reach an Event.
        if any(agent.startswith(kube.USER_AGENT) for agent in fault.hit_by):
            await cluster.wait_for_events(
                ns, "llm", lambda e: str(fault.status) in e.get("message", ""),
                f"an Event reporting the API's {fault.status}", DEADLINE_S,
            )  # fmt: skip
        operator.check()
    assert rate < HOT_LOOP_CALLS_PER_S
    assert await in_force_plain(cluster, ns)
    report(f"API {fault.status} ({fault.resources or 'all'})", fault_s=end - start,
           operator_calls=len(cluster.emulator.operator_calls(start, end)),
           calls_per_s=rate, faults_answered=fault.hits, to_our_client=sum(
               a.startswith(kube.USER_AGENT) for a in fault.hit_by), recovered_after_s=recovered)


async def in_force_plain(cluster: Cluster, namespace: str) -> bool:
    """status and the ConfigMap agree on the config in force, as they are now."""
    found = await cluster.get(kube.POLICIES, namespace, "llm")
    cm = await cluster.get(kube.CONFIGMAPS, namespace, builders.config_map_name("llm"))
    assert found is not None and cm is not None
    return bool(found["status"]["maxBatchSize"] == _stored_batch(cm))


async def test_dropped_watch_streams_are_resumed(cluster: Cluster) -> None:
    ns = "watch-drop"
    watch_errors = Fault(500, verbs=frozenset({"watch"}))
    with run_operator(cluster) as operator:
        await cluster.create(kube.POLICIES, policy_object(
            "llm", ns, {"replicas": 1, "autotune": {"enabled": False}}))
        await cluster.wait_for(kube.DEPLOYMENTS, ns, "llm")
        with injected(cluster, watch_errors):
            start = time.monotonic()
            cluster.emulator.drop_watches()
            await asyncio.sleep(4.0)  # re-watching fails meanwhile
            end = time.monotonic()
        rate = calls_per_s(cluster, start, end)
        await cluster.patch(kube.POLICIES, ns, "llm", {"spec": {"replicas": 3}})
        await cluster.wait_for(kube.DEPLOYMENTS, ns, "llm",
                               lambda d: d["spec"]["replicas"] == 3, timeout=DEADLINE_S)
        recovered = time.monotonic() - end
        operator.check()
    assert rate < HOT_LOOP_CALLS_PER_S
    report("watch streams dropped, re-watch 500 for 4 s", calls_per_s=rate,
           failed_watches=watch_errors.hits, change_applied_after_s=recovered)


async def test_conflicts_while_applying_a_decision_never_apply_it_twice(
    cluster: Cluster,
) -> None:
    ns = "conflicts"
    conflict = Fault(409, verbs=frozenset({"patch"}), resources=frozenset({"configmaps"}),
                     times=2)
    cluster.emulator.faults.append(conflict)
    try:
        async with tuned_world(cluster, ns) as world:
            start = time.monotonic()
            await grown(world)
            took = time.monotonic() - start
            await next_round(world, "a round after the decision")
            failed = await cluster.wait_for_condition(ns, "llm", "Tuning", "True",
                                                      timeout=DEADLINE_S)
            await wait_events(cluster, ns, "Tuned")
            reported = await wait_events(cluster, ns, "TuningRoundFailed")
    finally:
        cluster.emulator.faults.remove(conflict)
    assert conflict.hits == 2
    assert world.pod.applied == [DECIDED_PUT]
    assert len(await events(cluster, ns, "Tuned")) == 1
    assert "409" in reported[0]["message"], reported
    assert failed["reason"] == "Enabled"
    report("API 409 on the ConfigMap patch, twice", decision_in_force_after_s=took,
           tuned_events=1, pod_puts=len(world.pod.applied))
