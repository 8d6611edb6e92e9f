"""Overload and abandonment: full queue, missed deadlines, clients that go away."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.http.server_state import STATE

from tests.support.servers import complete, scrape, serve_in_process

pytestmark = pytest.mark.timeout(60)


async def test_full_queue_answers_429_with_retry_after_and_admitted_requests_complete() -> None:
    async with (
        serve_in_process(max_batch_size=1, max_queue_size=2) as server,
        aiohttp.ClientSession() as session,
    ):
        answers = await asyncio.gather(
            *(
                complete(session, server.url, prompt=f"{i}", max_tokens=48, ignore_eos=True)
                for i in range(16)
            )
        )
        metrics = await scrape(session, server.url)
    rejected = [(body, headers) for status, body, headers in answers if status == 429]
    served = [body for status, body, _ in answers if status == 200]
    assert len(rejected) + len(served) == 16
    assert rejected and served
    for body, headers in rejected:
        assert int(headers["Retry-After"]) >= 1
        assert body["error"]["type"] == "rate_limit_error"
        assert "queue is full" in body["error"]["message"]
    assert all(body["usage"]["completion_tokens"] == 48 for body in served)
    assert metrics[(names.REQUESTS_TOTAL, "rejected")] == len(rejected)
    assert metrics[(names.REQUESTS_TOTAL, "ok")] == len(served)


async def _first_token(response: aiohttp.ClientResponse) -> None:
    async for raw in response.content:
        if raw.startswith(b"data: "):
            return


@pytest.mark.parametrize("stream", [False, True])
async def test_request_waiting_past_its_deadline_gets_504(stream: bool) -> None:
    async with (
        serve_in_process(max_batch_size=1, queue_timeout_s=0.1) as server,
        aiohttp.ClientSession() as session,
    ):
        long = server.app[STATE].engine.max_model_len - 8
        hog = {"prompt": "hog", "max_tokens": long, "ignore_eos": True, "stream": True}
        async with session.post(f"{server.url}/v1/completions", json=hog) as running:
            await _first_token(running)  # the only batch slot is now taken
            late = {"prompt": "late", "max_tokens": 4, "stream": stream}
            async with session.post(f"{server.url}/v1/completions", json=late) as response:
                status, headers = response.status, response.headers
                error = json.loads(await response.read())["error"]
            running.close()
        metrics = await scrape(session, server.url)
    assert status == 504
    assert int(headers["Retry-After"]) >= 1
    assert (error["type"], error["code"]) == ("timeout_error", "queue_timeout")
    assert "deadline of 0.1 s" in error["message"]
    assert metrics[(names.REQUESTS_TOTAL, "timeout")] == 1


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
async def test_client_disconnect_mid_stream_cancels_and_frees_kv(mode: str) -> None:
    async with serve_in_process(mode=mode) as server, aiohttp.ClientSession() as session:
        long = server.app[STATE].engine.max_model_len - 8
        body = {"prompt": "bye", "max_tokens": long, "ignore_eos": True, "stream": True}
        response = await session.post(f"{server.url}/v1/completions", json=body)
        for _ in range(3):
            await _first_token(response)
        assert (await scrape(session, server.url))[(names.KV_CACHE_USAGE, "")] > 0
        response.close()  # drops the connection mid-stream
        async with asyncio.timeout(20):
            while True:
                metrics = await scrape(session, server.url)
                if (
                    metrics[(names.REQUESTS_TOTAL, "error")] == 1
                    and metrics[(names.REQUESTS_RUNNING, "")] == 0
                    and metrics[(names.KV_CACHE_USAGE, "")] == 0
                ):
                    break
                await asyncio.sleep(0.02)
        stats = server.app[STATE].engine.stats()
    assert stats.kv_blocks_used == 0
    # Cancelled, not finished: far fewer tokens than asked were generated.
    assert metrics[(names.GENERATION_TOKENS_TOTAL, "")] < long
