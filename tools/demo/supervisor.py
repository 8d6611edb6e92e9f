"""The processes the demo starts, and stopping every one of them, in order, whatever happens."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import aiohttp
from batchpilot_tools.demo.options import ADMIN_TOKEN, INITIAL, NAMESPACE, POLICY, SERVERS
from batchpilot_tools.prometheus_local import LocalPrometheus, free_port, scrape_config

STOP_TIMEOUT_S = 15.0
SHUTDOWN_GRACE_S = 3.0


class DemoError(RuntimeError):
    """Something the demo started did not come up; the message says what and why."""


class Stopped(Exception):
    """SIGINT or SIGTERM arrived while the demo was starting up."""


@dataclass
class ServerProcess:
    name: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def start_server(name: str, model: str, workdir: Path, token_file: Path) -> ServerProcess:
    port = free_port()
    log_path = workdir / f"{name}.log"
    command = [
        sys.executable, "-m", "batchpilot_server.cli", "serve",
        "--model", model, "--mode", "continuous", "--device", "cpu",
        "--host", "127.0.0.1", "--port", str(port),
        "--max-batch-size", str(INITIAL.max_batch_size),
        "--batch-timeout-ms", str(INITIAL.batch_timeout_ms),
        "--max-queue-size", str(INITIAL.max_queue_size),
        "--admin-token-file", str(token_file),
        # One torch thread each: two servers, the load and the tuner share the cores.
        "--threads", "1",
        # Ctrl-C should not wait long for requests the stopped load abandoned.
        "--shutdown-grace-s", str(SHUTDOWN_GRACE_S),
    ]  # fmt: skip
    with log_path.open("wb") as log:
        # Own session: a terminal's Ctrl-C reaches only the demo, which stops us in order.
        process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    return ServerProcess(name, port, process, log_path)


def stop_process(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
            return
        except subprocess.TimeoutExpired:
            process.kill()
    process.wait()


async def wait_ready(
    server: ServerProcess, session: aiohttp.ClientSession, timeout_s: float
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if server.process.poll() is not None:
            raise DemoError(
                f"{server.name} exited with {server.process.returncode} while starting:\n"
                f"{server.log_tail()}"
            )
        with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
            async with session.get(f"{server.url}/readyz") as response:
                if response.status == 200:
                    return
        if time.monotonic() > deadline:
            raise DemoError(
                f"{server.name} not ready after {timeout_s:.0f}s:\n"
                f"{server.log_tail()}"
            )
        await asyncio.sleep(0.2)


@contextlib.contextmanager
def servers_running(model: str, workdir: Path) -> Iterator[list[ServerProcess]]:
    token_file = workdir / "admin-token"
    token_file.write_text(ADMIN_TOKEN + "\n")
    servers: list[ServerProcess] = []
    try:
        for index in range(SERVERS):
            servers.append(start_server(f"server-{index}", model, workdir, token_file))
        yield servers
    finally:
        for server in servers:
            stop_process(server.process)


@contextlib.contextmanager
def prometheus_running(
    workdir: Path, servers: list[ServerProcess], exporter: str
) -> Iterator[LocalPrometheus]:
    targets = [f"127.0.0.1:{server.port}" for server in servers]
    config = scrape_config(
        [*targets, exporter],
        scrape_interval="1s",
        target_labels={
            target: {"namespace": NAMESPACE, "policy": POLICY, "pod": server.name}
            for target, server in zip(targets, servers, strict=True)
        },
    )
    with LocalPrometheus(workdir / "prometheus", config) as prometheus:
        yield prometheus


T = TypeVar("T")


async def unless_stopped(awaitable: Awaitable[T], stop: asyncio.Event) -> T:
    """Await `awaitable`, or raise Stopped (cancelling it) as soon as `stop` is set."""
    work = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if work in done:
        stopper.cancel()
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await work
    raise Stopped
