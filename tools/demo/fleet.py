"""The demo's servers as a fleet the replica rule scales: `batchpilot serve` processes.

`ProcessFleet` is the demo's `tune_local.LocalScaler`. A scale-out starts servers
from the config of record (the JSON file the local actuator keeps, read with
`--config-file`, as a pod reads its policy's ConfigMap); each takes load only
once it is ready and holds the config in force. A scale-in stops the newest
server the way Kubernetes retires a pod behind a Service: it leaves the load's
rotation and the tuner's targets first, answers what it was already sent, and
only then gets SIGTERM, on which it drains and exits. No request is lost.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
from batchpilot_operator.actuators import resync
from batchpilot_operator.pods import ReadyPod
from batchpilot_operator.policy.types import Fleet, ScaleDecision
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.demo.options import ADMIN_TOKEN
from batchpilot_tools.demo.supervisor import (
    DemoError,
    ServerProcess,
    start_server,
    stop_process,
    wait_ready,
)
from batchpilot_tools.demo.waste import SlotSteps, read_slot_steps
from batchpilot_tools.loadgen import Targets

# A retiring server first answers what it was sent; the demo's per-request timeout
# (run.py) bounds that wait, and SIGTERM's drain covers anything later.
UNANSWERED_WAIT_S = 60.0
HTTP_TIMEOUT_S = 3.0

OnChange = Callable[[list[ServerProcess]], Awaitable[None]]


class ProcessFleet:
    """Every server the demo started, which of them take load, and the count of record.

    Use as `async with ProcessFleet(...) as fleet: await fleet.start(n)`; leaving the
    block stops every process, whatever state it is in.
    """

    def __init__(self, model: str, workdir: Path, ready_timeout_s: float) -> None:
        self.model = model
        self.workdir = workdir
        self.ready_timeout_s = ready_timeout_s
        self.token_file = workdir / "admin-token"
        # The config of record: the local actuator writes it (TuneOptions.config_file).
        self.config_file = workdir / "batching.json"
        self.servers: list[ServerProcess] = []  # taking load, oldest first
        self.started: list[ServerProcess] = []  # every server started, for the last stop
        self.retired: dict[str, SlotSteps | None] = {}  # slot-steps read before each stop
        self.desired = 0
        # Called with the serving servers after each change (the demo's Prometheus
        # follows the fleet through it).
        self.on_change: OnChange | None = None
        self._load: Targets | None = None
        self._session: aiohttp.ClientSession | None = None
        self._moving: set[asyncio.Task[None]] = set()
        self._failure: BaseException | None = None

    async def __aenter__(self) -> ProcessFleet:
        self.token_file.write_text(ADMIN_TOKEN + "\n")
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S))
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        for task in self._moving:
            task.cancel()
        await asyncio.gather(*self._moving, return_exceptions=True)
        for server in self.started:
            stop_process(server.process)
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use the fleet as `async with ProcessFleet(...)`")
        return self._session

    @property
    def load(self) -> Targets:
        """The load generator's servers: the fleet adds and removes them."""
        if self._load is None:
            raise RuntimeError("the fleet has not started")
        return self._load

    async def start(self, replicas: int) -> None:
        """The first servers, at the demo's poor start config: the tuner's work."""
        self.desired = replicas
        first = [self._spawn(config_file=None) for _ in range(replicas)]
        await self._until_ready(first)
        self.servers = first
        self._load = Targets(self.serving())

    # -- tune_local.LocalScaler -----------------------------------------------------------

    async def fleet(self) -> Fleet:
        if self._failure is not None:
            raise self._failure
        return Fleet(desired=self.desired, ready=len(self.servers))

    async def scale(self, decision: ScaleDecision) -> None:
        """Record the count and start moving toward it; `fleet()` shows the progress."""
        change = decision.replicas - self.desired
        self.desired = decision.replicas
        if change > 0:
            self._in_background(self._grow(change))
        elif change < 0:
            leaving, self.servers = self.servers[change:], self.servers[:change]
            for server in leaving:
                self.load.remove(server.url)
            self._in_background(self._retire(leaving))

    def serving(self) -> list[str]:
        return [server.url for server in self.servers]

    # -- moving the fleet -----------------------------------------------------------------

    def _spawn(self, config_file: Path | None) -> ServerProcess:
        name = f"server-{len(self.started)}"
        server = start_server(name, self.model, self.workdir, self.token_file, config_file)
        self.started.append(server)
        return server

    async def _until_ready(self, servers: list[ServerProcess]) -> None:
        await asyncio.gather(
            *(wait_ready(server, self.session, self.ready_timeout_s) for server in servers)
        )

    async def _grow(self, count: int) -> None:
        joining = [self._spawn(config_file=self.config_file) for _ in range(count)]
        await self._until_ready(joining)
        for server in joining:
            await self._hold_config_in_force(server)
            self.servers.append(server)
            self.load.add(server.url)
        await self._changed()

    async def _hold_config_in_force(self, server: ServerProcess) -> None:
        """A knob change while the server started is pushed before it takes load."""
        record = BatchingConfig.from_file(self.config_file)
        report = await resync(
            self.session, [ReadyPod(server.name, server.url)], _admin_token, record
        )
        if report.refused:
            raise DemoError(f"{server.name} refused the config in force: {report.refusals()}")

    async def _retire(self, leaving: list[ServerProcess]) -> None:
        await self._changed()
        for server in leaving:
            await self.load.wait_unanswered(server.url, UNANSWERED_WAIT_S)
            # Its counters are final now; after the stop they are gone.
            self.retired[server.name] = await read_slot_steps(server, self.session)
            await asyncio.to_thread(stop_process, server.process)

    async def _changed(self) -> None:
        if self.on_change is not None:
            await self.on_change(list(self.servers))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._moving.add(task)
        task.add_done_callback(self._settled)

    def _settled(self, task: asyncio.Task[None]) -> None:
        self._moving.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The next round's `fleet()` raises it: the demo ends and says why.
            self._failure = task.exception()


async def _admin_token() -> str:
    return ADMIN_TOKEN

