"""The processes the demo starts, and stopping every one of them, in order, whatever happens."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
from batchpilot_tools.demo.options import INITIAL, NAMESPACE, POLICY
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


def start_server(
    name: str, model: str, workdir: Path, token_file: Path, config_file: Path | None = None
) -> ServerProcess:
    """A server starting with the demo's poor config, or with `config_file`'s where given
    (the config of record: what a pod reads from its policy's ConfigMap)."""
    port = free_port()
    log_path = workdir / f"{name}.log"
    # -P: `-m` would put the working directory first on sys.path, and run from a clone's
    # root (after `pip install .`) its `operator/` folder would shadow the standard library's.
    command = [
        sys.executable, "-P", "-m", "batchpilot_server.cli", "serve",
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
    if config_file is not None:
        command += ["--config-file", str(config_file)]
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


def demo_scrape_config(servers: Sequence[ServerProcess], exporter: str) -> dict[str, Any]:
    """Prometheus scraping these servers, labelled as the operator's pods would be, and
    the policy exporter."""
    targets = [f"127.0.0.1:{server.port}" for server in servers]
    return scrape_config(
        [*targets, exporter],
        scrape_interval="1s",
        target_labels={
            target: {"namespace": NAMESPACE, "policy": POLICY, "pod": server.name}
            for target, server in zip(targets, servers, strict=True)
        },
    )


@contextlib.contextmanager
def prometheus_running(
    workdir: Path, servers: Sequence[ServerProcess], exporter: str
) -> Iterator[LocalPrometheus]:
    with LocalPrometheus(workdir / "prometheus", demo_scrape_config(servers, exporter)) as prom:
        yield prom


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
