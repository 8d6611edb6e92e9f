"""A policy's pods and Service played locally: real `batchpilot serve` processes as the pods.

The emulator stores a policy's Deployment but runs nothing. `LocalFleet` does
for one policy what the Deployment controller, the kubelet and the Service do
in a cluster, with real servers as the pods:

    async with LocalFleet(cluster, tmp_path, "ns", "llm") as fleet:
        ... once a pod is ready, load on fleet.targets (the Service's endpoints);
        ... fleet.gate.clear() keeps new pods unready

- it follows the Deployment's `spec.replicas`. A new pod is a server process
  started from the policy's ConfigMap (the `--config-file` a pod mounts) and
  its admin Secret, registered as a Pod at once and marked Ready once its
  `/readyz` answers and `gate` is open;
- a scale-in takes the newest pod away as Kubernetes does: the Pod leaves the
  endpoints (and the tuner's list of ready pods) first, then its server gets
  SIGTERM and drains what it holds;
- the Deployment's `status.replicas` and `readyReplicas` follow, as its
  controller's would (reconcile copies them into the policy's status);
- `targets` are the Service's endpoints: the ready pods, which a load sends
  to in turn (loadgen's `Targets`, which may change while the load runs).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp
from batchpilot_operator import builders, kube
from batchpilot_tools.loadgen import Targets

from tests.support.k8s_emulator import Cluster
from tests.support.servers import ServerProcess, spawn_server

POLL_S = 0.5  # how often the fleet looks at the Deployment and its starting pods
READY_PROBE_TIMEOUT_S = 2.0


@dataclass
class LocalPod:
    name: str
    server: ServerProcess
    stack: contextlib.ExitStack  # the server's spawn_server context
    ready: bool = False


class LocalFleet:
    """The pods of one policy's Deployment, and its Service; see the module docstring."""

    def __init__(self, cluster: Cluster, tmp_path: Path, namespace: str, policy: str) -> None:
        self.cluster = cluster
        self.tmp_path = tmp_path
        self.namespace = namespace
        self.policy = policy
        self.pods: list[LocalPod] = []
        self.exit_codes: list[int] = []  # of the servers a scale-in stopped, in order
        self.gate = asyncio.Event()  # cleared: new pods start but are not marked Ready
        self.gate.set()
        self._endpoints: Targets | None = None  # from the first ready pod on
        self._names = itertools.count()
        self._reported: dict[str, int] = {}
        self._follower: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    @property
    def ready(self) -> list[LocalPod]:
        return [pod for pod in self.pods if pod.ready]

    @property
    def targets(self) -> Targets:
        """The ready pods' URLs, for a load; there are some once a pod was ready."""
        assert self._endpoints is not None, "no pod has been ready yet"
        return self._endpoints

    async def __aenter__(self) -> LocalFleet:
        self._session = aiohttp.ClientSession()
        self._follower = asyncio.create_task(self._follow(), name=f"fleet {self.policy}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._follower is not None and self._session is not None
        self._follower.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._follower  # a follower that crashed raises its error here
        for pod in self.pods:
            pod.stack.close()
        await self._session.close()

    def check(self) -> None:
        """Raise what stopped the follower, if it stopped."""
        if self._follower is not None and self._follower.done():
            self._follower.result()

    async def _follow(self) -> None:
        while True:
            deployment = await self.cluster.get(kube.DEPLOYMENTS, self.namespace, self.policy)
            desired = int(deployment["spec"].get("replicas") or 0) if deployment else 0
            if len(self.pods) < desired:
                await self._start_pod(deployment or {})
            elif len(self.pods) > desired:
                await self._stop_pod(self.pods[-1])
            await self._mark_ready()
            if deployment is not None:
                await self._report()
            await asyncio.sleep(POLL_S)

    async def _start_pod(self, deployment: dict[str, Any]) -> None:
        """A server started as the pod template says: the mode from its args, the knobs from
        the ConfigMap in force, the token from the Secret."""
        name = f"{self.policy}-{next(self._names)}"
        config_file = self.tmp_path / f"{name}-batching.json"
        config_map = await self.cluster.get(
            kube.CONFIGMAPS, self.namespace, builders.config_map_name(self.policy)
        )
        assert config_map is not None, "a Deployment without its ConfigMap"
        config_file.write_text(config_map["data"][builders.CONFIG_KEY])
        secret = await self.cluster.get(
            kube.SECRETS, self.namespace, builders.secret_name(self.policy)
        )
        assert secret is not None, "a Deployment without its admin Secret"
        token = base64.b64decode(secret["data"][builders.TOKEN_KEY]).decode()
        args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
        stack = contextlib.ExitStack()
        server = stack.enter_context(spawn_server(
            tmp_path=self.tmp_path, mode=args[args.index("--mode") + 1], admin_token=token,
            extra_args=["--config-file", str(config_file)], wait=False,
        ))  # fmt: skip
        self.pods.append(LocalPod(name, server, stack))
        await self.cluster.add_server_pod(
            self.namespace, self.policy, name, "127.0.0.1", server.port, ready=False
        )

    async def _mark_ready(self) -> None:
        if not self.gate.is_set():
            return
        for pod in self.pods:
            if not pod.ready and await self._answers_ready(pod):
                await self.cluster.patch(
                    kube.PODS, self.namespace, pod.name,
                    {"status": {"conditions": [{"type": "Ready", "status": "True"}]}}, "status",
                )  # fmt: skip
                pod.ready = True
                if self._endpoints is None:
                    self._endpoints = Targets([pod.server.url])
                else:
                    self._endpoints.add(pod.server.url)

    async def _answers_ready(self, pod: LocalPod) -> bool:
        if pod.server.proc.poll() is not None:
            raise RuntimeError(
                f"pod {pod.name}'s server exited with {pod.server.proc.returncode}:\n"
                f"{pod.server.stderr_tail()}"
            )
        assert self._session is not None
        try:
            async with self._session.get(
                f"{pod.server.url}/readyz",
                timeout=aiohttp.ClientTimeout(total=READY_PROBE_TIMEOUT_S),
            ) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _stop_pod(self, pod: LocalPod) -> None:
        """Out of the endpoints first, then SIGTERM: the server finishes what it holds."""
        if self._endpoints is not None:
            self._endpoints.remove(pod.server.url)
        pod.ready = False
        await self.cluster.delete(kube.PODS, self.namespace, pod.name)
        self.exit_codes.append(await asyncio.to_thread(pod.server.terminate))
        pod.stack.close()
        self.pods.remove(pod)

    async def _report(self) -> None:
        status = {"replicas": len(self.pods), "readyReplicas": len(self.ready)}
        if status != self._reported:
            await self.cluster.patch(
                kube.DEPLOYMENTS, self.namespace, self.policy, {"status": status}, "status"
            )
            self._reported = status
