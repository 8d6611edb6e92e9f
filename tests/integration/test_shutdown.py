"""A short shutdown grace with many long requests in flight: when it runs out, every
request gets an answer (a 503, or a stream's final error event and `[DONE]`) and
the process exits within the grace plus the margin `batchpilot serve --help` states.
A real `batchpilot serve` (tiny) and real HTTP clients."""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from batchpilot_operator import builders
from batchpilot_operator.spec import parse_spec
from batchpilot_server import metric_names as names
from batchpilot_server.serve_options import EXIT_MARGIN_S, parser

from tests.support.policies import policy_object
from tests.support.servers import scrape, spawn_server, stream_events

pytestmark = pytest.mark.timeout(180)

GRACE_S = 2.0
BATCH = 8
REQUESTS = 48  # six waves of 900 tokens: thousands of steps, far more than the grace
MAX_TOKENS = 900


@dataclass
class Answer:
    stream: bool
    status: int = 0  # 0: no HTTP status at all
    body: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any] | str] = field(default_factory=list)
    lost: str = ""  # the client error when the connection broke without an answer


async def ask(session: aiohttp.ClientSession, url: str, n: int, stream: bool) -> Answer:
    body = {"prompt": f"request {n}", "max_tokens": MAX_TOKENS, "ignore_eos": True}
    answer = Answer(stream)
    try:
        async with session.post(f"{url}/v1/completions", json={**body, "stream": stream}) as r:
            answer.status = r.status
            if stream and r.status == 200:
                answer.events = await stream_events(r)
            else:
                answer.body = await r.json()
    except aiohttp.ClientError as exc:
        answer.lost = repr(exc)
    return answer


async def until_all_admitted(session: aiohttp.ClientSession, url: str) -> None:
    async with asyncio.timeout(30):
        while True:
            metrics = await scrape(session, url)
            running = metrics[(names.REQUESTS_RUNNING, "")]
            if running == BATCH and running + metrics[(names.REQUESTS_WAITING, "")] == REQUESTS:
                return
            await asyncio.sleep(0.02)


def is_shutdown_error(error: Any) -> bool:
    return (
        isinstance(error, dict)
        and error.get("type") == "service_unavailable_error"
        and error.get("code") == "shutting_down"
        and "grace period of 2 s ran out" in error.get("message", "")
    )


async def test_when_the_grace_runs_out_every_request_gets_an_answer(tmp_path: Path) -> None:
    extra = ["--shutdown-grace-s", str(GRACE_S)]
    with spawn_server(tmp_path=tmp_path, max_batch_size=BATCH, extra_args=extra) as srv:
        timeout = aiohttp.ClientTimeout(total=120)
        connector = aiohttp.TCPConnector(limit=REQUESTS + 8)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            tasks = [
                asyncio.create_task(ask(session, srv.url, n, stream=n % 2 == 0))
                for n in range(REQUESTS)
            ]
            await until_all_admitted(session, srv.url)

            srv.proc.send_signal(signal.SIGTERM)
            exited = asyncio.create_task(asyncio.to_thread(srv.proc.wait, 60))
            answers = await asyncio.gather(*tasks)
            exit_code = await exited
    lost = [a.lost for a in answers if a.lost or a.status == 0]
    assert not lost, f"{len(lost)} requests got no answer: {lost[:3]}"
    streams = [a for a in answers if a.stream and a.status == 200]
    for answer in streams:
        assert answer.events[-1] == "[DONE]"
    cut = [a for a in streams if "error" in a.events[-2]]
    refused = [a for a in answers if a.status == 503]
    plain_done = [a for a in answers if not a.stream and a.status == 200]
    # the running streams: an error event after their tokens, then [DONE]
    assert cut and all(is_shutdown_error(a.events[-2]["error"]) for a in cut)  # type: ignore[index]
    assert all(len(a.events) > 2 for a in cut)
    # the waiting requests, and the running ones that do not stream: a 503 each
    assert len(refused) >= REQUESTS - 2 * BATCH
    assert all(is_shutdown_error(a.body.get("error")) for a in refused)
    assert all(a.body["usage"]["completion_tokens"] == MAX_TOKENS for a in plain_done)
    finished = [a for a in streams if a not in cut]
    assert all(a.events[-2]["choices"][0]["finish_reason"] == "length" for a in finished)  # type: ignore[index]
    assert len(cut) + len(refused) + len(plain_done) + len(finished) == REQUESTS
    assert exit_code == 0
    # Timed by the server's own log, from the drain's start to its last line: on a loaded
    # machine the interpreter's exit and this test's wait for it stretch, not the drain.
    log = srv.stderr_path.read_text()
    assert logged_at(log, "draining:") + GRACE_S + EXIT_MARGIN_S >= logged_at(log, "stopped"), log


def logged_at(log: str, words: str) -> float:
    """The time stamp (seconds) of the server's first log line that holds `words`."""
    line = next((line for line in log.splitlines() if words in line), None)
    assert line is not None, f"no log line with {words!r}:\n{log}"
    stamp = datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    return stamp.timestamp()


def test_the_pod_outlives_its_servers_shutdown() -> None:
    """The kubelet kills a pod terminationGracePeriodSeconds after its termination
    began, preStop pause included: the server's grace and exit margin must fit in
    what is left, or a rolling update cuts requests without a word."""
    body = policy_object("llm", "team", {}, uid="u-1")
    pod = builders.build_deployment(body, parse_spec(body["spec"]))["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    _, pause = container["lifecycle"]["preStop"]["exec"]["command"]  # sleep N
    assert container["args"][0] == "serve"
    grace = parser().parse_args(container["args"][1:]).shutdown_grace_s
    assert float(pause) + grace + EXIT_MARGIN_S < pod["terminationGracePeriodSeconds"]
