"""Live batching config over `GET`/`PUT /admin/batching`, with bearer-token auth."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from batchpilot_server import metric_names as names

from tests.support.servers import complete, scrape, serve_in_process, spawn_server

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
    ("test-token", {"max_batch_size": 2000}, 400, "invalid_value"),
    ("test-token", {"max_batch_size": "4"}, 400, "invalid_type"),
    ("test-token", {"max_batch_size": None}, 400, "invalid_type"),
    ("test-token", {"max_batch_size": 4.0}, 400, "invalid_type"),
    ("test-token", {"batch_timeout_ms": -1}, 400, "invalid_value"),
    ("test-token", {"max_queue_size": 0}, 400, "invalid_value"),
    ("test-token", {"max_batch": 4}, 400, "unknown_field"),
    ("test-token", {}, 400, "invalid_value"),
    ("test-token", [4], 400, "invalid_type"),
    ("test-token", {"prefill_token_budget": 0}, 400, "invalid_value"),
    ("test-token", {"prefill_token_budget": 16.0}, 400, "invalid_type"),
    ("test-token", {"slo": {"ttft_ms": 0}}, 400, "invalid_value"),
    ("test-token", {"slo": {"tpot_ms": -5}}, 400, "invalid_value"),
    ("test-token", {"slo": {"e2e_ms": "1s"}}, 400, "invalid_type"),
    ("test-token", {"slo": {"ttft": 100}}, 400, "unknown_field"),
    ("test-token", {"slo": 100}, 400, "invalid_type"),
]
# the field each bad value's answer names (`param`), where it names one
BAD_PARAMS = {
    "prefill_token_budget": "prefill_token_budget",
    "slo": "slo",
}
DEFAULT_STATE = {
    "max_batch_size": 8, "batch_timeout_ms": 10, "max_queue_size": 256,
    "prefill_token_budget": 2048, "num_speculative_tokens": 0,
    "slo": {"ttft_ms": None, "tpot_ms": None, "e2e_ms": None, "classes": []},
    "mode": "continuous", "version": 1,
}  # fmt: skip


async def test_bad_admin_requests_are_refused_and_change_nothing() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        seen = []
        for token, body, _, _ in BAD_PUTS:
            status, answer = await put(session, server.url, body, token)
            assert answer["error"]["message"]
            seen.append((status, answer["error"]["code"]))
            if isinstance(body, dict) and status == 400 and (field := next(iter(body), None)):
                # the answer names the field at fault: `slo.ttft_ms` within `slo`
                assert (answer["error"]["param"] or "").startswith(BAD_PARAMS.get(field, field))
        async with session.get(f"{server.url}/admin/batching") as response:
            config = await response.json()
    assert seen == [(status, code) for _, _, status, code in BAD_PUTS]
    assert config == DEFAULT_STATE


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
    state = {**DEFAULT_STATE, "mode": mode}
    assert first == (200, {**state, "max_batch_size": 2, "version": 2})
    assert second == (
        200,
        {**state, "max_batch_size": 2, "batch_timeout_ms": 25, "max_queue_size": 64, "version": 3},
    )
    assert [status for status, _, _ in answers] == [200] * 24
    assert all(body["usage"]["completion_tokens"] == 24 for _, body, _ in answers)
    assert metrics[(names.CONFIG_MAX_BATCH_SIZE, "")] == 2
    assert metrics[(names.CONFIG_BATCH_TIMEOUT, "")] == pytest.approx(0.025)
    assert metrics[(names.REQUESTS_TOTAL, "ok")] == 24


async def _until_running(session: aiohttp.ClientSession, url: str, deadline_s: float = 20) -> None:
    async with asyncio.timeout(deadline_s):
        while (await scrape(session, url))[(names.REQUESTS_RUNNING, "")] == 0:
            await asyncio.sleep(0.01)


def mount_secret(directory: Path, version: str, token: str) -> Path:
    """Write `token` the way the kubelet updates a mounted Secret: a new timestamped
    folder, then one atomic rename of the `..data` link; `token` links through it."""
    (directory / version).mkdir(parents=True)
    (directory / version / "token").write_text(token)
    (directory / "..data_tmp").symlink_to(version)
    os.replace(directory / "..data_tmp", directory / "..data")
    link = directory / "token"
    if not link.is_symlink():
        link.symlink_to("..data/token")
    return link


async def test_a_rotated_token_file_takes_effect_without_a_restart(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    token_file = mount_secret(secret, "..2026_11_29_a", "first-token")
    with spawn_server(
        tmp_path=tmp_path, admin_token=None, extra_args=["--admin-token-file", str(token_file)]
    ) as server:
        async with aiohttp.ClientSession() as session:
            assert (await put(session, server.url, {"max_batch_size": 4}, "first-token"))[0] == 200
            mount_secret(secret, "..2026_11_29_b", "second-token\n")
            status, answer = await put(session, server.url, {"max_batch_size": 5}, "first-token")
            assert (status, answer["error"]["code"]) == (403, "invalid_token")
            assert (await put(session, server.url, {"max_batch_size": 6}, "second-token"))[0] == 200
            # an emptied file locks nobody out: the last good token stays
            mount_secret(secret, "..2026_11_29_c", "")
            status, answer = await put(session, server.url, {"max_batch_size": 7}, "second-token")
    assert status == 200 and answer["max_batch_size"] == 7
    log = server.stderr_path.read_text()
    assert "changed: using the new token" in log
    assert "is empty; keeping the previous token" in log
    assert "first-token" not in log and "second-token" not in log
