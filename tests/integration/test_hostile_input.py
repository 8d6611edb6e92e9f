"""Hostile but well-formed HTTP: every class of input that once reached a 500.

Each answer must be a 4xx in OpenAI's error shape naming the field at fault,
and the server must stay healthy afterwards. The bodies are written as raw
JSON text: Python's own json module cannot even write some of them (an
integer of 5000 digits) and the point is to send exactly these bytes.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import zlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from tests.support.servers import InProcessServer, serve_in_process

pytestmark = pytest.mark.timeout(120)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
ADMIN = "/admin/batching"
TOKEN = "test-token"

HUGE = "9" * 5000  # beyond Python's 4300-digit int/str conversion limit
USER = [{"role": "user", "content": "hi"}]


def with_raw(body: dict[str, Any], field_path: str, raw: str) -> bytes:
    """`body` as JSON with the value at `field_path` (dots, list indexes) replaced by `raw` text."""
    marker = "\x00RAW\x00"
    target: Any = body
    *parents, last = _parse_path(field_path)
    for part in parents:
        target = target[part]
    target[last] = marker
    return json.dumps(body).replace(json.dumps(marker), raw).encode()


def _parse_path(path: str) -> list[str | int]:
    parts: list[str | int] = []
    for piece in path.replace("[", ".[").split("."):
        parts.append(int(piece[1:-1]) if piece.startswith("[") else piece)
    return parts


def completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}


async def send(
    session: aiohttp.ClientSession,
    server: InProcessServer,
    path: str,
    body: bytes,
    *,
    method: str = "POST",
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **(headers or {})}
    if path == ADMIN:
        headers.setdefault("Authorization", f"Bearer {TOKEN}")
    async with session.request(method, server.url + path, data=body, headers=headers) as response:
        return response.status, await response.json()


def assert_error(status: int, answer: dict[str, Any], expected_status: int, param: str | None):
    assert status == expected_status, answer
    assert set(answer) == {"error"}
    error = answer["error"]
    assert set(error) == {"message", "type", "code", "param"}
    assert error["message"] and error["type"] and error["code"]
    assert error["param"] == param, error


async def assert_healthy(session: aiohttp.ClientSession, server: InProcessServer) -> None:
    async with session.get(f"{server.url}/healthz") as response:
        assert response.status == 200
    status, answer = await send(session, server, COMPLETIONS, json.dumps(completion()).encode())
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1


@pytest.fixture
async def server() -> AsyncIterator[InProcessServer]:
    async with serve_in_process(admin_token=TOKEN) as server:
        yield server


# (path, JSON body, field path whose value is replaced by a huge integer, param named)
HUGE_INTEGERS: list[tuple[str, dict[str, Any], str]] = [
    (COMPLETIONS, completion(), "max_tokens"),
    (COMPLETIONS, completion(), "seed"),
    (COMPLETIONS, completion(prompt=[1, 2, 3]), "prompt[1]"),
    (COMPLETIONS, completion(), "n"),
    (COMPLETIONS, completion(), "temperature"),
    (COMPLETIONS, completion(), "top_p"),
    (COMPLETIONS, completion(), "logprobs"),
    (COMPLETIONS, completion(), "best_of"),
    (COMPLETIONS, completion(), "min_tokens"),
    (COMPLETIONS, completion(), "min_p"),
    (COMPLETIONS, completion(), "repetition_penalty"),
    (COMPLETIONS, completion(), "frequency_penalty"),
    (COMPLETIONS, completion(stop_token_ids=[1]), "stop_token_ids[0]"),
    (COMPLETIONS, completion(logit_bias={"5": 1}), "logit_bias.5"),
    (CHAT, chat(), "max_tokens"),
    (CHAT, chat(), "max_completion_tokens"),
    (CHAT, chat(), "seed"),
    (CHAT, chat(), "temperature"),
    (CHAT, chat(logprobs=True), "top_logprobs"),
    (CHAT, chat(), "n"),
    (CHAT, chat(), "presence_penalty"),
    (ADMIN, {"max_batch_size": 4}, "max_batch_size"),
    (ADMIN, {"batch_timeout_ms": 4}, "batch_timeout_ms"),
    (ADMIN, {"max_queue_size": 4}, "max_queue_size"),
]


@pytest.mark.parametrize("sign", ["", "-"])
async def test_integers_with_thousands_of_digits_are_400_naming_the_field(
    server: InProcessServer, sign: str
) -> None:
    async with aiohttp.ClientSession() as session:
        for path, body, field in HUGE_INTEGERS:
            status, answer = await send(
                session, server, path, with_raw(body, field, sign + HUGE),
                method="PUT" if path == ADMIN else "POST",
            )  # fmt: skip
            assert_error(status, answer, 400, field)
        await assert_healthy(session, server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_seed_must_fit_the_64_bit_generator(server: InProcessServer, path: str) -> None:
    body = completion if path == COMPLETIONS else chat
    async with aiohttp.ClientSession() as session:
        for seed in (2**64, 2**100, -1, -(2**63) - 1):
            status, answer = await send(
                session, server, path, json.dumps(body(seed=seed)).encode()
            )
            assert_error(status, answer, 400, "seed")
        for seed in (0, 2**64 - 1):
            status, answer = await send(
                session, server, path, json.dumps(body(seed=seed, temperature=1.0)).encode()
            )
            assert status == 200, answer
        await assert_healthy(session, server)


DEEP = "[" * 5000 + "]" * 5000

# (path, JSON body, field whose value becomes DEEP or None for the whole body, param)
DEEP_NESTING: list[tuple[str, dict[str, Any] | None, str | None, str | None]] = [
    (COMPLETIONS, None, None, None),
    (COMPLETIONS, completion(), "prompt", "prompt"),
    (COMPLETIONS, completion(), "stop", "stop"),
    (COMPLETIONS, completion(), "stream_options", "stream_options"),
    (CHAT, None, None, None),
    (CHAT, chat(), "messages", "messages"),
    (CHAT, chat(), "messages[0].content", "messages"),
    (ADMIN, None, None, None),
    (ADMIN, {"max_batch_size": 4}, "max_batch_size", "max_batch_size"),
]


async def test_json_nested_thousands_deep_is_400(server: InProcessServer) -> None:
    async with aiohttp.ClientSession() as session:
        for path, body, field, param in DEEP_NESTING:
            raw = DEEP.encode() if body is None or field is None else with_raw(body, field, DEEP)
            method = "PUT" if path == ADMIN else "POST"
            status, answer = await send(session, server, path, raw, method=method)
            assert_error(status, answer, 400, param)
            assert "nested" in answer["error"]["message"]
        await assert_healthy(session, server)


LONE = "\ud800"

# (path, JSON body with a lone surrogate somewhere, param)
SURROGATES: list[tuple[str, dict[str, Any], str]] = [
    (COMPLETIONS, completion(prompt=LONE), "prompt"),
    (COMPLETIONS, completion(prompt=f"ok {LONE} ok", stream=True), "prompt"),
    (COMPLETIONS, completion(prompt="a\udfff"), "prompt"),
    (COMPLETIONS, completion(stop=LONE), "stop"),
    (COMPLETIONS, completion(stop=["x", LONE]), "stop[1]"),
    (COMPLETIONS, completion(model=LONE), "model"),
    (COMPLETIONS, completion(user=LONE), "user"),
    (CHAT, chat(messages=[{"role": "user", "content": LONE}]), "messages[0].content"),
    (CHAT, chat(messages=[{"role": "user", "content": LONE}], stream=True),
     "messages[0].content"),
    (CHAT, chat(messages=[*USER, {"role": "assistant", "content": [{"type": "text",
                                                                   "text": LONE}]}]),
     "messages[1].content[0].text"),
    (CHAT, chat(messages=[{"role": LONE, "content": "hi"}]), "messages[0].role"),
    (CHAT, chat(messages=[{"role": "user", "content": "hi", "name": LONE}]), "messages[0].name"),
    (CHAT, chat(model=LONE), "model"),
    (CHAT, chat(stop=[LONE]), "stop[0]"),
    (CHAT, chat(user=LONE), "user"),
    (ADMIN, {"max_batch_size": LONE}, "max_batch_size"),
]  # fmt: skip


async def test_lone_surrogates_in_any_string_are_400_naming_the_field(
    server: InProcessServer,
) -> None:
    async with aiohttp.ClientSession() as session:
        for path, body, param in SURROGATES:
            # json.dumps writes a lone surrogate as the escape \ud800, as a hostile client would
            raw = json.dumps(body).encode()
            method = "PUT" if path == ADMIN else "POST"
            status, answer = await send(session, server, path, raw, method=method)
            assert_error(status, answer, 400, param)
        await assert_healthy(session, server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, ADMIN])
async def test_a_field_named_by_a_lone_surrogate_is_400(
    server: InProcessServer, path: str
) -> None:
    body = {"max_batch_size": 4} if path == ADMIN else (completion() if path == COMPLETIONS
                                                         else chat())  # fmt: skip
    async with aiohttp.ClientSession() as session:
        method = "PUT" if path == ADMIN else "POST"
        raw = json.dumps({**body, LONE: 1}).encode()
        status, answer = await send(session, server, path, raw, method=method)
        assert_error(status, answer, 400, None)
        assert answer["error"]["code"] == "invalid_unicode"
        await assert_healthy(session, server)


async def raw_http(server: InProcessServer, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """One `Connection: close` request as exact bytes; the status, headers and body."""
    host, port = server.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status_line, *header_lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.split(": ", 1) for line in header_lines if line)
        headers = {name.lower(): value for name, value in headers.items()}
        body = await reader.read()  # up to the server's close
    finally:
        writer.close()
    return int(status_line.split()[1]), headers, body


@pytest.mark.parametrize(
    "authorization", [b"Bearer t\xe9st-token", "Bearer тест".encode(), b"Bearer \xff\xfe"]
)
async def test_authorization_header_bytes_that_are_not_ascii_are_refused_in_json(
    server: InProcessServer, authorization: bytes
) -> None:
    body = b'{"max_batch_size": 4}'
    request = (
        b"PUT /admin/batching HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        b"Content-Type: application/json\r\nAuthorization: " + authorization + b"\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    status, headers, raw = await raw_http(server, request)
    assert status in (401, 403)
    assert headers["content-type"].startswith("application/json")
    assert_error(status, json.loads(raw), status, None)
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}{ADMIN}") as response:
            assert (await response.json())["version"] == 1  # nothing changed
        await assert_healthy(session, server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, ADMIN])
@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
async def test_a_body_that_is_not_in_its_content_encoding_is_400(
    server: InProcessServer, path: str, encoding: str
) -> None:
    body = json.dumps({"max_batch_size": 4} if path == ADMIN else completion()).encode()
    async with aiohttp.ClientSession() as session:
        method = "PUT" if path == ADMIN else "POST"
        status, answer = await send(
            session, server, path, body, method=method, headers={"Content-Encoding": encoding}
        )
        assert_error(status, answer, 400, None)
        assert encoding in answer["error"]["message"]
        await assert_healthy(session, server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("method", ["HEAD", "GET", "PUT", "PATCH", "DELETE", "OPTIONS"])
async def test_other_methods_on_a_post_route_answer_405_in_the_error_shape(
    server: InProcessServer, path: str, method: str
) -> None:
    request = f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode()
    status, headers, body = await raw_http(server, request)
    assert status == 405
    assert headers["allow"] == "POST"
    assert headers["content-type"].startswith("application/json")
    if method != "HEAD":  # a HEAD answer has the headers of the answer, never its body
        assert_error(status, json.loads(body), 405, None)
        assert json.loads(body)["error"]["code"] == "method_not_allowed"


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "gzip, identity"])
async def test_a_body_in_its_content_encoding_is_read(server: InProcessServer, encoding: str):
    compress = gzip.compress if encoding.startswith("gzip") else zlib.compress
    async with aiohttp.ClientSession() as session:
        for path, body in [(COMPLETIONS, completion()), (CHAT, chat()),
                           (ADMIN, {"max_batch_size": 4})]:  # fmt: skip
            method = "PUT" if path == ADMIN else "POST"
            raw = compress(json.dumps(body).encode())
            status, answer = await send(
                session, server, path, raw, method=method, headers={"Content-Encoding": encoding}
            )
            assert status == 200, answer


async def test_unsupported_or_oversized_content_encodings_are_refused(
    server: InProcessServer,
) -> None:
    bomb = gzip.compress(json.dumps(completion(prompt="a" * (4 << 20))).encode())
    assert len(bomb) < 64 << 10  # small on the wire, four times the body limit unpacked
    async with aiohttp.ClientSession() as session:
        status, answer = await send(
            session, server, COMPLETIONS, b"...", headers={"Content-Encoding": "br"}
        )
        assert_error(status, answer, 415, None)
        assert answer["error"]["code"] == "unsupported_content_encoding"
        status, answer = await send(
            session, server, COMPLETIONS, bomb, headers={"Content-Encoding": "gzip"}
        )
        assert_error(status, answer, 413, None)
        assert answer["error"]["code"] == "body_too_large"
        await assert_healthy(session, server)


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
async def test_a_temperature_too_small_to_divide_by_samples_greedily(
    server: InProcessServer, path: str
) -> None:
    """Logits divided by 1e-38 overflow float32; the engine thread once died of it."""
    body = completion if path == COMPLETIONS else chat
    text_of = (lambda a: a["choices"][0]["text"]) if path == COMPLETIONS else (
        lambda a: a["choices"][0]["message"]["content"])  # fmt: skip
    async with aiohttp.ClientSession() as session:
        raw = json.dumps(body(max_tokens=8, temperature=0)).encode()
        greedy = await send(session, server, path, raw)
        for temperature in (1e-6, 1e-38, 5e-324):
            raw = json.dumps(body(max_tokens=8, temperature=temperature, seed=1)).encode()
            status, answer = await send(session, server, path, raw)
            assert status == 200, answer
            assert text_of(answer) == text_of(greedy[1])
        await assert_healthy(session, server)
