"""The replica rule in a cluster, for real: Kopf against the emulator, pods that are real servers.

`LocalFleet` plays the policy's Deployment and Service: it starts a real
`batchpilot serve` for each replica the Deployment asks for (from the
ConfigMap in force), and spreads the load over the ready ones. The loads are
chosen far from the edges, so that no outcome hangs on this machine's speed:
the high one is as many clients as a pod's queue holds, each sending again as
soon as it is answered, so the queue stays full (far past the SLO) at any
speed without overflowing; the low one keeps a batch of one mostly idle.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from batchpilot_operator import builders, kube
from batchpilot_operator.actuators import get_batching
from batchpilot_tools.loadgen import LengthDist, LoadSpec, RequestResult, Targets, run_load

from tests.support.fleet import LocalFleet
from tests.support.k8s_emulator import Cluster, condition, run_cluster, run_operator
from tests.support.policies import policy_object
from tests.support.servers import START_DEADLINE_S, wait_ready

INTERVAL_S = 5  # the CRD's minimum
# Long enough that a window holds the 50 finished requests a judgement needs, even at a
# batch of one on a busy machine.
WINDOW_S = 4 * INTERVAL_S
MAX_BATCH = 2  # small, so that the knobs are spent within a round or two
SLO_MS = 1000
QUEUE = 128  # a full queue waits several times the SLO even on an idle machine
HIGH_CLIENTS, HIGH_TOKENS = QUEUE, 8  # closed loop: the queue full, never overflowing
LOW_RATE, LOW_TOKENS = 5.0, 4  # enough finished requests for every window, little work
# One more round on a loaded machine, where an API call can take a tenth of a second.
ROUND_DEADLINE_S = 9 * INTERVAL_S
SCALE_DEADLINE_S = 150.0  # rounds until the knobs are spent or a window is quiet for long
LOAD_LIMIT_S = 600.0  # the loads run until the test stops them
SCALE_WRITE = "batchingpolicies/scale"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running:
        yield running


@pytest.fixture
async def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The test's namespace; its policies are deleted afterwards, so that the next test's
    operator does not resume their tuning loops beside its own."""
    yield request.node.name.removeprefix("test_").replace("_", "-")[:40].rstrip("-")
    await cluster.delete_policies()


def autoscaled_policy(namespace: str, name: str = "llm", **autoscale: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "replicas": 1,
        "server": {"image": "batchpilot:test"},
        "batching": {
            "mode": "continuous",
            "maxBatchSize": {"initial": 1, "min": 1, "max": MAX_BATCH},
            # Pinned: the batch is the only knob, so a quiet window holds the knobs.
            "batchTimeoutMs": {"initial": 0, "min": 0, "max": 0},
            "maxQueueSize": QUEUE,
        },
        "slo": {"p99LatencyMs": SLO_MS},
        "autotune": {"intervalSeconds": INTERVAL_S, "windowSeconds": WINDOW_S},
    }
    if autoscale:
        spec["autoscale"] = autoscale
    return policy_object(name, namespace, spec)


def high_load(targets: Targets) -> LoadSpec:
    return LoadSpec(
        urls=list(targets.urls), arrival="concurrency", concurrency=HIGH_CLIENTS,
        duration_s=LOAD_LIMIT_S, stream=False, output_len=LengthDist("fixed", HIGH_TOKENS),
    )  # fmt: skip


def low_load(targets: Targets) -> LoadSpec:
    return LoadSpec(
        urls=list(targets.urls), rate=LOW_RATE, duration_s=LOAD_LIMIT_S, stream=False,
        output_len=LengthDist("fixed", LOW_TOKENS),
    )  # fmt: skip


@contextlib.asynccontextmanager
async def running(spec: LoadSpec, targets: Targets) -> AsyncIterator[list[RequestResult]]:
    """`spec` sent to `targets` until the block ends; the finished requests, as they end."""
    results: list[RequestResult] = []
    task = asyncio.create_task(run_load(spec, on_result=results.append, targets=targets))
    try:
        yield results
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def status_of(policy: dict[str, Any]) -> dict[str, Any]:
    return dict(policy.get("status") or {})


