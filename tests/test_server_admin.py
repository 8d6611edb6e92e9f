"""Live batching config over `GET`/`PUT /admin/batching`, with bearer-token auth."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from batchpilot_server import metric_names as names

from tests.servers import complete, scrape, serve_in_process

pytestmark = pytest.mark.timeout(60)


async def put(
    session: aiohttp.ClientSession, url: str, body: Any, token: str | None
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    async with session.put(f"{url}/admin/batching", json=body, headers=headers) as response:
        return response.status, await response.json()


BAD_PUTS: list[tuple[str | None, Any, int, str]] = [
    (None, {"max_batch_size": 4}, 401, "missing_token"),
    ("wrong-token", {"max_batch_size": 4}, 403, "invalid_token"),
    ("test-token", {"max_batch_size": 0}, 400, "invalid_value"),
    ("test-token", {"max_batch_size": "4"}, 400, "invalid_value"),
    ("test-token", {"batch_timeout_ms": -1}, 400, "invalid_value"),
    ("test-token", {"max_queue_size": 0}, 400, "invalid_value"),
    ("test-token", {"max_batch": 4}, 400, "invalid_value"),
    ("test-token", [4], 400, "invalid_value"),
]


async def test_bad_admin_requests_are_refused_and_change_nothing() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        seen = []
        for token, body, _, _ in BAD_PUTS:
            status, answer = await put(session, server.url, body, token)
            assert answer["error"]["message"]
            seen.append((status, answer["error"]["code"]))
        async with session.get(f"{server.url}/admin/batching") as response:
            config = await response.json()
    assert seen == [(status, code) for _, _, status, code in BAD_PUTS]
    assert config == {
        "max_batch_size": 8, "batch_timeout_ms": 10, "max_queue_size": 256,
        "mode": "continuous", "version": 1,
    }  # fmt: skip


async def test_put_is_refused_when_no_token_is_configured() -> None:
    async with serve_in_process(admin_token=None) as server, aiohttp.ClientSession() as session:
        status, answer = await put(session, server.url, {"max_batch_size": 4}, "anything")
    assert status == 403
    assert answer["error"]["code"] == "admin_disabled"
    assert "--admin-token-file" in answer["error"]["message"]


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
async def test_live_put_changes_batching_while_requests_run(mode: str) -> None:
    async with (
        serve_in_process(mode=mode, max_batch_size=8) as server,
        aiohttp.ClientSession() as session,
    ):
        running = [
            asyncio.create_task(
                complete(session, server.url, prompt=f"p{i}", max_tokens=24, ignore_eos=True)
            )
            for i in range(24)
        ]
        await _until_running(session, server.url)
        first = await put(session, server.url, {"max_batch_size": 2}, server.token)
        second = await put(
            session, server.url, {"batch_timeout_ms": 25, "max_queue_size": 64}, server.token
        )
        answers = await asyncio.gather(*running)
        metrics = await scrape(session, server.url)
    assert first == (200, {"max_batch_size": 2, "batch_timeout_ms": 10, "max_queue_size": 256,
                           "mode": mode, "version": 2})  # fmt: skip
    assert second == (200, {"max_batch_size": 2, "batch_timeout_ms": 25, "max_queue_size": 64,
                            "mode": mode, "version": 3})  # fmt: skip
    assert [status for status, _, _ in answers] == [200] * 24
    assert all(body["usage"]["completion_tokens"] == 24 for _, body, _ in answers)
    assert metrics[(names.CONFIG_MAX_BATCH_SIZE, "")] == 2
    assert metrics[(names.CONFIG_BATCH_TIMEOUT, "")] == pytest.approx(0.025)
    assert metrics[(names.REQUESTS_TOTAL, "ok")] == 24


async def _until_running(session: aiohttp.ClientSession, url: str, deadline_s: float = 20) -> None:
    async with asyncio.timeout(deadline_s):
        while (await scrape(session, url))[(names.REQUESTS_RUNNING, "")] == 0:
            await asyncio.sleep(0.01)
