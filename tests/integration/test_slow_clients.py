"""Slow, idle and too many clients against a real `batchpilot serve`, over raw sockets.

The server runs with small limits so that each rule shows within seconds:
a read deadline (headers and body), an idle keep-alive timeout longer than
it (so that the two cannot be mistaken for each other), and a connection cap.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator

import pytest

from tests.support.servers import ServerProcess, spawn_server

READ_TIMEOUT_S = 1.5
KEEPALIVE_TIMEOUT_S = 4.0
MAX_CONNECTIONS = 6
# A loaded machine may be late by this much to close or answer.
SLACK_S = 2.0

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    flags = [
        "--http-read-timeout-s", str(READ_TIMEOUT_S),
        "--http-keepalive-timeout-s", str(KEEPALIVE_TIMEOUT_S),
        "--max-connections", str(MAX_CONNECTIONS),
    ]  # fmt: skip
    with spawn_server(tmp_path=tmp_path_factory.mktemp("slow"), extra_args=flags) as running:
        yield running


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def connect(server: ServerProcess) -> Connection:
    return await asyncio.open_connection("127.0.0.1", server.port)


async def closed_after(reader: asyncio.StreamReader, within_s: float) -> tuple[bytes, float]:
    """Everything the server sent until it closed, and how long that took;
    fails when the connection is still open after `within_s`."""
    start = time.monotonic()
    received = b""
    try:
        async with asyncio.timeout(within_s):
            while chunk := await reader.read(65536):
                received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"the server kept the connection open for {within_s:g} s")
    return received, time.monotonic() - start


async def healthz(server: ServerProcess, connection: Connection | None = None) -> bytes:
    """One keep-alive GET /healthz (on `connection`, else a new one); its status line."""
    reader, writer = connection or await connect(server)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    await writer.drain()
    async with asyncio.timeout(SLACK_S * 5):
        status = await reader.readline()
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.lower() == "content-length":
                length = int(value)
        await reader.readexactly(length)
    return status.strip()


def split_response(raw: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in lines)}
    return status, headers, body


async def test_headers_sent_one_byte_at_a_time_are_cut_off_at_the_read_deadline(
    server: ServerProcess,
) -> None:
    request = b"GET /healthz HTTP/1.1\r\nHost: test\r\nX-Slow: " + b"a" * 1000
    clients = [await connect(server) for _ in range(3)]

    async def trickle(writer: asyncio.StreamWriter) -> None:
        for byte in request:
            writer.write(bytes([byte]))
            await asyncio.sleep(READ_TIMEOUT_S / 10)

    tricklers = [asyncio.create_task(trickle(writer)) for _, writer in clients]
    try:
        results = await asyncio.gather(
            *(closed_after(reader, READ_TIMEOUT_S + SLACK_S) for reader, _ in clients)
        )
    finally:
        for task in tricklers:
            task.cancel()
        await asyncio.gather(*tricklers, return_exceptions=True)
    for received, took in results:
        assert received == b""  # no request was complete: nothing to answer
        assert took >= READ_TIMEOUT_S * 0.9
    assert await healthz(server) == b"HTTP/1.1 200 OK"


async def test_a_body_shorter_than_its_content_length_gets_408_then_the_connection_closes(
    server: ServerProcess,
) -> None:
    reader, writer = await connect(server)
    partial = b'{"prompt": "hel'
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n" + partial
    )
    await writer.drain()
    received, took = await closed_after(reader, READ_TIMEOUT_S + SLACK_S)
    status, headers, body = split_response(received)
    assert status == "HTTP/1.1 408 Request Timeout"
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert (error["type"], error["code"]) == ("invalid_request_error", "request_timeout")
    assert f"{READ_TIMEOUT_S:g} s" in error["message"]
    assert took <= READ_TIMEOUT_S + SLACK_S


async def test_a_body_that_arrives_slowly_but_in_time_is_served(server: ServerProcess) -> None:
    reader, writer = await connect(server)
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
    )
    for piece in (body[:5], body[5:]):
        writer.write(piece)
        await writer.drain()
        await asyncio.sleep(READ_TIMEOUT_S / 4)
    received, _ = await closed_after(reader, SLACK_S * 5)
    status, _, answer = split_response(received)
    assert status == "HTTP/1.1 200 OK", answer
    assert json.loads(answer)["usage"]["completion_tokens"] == 1


async def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout(
    server: ServerProcess,
) -> None:
    connection = await connect(server)
    assert await healthz(server, connection) == b"HTTP/1.1 200 OK"
    # Idle for less than the timeout: the connection is still there to reuse.
    await asyncio.sleep(KEEPALIVE_TIMEOUT_S / 2)
    assert await healthz(server, connection) == b"HTTP/1.1 200 OK"
    received, took = await closed_after(connection[0], KEEPALIVE_TIMEOUT_S + SLACK_S)
    assert received == b""
    assert took >= KEEPALIVE_TIMEOUT_S * 0.9


async def test_idle_connections_beyond_the_cap_make_way_for_new_clients(
    server: ServerProcess,
) -> None:
    hoarded = [await connect(server) for _ in range(MAX_CONNECTIONS)]
    for _, writer in hoarded:  # each started a request, none will finish it
        writer.write(b"GET /healthz HTTP/1.1\r\n")
    await asyncio.gather(*(writer.drain() for _, writer in hoarded))
    for _ in range(3):  # every new client gets in, each time the oldest hoarder goes
        assert await healthz(server) == b"HTTP/1.1 200 OK"
    received, _ = await closed_after(hoarded[0][0], SLACK_S)  # the first one made way
    assert received == b""
    for _, writer in hoarded:
        writer.close()


async def test_when_every_connection_is_busy_a_new_one_is_refused_until_one_frees(
    server: ServerProcess,
) -> None:
    busy = [await connect(server) for _ in range(MAX_CONNECTIONS)]
    for _, writer in busy:  # a request in progress on each: its body is still to come
        writer.write(b"PUT /admin/batching HTTP/1.1\r\nHost: t\r\nContent-Length: 10\r\n\r\n{")
    await asyncio.gather(*(writer.drain() for _, writer in busy))
    await asyncio.sleep(READ_TIMEOUT_S / 3)  # every request has reached the app
    refused, writer = await connect(server)
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: test\r\n\r\n")
    received, took = await closed_after(refused, SLACK_S)
    assert received == b"" and took < READ_TIMEOUT_S
    # The stalled bodies time out with 408; then the server answers again.
    answers = await asyncio.gather(
        *(closed_after(reader, READ_TIMEOUT_S + SLACK_S) for reader, _ in busy)
    )
    assert all(raw.startswith(b"HTTP/1.1 408 ") for raw, _ in answers)
    assert await healthz(server) == b"HTTP/1.1 200 OK"