def autoscaling(policy: dict[str, Any]) -> dict[str, Any]:
    found = condition(policy, "Autoscaling")
    assert found is not None, status_of(policy)
    return found


def is_scaled(event: dict[str, Any]) -> bool:
    return event["reason"] == "Scaled" and event["type"] == "Normal"


async def scaled_events(cluster: Cluster, namespace: str, name: str = "llm") -> list[str]:
    """The Scaled Events posted so far: for asserting that none came."""
    return [e["message"] for e in await cluster.events_for(namespace, name) if is_scaled(e)]


async def wait_scaled_events(cluster: Cluster, namespace: str, count: int) -> list[str]:
    """The Scaled Events of `namespace`/llm once `count` have come (each follows the
    status change it reports)."""
    events = await cluster.wait_for_events(
        namespace, "llm", is_scaled, f"{count} Scaled Event(s)", ROUND_DEADLINE_S, count
    )
    return [e["message"] for e in events]


def scale_writes_by_operator(cluster: Cluster, namespace: str) -> list[str]:
    return [
        c.user_agent for c in cluster.emulator.calls
        if c.from_operator and c.namespace == namespace and c.resource == SCALE_WRITE
    ]  # fmt: skip


def fleet_of(
    fleet: LocalFleet, ready: int, pods: int | None = None
) -> Callable[[], Awaitable[bool]]:
    """A probe: `ready` pods ready, of `pods` in all (any number when None)."""

    async def probe() -> bool:
        fleet.check()
        return len(fleet.ready) == ready and pods in (None, len(fleet.pods))

    return probe


async def next_round(
    cluster: Cluster, namespace: str, after: dict[str, Any], what: str, name: str = "llm"
) -> dict[str, Any]:
    """The policy once a round decided after the one `after` shows."""
    seen = (status_of(after).get("lastDecision") or {}).get("time", "")

    def later(policy: dict[str, Any]) -> bool:
        return (status_of(policy).get("lastDecision") or {}).get("time", "") > seen

    return await cluster.wait_for(kube.POLICIES, namespace, name, later, what, ROUND_DEADLINE_S)


