"""Scheduling by SLO class over real HTTP to a real server: with the batch full of
low-priority work and more of it queued, a high-priority request that arrives last is
served first once a slot frees, in both modes; meanwhile /metrics counts the waiting
requests by class. Orders and counts, not timings, are asserted."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import aiohttp
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.http.slo_class import OBJECTIVE_HEADER

from tests.support.servers import labelled, scrape, serve_in_process

pytestmark = pytest.mark.timeout(120)

ADMIN = "test-token"
CLASSES = [
    {"name": "chat", "priority": 10, "ttft_ms": 60_000.0},
    {"name": "batch", "priority": -5, "e2e_ms": 600_000.0},
]
LONG = 96  # tokens a batch request decodes: it holds the one slot for that many steps
FIRST_IDS = itertools.count(101)  # prompts of their own: no prefix-cache sharing


async def until(
    session: aiohttp.ClientSession,
    url: str,
    sample: str,
    value: float,
    tasks: list[asyncio.Task[None]],
) -> None:
    """Polls /metrics until `sample` reads `value` (the request states the test needs)."""
    for _ in range(2000):
        if (await scrape(session, url)).get((sample, "")) == value:
            return
        for task in tasks:
            if task.done():
                task.result()  # a request that failed: its error, not a timeout
        await asyncio.sleep(0.005)
    raise AssertionError(f"{sample} never reached {value}")


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
async def test_a_later_high_priority_request_is_served_before_queued_low_ones(mode: str) -> None:
    done: list[str] = []

    async def post(session: aiohttp.ClientSession, url: str, name: str, objective: str) -> None:
        body: dict[str, Any] = {
            "prompt": [next(FIRST_IDS), 7, 7, 7],
            "max_tokens": LONG if objective == "batch" else 4,
            "ignore_eos": True,
        }
        headers = {OBJECTIVE_HEADER: objective}
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as answer:
            assert answer.status == 200, await answer.text()
        done.append(name)

    async with (
        serve_in_process(mode=mode, max_batch_size=1, admin_token=ADMIN) as server,
        aiohttp.ClientSession() as session,
    ):
        url = server.url
        put = {"slo": {"tpot_ms": 60_000.0, "classes": CLASSES}}
        auth = {"Authorization": f"Bearer {ADMIN}"}
        async with session.put(f"{url}/admin/batching", json=put, headers=auth) as answer:
            assert answer.status == 200, await answer.text()
        tasks = [asyncio.create_task(post(session, url, "batch-0", "batch"))]
        await until(session, url, names.REQUESTS_RUNNING, 1, tasks)  # the one slot taken
        for n in (1, 2):
            tasks.append(asyncio.create_task(post(session, url, f"batch-{n}", "batch")))
            await until(session, url, names.REQUESTS_WAITING, n, tasks)
        tasks.append(asyncio.create_task(post(session, url, "chat", "chat")))
        await until(session, url, names.REQUESTS_WAITING, 3, tasks)
        waiting = await labelled(session, url, names.REQUESTS_WAITING_BY_CLASS, names.CLASS_LABEL)
        await asyncio.gather(*tasks)
        after = await labelled(session, url, names.REQUESTS_WAITING_BY_CLASS, names.CLASS_LABEL)
    # chat arrived last, behind two queued batch requests, and took the first free slot
    assert done == ["batch-0", "chat", "batch-1", "batch-2"]
    # while batch-0 held the slot: two batch requests and chat waited (the default class
    # and, once served, every class read 0)
    assert waiting == {("default",): 0, ("chat",): 1, ("batch",): 2}
    assert after == {("default",): 0, ("chat",): 0, ("batch",): 0}
