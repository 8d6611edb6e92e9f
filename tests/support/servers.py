"""Real servers for tests: `batchpilot serve` subprocesses, or the same app in-process.

with spawn_server(tmp_path=tmp_path, mode="dynamic") as server:
    ... HTTP to server.url; server.token is the admin token
async with serve_in_process(mode="dynamic") as server:   # faster: no process start
    ... HTTP to server.url; server.app is the aiohttp app
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine_api import EngineOptions
from batchpilot_server.http.app import build_app
from batchpilot_server.http.protocol import Limits
from batchpilot_server.http.server_state import ClassKey
from batchpilot_tools.prometheus_local import free_port
from prometheus_client.parser import text_string_to_metric_families

START_DEADLINE_S = 60.0
STOP_DEADLINE_S = 15.0
STDERR_TAIL_LINES = 40


@dataclass
class ServerProcess:
    url: str  # http://127.0.0.1:<port>, no trailing slash
    port: int
    token: str | None  # admin bearer token; None when started without one
    proc: subprocess.Popen[bytes]
    stderr_path: Path

    def stderr_tail(self, lines: int = STDERR_TAIL_LINES) -> str:
        text = self.stderr_path.read_text(errors="replace") if self.stderr_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def terminate(self, timeout_s: float = STOP_DEADLINE_S) -> int:
        """SIGTERM, wait for the exit code; SIGKILL if it does not exit in time."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def serve_command(
    *,
    port: int,
    mode: str,
    max_batch_size: int,
    batch_timeout_ms: float,
    max_queue_size: int,
    kv_cache_mb: float | None,
    token_file: Path | None,
    extra_args: Sequence[str],
) -> list[str]:
    cmd = [
        sys.executable, "-m", "batchpilot_server.cli", "serve",
        "--model", "tiny",
        "--mode", mode,
        "--max-batch-size", str(max_batch_size),
        "--batch-timeout-ms", str(batch_timeout_ms),
        "--max-queue-size", str(max_queue_size),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--device", "cpu",
    ]  # fmt: skip
    if kv_cache_mb is not None:
        cmd += ["--kv-cache-mb", str(kv_cache_mb)]
    if token_file is not None:
        cmd += ["--admin-token-file", str(token_file)]
    if "--threads" not in extra_args:
        # One torch thread: the tests, the server and the client share two cores.
        cmd += ["--threads", "1"]
    return [*cmd, *extra_args]


def wait_ready(server: ServerProcess, deadline_s: float = START_DEADLINE_S) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {server.proc.returncode} before it was ready:\n"
                f"{server.stderr_tail()}"
            )
        try:
            with urllib.request.urlopen(f"{server.url}/readyz", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.1)  # poll interval while the model loads
    raise TimeoutError(f"server not ready after {deadline_s:g}s:\n{server.stderr_tail()}")


@contextlib.contextmanager
def spawn_server(
    *,
    tmp_path: Path,
    mode: str = "continuous",
    max_batch_size: int = 8,
    batch_timeout_ms: float = 10,
    max_queue_size: int = 256,
    kv_cache_mb: float | None = None,
    admin_token: str | None = "test-token",
    extra_args: Sequence[str] = (),
    wait: bool = True,
) -> Iterator[ServerProcess]:
    """A `batchpilot serve` subprocess on a free port; killed on exit, also on failure.

    With `wait=False` it yields at once (for tests of start-up failures).
    """
    port = free_port()
    token_file = None
    if admin_token is not None:
        token_file = tmp_path / f"admin-token-{port}"
        token_file.write_text(admin_token + "\n")
    stderr_path = tmp_path / f"serve-{port}.stderr"
    cmd = serve_command(
        port=port,
        mode=mode,
        max_batch_size=max_batch_size,
        batch_timeout_ms=batch_timeout_ms,
        max_queue_size=max_queue_size,
        kv_cache_mb=kv_cache_mb,
        token_file=token_file,
        extra_args=extra_args,
    )
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with stderr_path.open("wb") as stderr:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    server = ServerProcess(f"http://127.0.0.1:{port}", port, admin_token, proc, stderr_path)
    ok = False
    try:
        if wait:
            wait_ready(server)
        yield server
        ok = True
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if not ok:
            print(f"--- stderr of {' '.join(cmd)}:\n{server.stderr_tail()}", file=sys.stderr)


