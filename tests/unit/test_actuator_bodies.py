"""What the actuator sends a server older than some tuned fields: the ones it knows."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from batchpilot_operator.actuators import TUNED_FIELDS, put_batching
from batchpilot_operator.tuning_loop import Applied
from batchpilot_server.batching_config import BatchingConfig

from tests.support.servers import fake_server

SPECULATING = BatchingConfig(num_speculative_tokens=2)


@asynccontextmanager
async def older_server(known: set[str], bodies: list[dict[str, Any]]) -> AsyncIterator[str]:
    """PUT /admin/batching that refuses the first unknown field as the server does
    (OpenAI's error shape, code unknown_field), and records every body it was sent."""

    async def put(request: web.Request) -> web.Response:
        body = await request.json()
        bodies.append(body)
        unknown = sorted(set(body) - known)
        if unknown:
            error = {"message": f"unknown field {unknown[0]}", "code": "unknown_field",
                     "param": unknown[0]}  # fmt: skip
            return web.json_response({"error": error}, status=400)
        return web.json_response({"version": len(bodies)})

    async with fake_server("PUT", "/admin/batching", put) as url:
        yield url


@pytest.mark.parametrize(
    "known",
    [
        set(TUNED_FIELDS),
        set(TUNED_FIELDS) - {"num_speculative_tokens"},
        # before the LLM SLO: it names k first, then the budget or the SLO
        {"max_batch_size", "batch_timeout_ms"},
    ],
    ids=["today", "before-speculation", "before-the-llm-slo"],
)
async def test_a_server_gets_the_fields_it_knows(known: set[str]) -> None:
    bodies: list[dict[str, Any]] = []
    async with older_server(known, bodies) as url, aiohttp.ClientSession() as session:
        result = await put_batching(session, url, "token", SPECULATING, "pod")
    assert isinstance(result, Applied)
    assert set(bodies[-1]) == known
    assert bodies[0]["num_speculative_tokens"] == 2  # tried first with everything


async def test_k_of_zero_is_sent_so_a_speculating_server_turns_it_off() -> None:
    bodies: list[dict[str, Any]] = []
    async with older_server(set(TUNED_FIELDS), bodies) as url, aiohttp.ClientSession() as session:
        await put_batching(session, url, None, BatchingConfig(), "pod")
    (body,) = bodies
    assert set(body) == set(TUNED_FIELDS) and body["num_speculative_tokens"] == 0
