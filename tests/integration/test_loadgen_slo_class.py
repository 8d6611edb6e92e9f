"""A load that names an SLO class, over real HTTP to a real server: its requests carry the
x-gateway-inference-objective header, are counted under that class on /metrics, and a
class the server does not know is a failed request (the server's 400), not a crash. A
load naming no class sends exactly what it sent before: no header."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp import web
from batchpilot_server import metric_names as names
from batchpilot_tools.loadgen import (
    OBJECTIVE_HEADER,
    LengthDist,
    LoadSpec,
    main,
    parser,
    run_load,
    spec_from_args,
)

from tests.support.servers import fake_server, labelled, serve_in_process

pytestmark = pytest.mark.timeout(90)

ADMIN = "test-token"
CLASSES = [
    {"name": "chat", "priority": 10, "ttft_ms": 60_000.0},
    {"name": "batch", "priority": -5, "e2e_ms": 600_000.0},
]


def spec(url: str, requests: int, objective: str | None) -> LoadSpec:
    return LoadSpec(
        urls=[url],
        arrival="concurrency",
        concurrency=2,
        num_requests=requests,
        prompt_len=LengthDist.parse("fixed:8"),
        output_len=LengthDist.parse("fixed:4"),
        objective=objective,
    )


def test_an_empty_objective_is_refused() -> None:
    with pytest.raises(ValueError, match="objective"):
        LoadSpec(urls=["http://x"], num_requests=1, objective=" ")


def test_the_cli_names_the_class_and_refuses_an_empty_one(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--url", "http://x", "--requests", "1"]
    assert spec_from_args(parser().parse_args([*argv, "--objective", "chat"])).objective == "chat"
    assert spec_from_args(parser().parse_args(argv)).objective is None
    assert main([*argv, "--objective", " "]) == 2
    assert "objective (SLO class) name must not be empty" in capsys.readouterr().err


async def test_requests_are_counted_under_the_class_they_name() -> None:
    async with (
        serve_in_process(admin_token=ADMIN) as server,
        aiohttp.ClientSession() as session,
    ):
        put = {"slo": {"e2e_ms": 600_000.0, "classes": CLASSES}}
        auth = {"Authorization": f"Bearer {ADMIN}"}
        async with session.put(f"{server.url}/admin/batching", json=put, headers=auth) as answer:
            assert answer.status == 200, await answer.text()
        reports = {
            objective: await run_load(spec(server.url, n, objective))
            for objective, n in (("chat", 5), ("batch", 3), (None, 2), ("gold", 2))
        }
        counted = await labelled(
            session, server.url, names.REQUESTS_SLO_TOTAL, names.CLASS_LABEL, "result", "target"
        )
    for objective, n in (("chat", 5), ("batch", 3), (None, 2)):
        report = reports[objective]
        assert (report.sent, report.ok, report.errors_by_status) == (n, n, {}), objective
        # every request met its class's one generous target ("all": every stated one)
        assert counted[(objective or "default", "met", "all")] == n, counted
    # a class the server does not define: each request a failed one, the server's 400
    gold = reports["gold"]
    assert (gold.sent, gold.ok, gold.errors_by_status) == (2, 0, {"400": 2})
    error = gold.results[0].error or ""
    assert "unknown SLO class 'gold'" in error and "chat" in error and "batch" in error
    # nor is it judged under any class: the 400 is the client's own error
    assert sum(v for (c, _, t), v in counted.items() if t == "all") == 10


async def test_a_load_naming_no_class_sends_no_header() -> None:
    seen: list[str | None] = []

    async def completions(request: web.Request) -> web.Response:
        seen.append(request.headers.get(OBJECTIVE_HEADER))
        return web.json_response({"usage": {"prompt_tokens": 1, "completion_tokens": 1}})

    async with fake_server("POST", "/v1/completions", completions) as url:
        for objective in (None, "batch"):
            load = spec(url, 2, objective)
            load.stream = False
            assert (await run_load(load)).ok == 2
    assert seen == [None, None, "batch", "batch"]