@dataclass
class InProcessServer:
    url: str
    token: str | None
    app: web.Application


@contextlib.asynccontextmanager
async def serve_in_process(
    *,
    mode: str = "continuous",
    max_batch_size: int = 8,
    batch_timeout_ms: float = 10,
    max_queue_size: int = 256,
    kv_cache_mb: float = 16,
    admin_token: str | None = "test-token",
    threads: int = 1,
    api_key: str | None = None,
    class_keys: tuple[ClassKey, ...] = (),
    chat_template: str | None = None,
    model: str = "tiny",
    dtype: str = "auto",
    **limits: float,
) -> AsyncIterator[InProcessServer]:
    """The real app and engine on a free port of this test's event loop.

    Keyword arguments beyond the named ones set `Limits` fields (e.g. queue_timeout_s).
    """
    options = EngineOptions(
        mode=mode,  # type: ignore[arg-type]
        model=model,
        config=BatchingConfig(max_batch_size, batch_timeout_ms, max_queue_size),
        device="cpu",
        kv_cache_mb=kv_cache_mb,
        threads=threads,
        dtype=dtype,  # type: ignore[arg-type]
    )
    limits_ = dataclasses.replace(Limits(), **limits)
    app = build_app(
        options,
        admin_token=admin_token,
        limits=limits_,
        api_key=api_key,
        class_keys=class_keys,
        chat_template=chat_template,
    )
    server = TestServer(app, host="127.0.0.1")  # binds a free port itself
    await server.start_server()
    try:
        yield InProcessServer(str(server.make_url("")).rstrip("/"), admin_token, app)
    finally:
        await server.close()


@contextlib.asynccontextmanager
async def fake_server(
    method: str,
    path: str,
    handler: Any,  # an aiohttp handler
) -> AsyncIterator[str]:
    """A stand-in server that answers `method path` with `handler`, on a free port of
    this test's event loop: what a client sends, seen from the other end."""
    app = web.Application()
    app.router.add_route(method, path, handler)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@contextlib.contextmanager
def serve_on_thread(**options: Any) -> Iterator[str]:
    """`serve_in_process(**options)` on an event loop of its own thread, so that a
    synchronous client (schemathesis, hypothesis) can drive it. Yields its URL."""
    started = threading.Event()
    state: dict[str, Any] = {}

    async def run() -> None:
        async with serve_in_process(**options) as server:
            state["url"], state["stop"] = server.url, asyncio.Event()
            state["loop"] = asyncio.get_running_loop()
            started.set()
            await state["stop"].wait()

    thread = threading.Thread(target=asyncio.run, args=(run(),), name="server-on-thread")
    thread.start()
    if not started.wait(START_DEADLINE_S):
        raise TimeoutError(f"the server did not start in {START_DEADLINE_S:g} s")
    try:
        yield state["url"]
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        thread.join(START_DEADLINE_S)


# --- HTTP helpers ------------------------------------------------------------


async def complete(
    session: aiohttp.ClientSession, url: str, **body: Any
) -> tuple[int, dict[str, Any], Mapping[str, str]]:
    """POST /v1/completions (not streamed): status, JSON body, headers."""
    async with session.post(f"{url}/v1/completions", json=body) as response:
        return response.status, await response.json(), response.headers


async def stream_events(response: aiohttp.ClientResponse) -> list[dict[str, Any] | str]:
    """Every SSE `data:` payload of a streamed completion; "[DONE]" stays a string."""
    events: list[dict[str, Any] | str] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """/metrics as {(sample name, outcome label or ""): value}."""
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" in sample.labels:
                continue
            samples[(sample.name, sample.labels.get("outcome", ""))] = sample.value
    return samples


async def labelled(
    session: aiohttp.ClientSession, url: str, sample: str, *labels: str
) -> dict[tuple[str, ...], float]:
    """One sample name's series on /metrics as {(its values of `labels`): value}."""
    async with session.get(f"{url}/metrics") as response:
        assert response.status == 200
        text = await response.text()
    return {
        tuple(s.labels.get(label, "") for label in labels): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == sample
    }