async def test_scales_out_once_the_batch_is_spent_resumes_after_a_restart_and_scales_in(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    ns = namespace
    policy = autoscaled_policy(
        ns, minReplicas=1, maxReplicas=2, scaleDownStabilizationSeconds=INTERVAL_S
    )
    async with (
        LocalFleet(cluster, tmp_path, ns, "llm") as fleet,
        contextlib.AsyncExitStack() as high,
    ):
        with run_operator(cluster):
            await cluster.create(kube.POLICIES, policy)
            await cluster.wait_until(fleet_of(fleet, 1), "llm-0 ready", START_DEADLINE_S)
            await high.enter_async_context(running(high_load(fleet.targets), fleet.targets))
            fleet.gate.clear()  # the pod a scale-out adds stays unready until the restart is done
            out = await cluster.wait_for(
                kube.POLICIES, ns, "llm", lambda p: "lastScaling" in status_of(p),
                "a scale-out", SCALE_DEADLINE_S,
            )  # fmt: skip
            # The config in force is reconcile's key, not the round's record: waited for.
            shown, _ = await cluster.wait_for_in_force(ns, "llm", SCALE_DEADLINE_S)
            await wait_scaled_events(cluster, ns, 1)
        stopped = await cluster.get(kube.POLICIES, ns, "llm")
        assert stopped is not None
        last = status_of(out)["lastScaling"]
        assert (last["action"], last["from"], last["to"]) == ("scale_out", 1, 2), last
        # Knobs first: the batch reached its bound before the pod count moved.
        assert status_of(shown)["maxBatchSize"] == MAX_BATCH
        assert "the batch is spent" in last["reason"], last
        assert out["spec"]["replicas"] == 2
        assert autoscaling(out)["status"] == "True" and autoscaling(out)["reason"] == "Enabled"
        (event,) = await scaled_events(cluster, ns)
        assert event == last["reason"]
        resumed_from = status_of(stopped)["replicaState"]

        # A new operator, while the new pod is still unready: it resumes from status, and
        # holds instead of stepping again.
        with run_operator(cluster):
            seen = stopped
            for round_ in range(2):
                seen = await next_round(cluster, ns, seen, f"round {round_ + 1} after the restart")
                assert seen["spec"]["replicas"] == 2
                assert "1 of 2 pods ready" in autoscaling(seen)["message"], seen
            assert status_of(seen)["replicaState"]["lastChange"] == resumed_from["lastChange"]
            assert status_of(seen)["replicaState"]["since"] == resumed_from["since"]
            assert len(await scaled_events(cluster, ns)) == 1

            # Not Ready, so never pushed to: what it runs is what it read at start.
            (_, new_pod) = fleet.pods
            await asyncio.to_thread(wait_ready, new_pod.server)
            async with aiohttp.ClientSession() as session:
                started = await get_batching(session, new_pod.server.url)
            assert started.max_batch_size == MAX_BATCH  # the tuned batch, not the initial 1
            fleet.gate.set()
            await cluster.wait_until(fleet_of(fleet, 2), "llm-1 ready", START_DEADLINE_S)

            def both_ready(p: dict[str, Any]) -> bool:
                return "pods ready" not in autoscaling(p)["message"]

            covered = await cluster.wait_for(
                kube.POLICIES, ns, "llm", both_ready, "a round that counts both pods ready",
                ROUND_DEADLINE_S,
            )  # fmt: skip
            assert covered["spec"]["replicas"] == 2
            await high.aclose()

            async with running(low_load(fleet.targets), fleet.targets) as low:
                scaled_in = await cluster.wait_for(
                    kube.POLICIES, ns, "llm",
                    lambda p: status_of(p)["lastScaling"]["action"] == "scale_in",
                    "a scale-in", SCALE_DEADLINE_S,
                )  # fmt: skip
                # while the operator runs: it posts the Event after the status it reports
                await wait_scaled_events(cluster, ns, 2)
                await cluster.wait_until(
                    fleet_of(fleet, 1, pods=1), "llm-1 drained and gone", START_DEADLINE_S
                )
                steady = scaled_in
                for round_ in range(2):
                    steady = await next_round(cluster, ns, steady, f"round {round_ + 1} at 1 pod")
                    assert steady["spec"]["replicas"] == 1  # minReplicas: never below
        last = status_of(scaled_in)["lastScaling"]
        assert (last["action"], last["from"], last["to"]) == ("scale_in", 2, 1), last
        assert "1 pod(s)" in last["reason"], last  # the choice's or the headroom row's count
        assert fleet.exit_codes == [0]  # the drained server exited cleanly
    assert low and [r.error for r in low if not r.ok] == []
    assert len(await scaled_events(cluster, ns)) == 2


async def test_kubectl_scale_writes_through_the_scale_subresource_and_the_operator_follows(
    cluster: Cluster, namespace: str
) -> None:
    ns = namespace
    scale_path = kube.POLICIES.path(ns, "llm", "scale")
    with run_operator(cluster):
        await cluster.create(kube.POLICIES, autoscaled_policy(ns, minReplicas=1, maxReplicas=2))
        await cluster.create(kube.POLICIES, autoscaled_policy(ns, name="fixed"))
        first = await cluster.wait_for_condition(
            ns, "llm", "Autoscaling", "True", "Enabled", ROUND_DEADLINE_S
        )
        assert "0 of 1 pods ready" in first["message"]
        status, scale = await cluster.request("GET", scale_path)
        assert status == 200 and scale["kind"] == "Scale" and scale["spec"]["replicas"] == 1
        assert scale["status"]["selector"] == kube.label_selector(builders.selector_labels("llm"))

        # kubectl scale bp/llm --replicas=2: the count of record the operator continues from.
        before = await cluster.get(kube.POLICIES, ns, "llm")
        assert before is not None
        await cluster.patch(kube.POLICIES, ns, "llm", {"spec": {"replicas": 2}}, "scale")
        await cluster.wait_for(
            kube.DEPLOYMENTS, ns, "llm", lambda d: d["spec"]["replicas"] == 2,
            "the Deployment to follow spec.replicas",
        )  # fmt: skip
        following = await next_round(cluster, ns, before, "a round after kubectl scale")
        following = await next_round(cluster, ns, following, "a round that read the new count")
        assert following["spec"]["replicas"] == 2
        assert following["metadata"]["generation"] > before["metadata"]["generation"]
        assert "0 of 2 pods ready" in autoscaling(following)["message"], following

        # Beyond autoscale's bounds, the operator brings it back, through /scale as well.
        await cluster.patch(kube.POLICIES, ns, "llm", {"spec": {"replicas": 5}}, "scale")
        back = await cluster.wait_for(
            kube.POLICIES, ns, "llm", lambda p: "lastScaling" in status_of(p),
            "the operator's answer to 5 replicas", ROUND_DEADLINE_S,
        )  # fmt: skip
        answered = await wait_scaled_events(cluster, ns, 1)
        not_configured = await cluster.wait_for_condition(
            ns, "fixed", "Autoscaling", "False", "NotConfigured", ROUND_DEADLINE_S
        )
    last = status_of(back)["lastScaling"]
    assert (last["action"], last["from"], last["to"]) == ("scale_in", 5, 2), last
    assert "outside autoscale's 1..2" in last["reason"]
    assert back["spec"]["replicas"] == 2
    assert scale_writes_by_operator(cluster, ns), "the operator wrote through /scale"
    assert answered == [last["reason"]]
    assert "batching is still tuned" in not_configured["message"]
    assert await scaled_events(cluster, ns, "fixed") == []


async def test_an_hpa_owns_the_count_the_operator_stands_back_and_still_tunes(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    ns = namespace
    hpa = {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "llm-hpa", "namespace": ns},
        "spec": {
            "scaleTargetRef": {
                "apiVersion": f"{builders.GROUP}/{builders.VERSION}",
                "kind": builders.KIND,
                "name": "llm",
            },
            "minReplicas": 1,
            "maxReplicas": 3,
        },
    }
    await cluster.create(kube.HORIZONTAL_POD_AUTOSCALERS, hpa)
    async with LocalFleet(cluster, tmp_path, ns, "llm") as fleet:
        with run_operator(cluster):
            await cluster.create(kube.POLICIES, autoscaled_policy(ns, maxReplicas=3))
            await cluster.wait_until(fleet_of(fleet, 1), "llm-0 ready", START_DEADLINE_S)
            async with running(high_load(fleet.targets), fleet.targets):
                spent = await cluster.wait_for(
                    kube.POLICIES, ns, "llm",
                    lambda p: status_of(p).get("maxBatchSize") == MAX_BATCH,
                    "the batch tuned to its bound", SCALE_DEADLINE_S,
                )  # fmt: skip
                # The round that spent the knobs is where the rule would scale out on its
                # own (the first test); one more round under the same load.
                after = await next_round(cluster, ns, spent, "a round with the knobs spent")
    found = autoscaling(after)
    assert (found["status"], found["reason"]) == ("False", "ExternallyScaled")
    assert "HorizontalPodAutoscaler llm-hpa" in found["message"]
    assert after["spec"]["replicas"] == 1
    assert scale_writes_by_operator(cluster, ns) == []
    assert await scaled_events(cluster, ns) == []
    assert status_of(after)["history"][0]["action"] == "grow_batch"
    assert "lastScaling" not in status_of(after)
