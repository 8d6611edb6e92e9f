"""The load generator against real servers: counts, arrival shapes, errors, CLI output,
servers joining and leaving a run."""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import aiohttp
import pytest
from aiohttp import web
from batchpilot_server import metric_names as names
from batchpilot_tools.loadgen import LengthDist, LoadSpec, RequestResult, Targets, run_load

from tests.support.servers import fake_server, free_port, scrape, serve_in_process

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize(
    ("text", "low", "high"),
    [("fixed:7", 7, 7), ("uniform:3,9", 3, 9), ("lognormal:20,0.5", 1, 4096)],
)
def test_length_distributions_sample_within_their_range(text: str, low: int, high: int) -> None:
    dist = LengthDist.parse(text)
    rng = random.Random(1)
    samples = [dist.sample(rng) for _ in range(2000)]
    assert low <= min(samples) and max(samples) <= high
    assert str(dist) == text
    if dist.kind == "lognormal":  # the median is the first parameter
        assert sorted(samples)[1000] == pytest.approx(20, rel=0.1)
    if dist.kind == "uniform":
        assert set(samples) == set(range(low, high + 1))


@pytest.mark.parametrize("text", ["fixed", "fixed:x", "uniform:9,3", "lognormal:5", "zipf:2"])
def test_bad_length_distribution_is_refused_with_the_accepted_forms(text: str) -> None:
    with pytest.raises(ValueError, match="bad"):
        LengthDist.parse(text)


def test_spec_needs_an_end_and_a_server() -> None:
    with pytest.raises(ValueError, match="duration, a request count"):
        LoadSpec(urls=["http://x"])
    with pytest.raises(ValueError, match="at least one server"):
        LoadSpec(urls=[], num_requests=1)


async def test_fixed_concurrency_round_robin_over_two_servers(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with serve_in_process() as one, serve_in_process(mode="dynamic") as two:
        seen: list[RequestResult] = []
        spec = LoadSpec(
            urls=[one.url, two.url],
            arrival="concurrency",
            concurrency=4,
            num_requests=12,
            prompt_len=LengthDist.parse("uniform:4,12"),
            output_len=LengthDist.parse("fixed:6"),
            progress=True,
        )
        report = await run_load(spec, on_result=seen.append)
    assert (report.sent, report.ok, report.errors_by_status) == (12, 12, {})
    assert "12 done, 0 failed" in capsys.readouterr().err  # the progress bar's last state
    assert len(seen) == 12
    assert {r.url for r in seen} == {one.url, two.url}
    assert all(r.completion_tokens == 6 and len(r.inter_token_s) == 5 for r in seen)
    assert report.tokens_per_s == pytest.approx(72 / report.duration_s)
    for stats in (report.ttft_s, report.inter_token_s, report.latency_s):
        assert stats["p50"] is not None and stats["p50"] <= stats["p90"] <= stats["p99"]
    assert report.ttft_s["p99"] <= report.latency_s["p99"]


async def test_rate_schedule_shapes_arrivals() -> None:
    # Nothing for the first 0.3 s, then 40 req/s until 0.8 s.
    def schedule(elapsed_s: float) -> float:
        return 0.0 if elapsed_s < 0.3 else 40.0

    async with serve_in_process() as server:
        spec = LoadSpec(
            urls=[server.url],
            arrival="fixed",
            rate_schedule=schedule,
            duration_s=0.8,
            output_len=LengthDist.parse("fixed:2"),
            prompt_len=LengthDist.parse("fixed:4"),
        )
        report = await run_load(spec)
    starts = sorted(r.start_s for r in report.results)
    assert starts[0] >= 0.3
    assert starts[-1] < 0.8
    # 40 req/s for 0.5 s; the start is seen within one idle re-check.
    assert 16 <= report.sent <= 21
    assert report.ok == report.sent


async def test_overload_errors_are_counted_by_status() -> None:
    async with serve_in_process(max_batch_size=1, max_queue_size=1) as server:
        spec = LoadSpec(
            urls=[server.url],
            arrival="poisson",
            rate=400,
            num_requests=20,
            output_len=LengthDist.parse("fixed:32"),
        )
        report = await run_load(spec)
    assert report.sent == 20
    assert report.errors_by_status.get("429", 0) > 0
    assert report.ok + report.errors_by_status["429"] == 20
    assert all(r.error and "queue is full" in r.error for r in report.results if r.status == 429)


async def test_unreachable_server_counts_connection_errors() -> None:
    spec = LoadSpec(urls=[f"http://127.0.0.1:{free_port()}"], num_requests=3, rate=100)
    report = await run_load(spec)
    assert (report.ok, report.errors_by_status) == (0, {"connection": 3})


@pytest.mark.parametrize("reuse", [True, False])
async def test_reuse_connections_false_opens_one_connection_per_request(reuse: bool) -> None:
    """llama.cpp's server closes a connection after a streamed answer while announcing
    keep-alive; `reuse_connections=False` never sends on a used one."""
    clients: list[object] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        clients.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        usage = {"prompt_tokens": 1, "completion_tokens": 1}
        for event in ({"choices": [{"text": "a"}]}, {"choices": [], "usage": usage}):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async with fake_server("POST", "/v1/completions", completions) as url:
        spec = LoadSpec(
            urls=[url],
            arrival="concurrency",
            concurrency=1,
            num_requests=6,
            reuse_connections=reuse,
        )
        report = await run_load(spec)
    assert report.ok == 6, report.errors_by_status
    distinct = len(set(clients))
    assert (distinct == 6) if not reuse else (distinct < 6), f"{distinct} connections for 6"


async def test_cli_prints_a_table_and_a_final_json_line() -> None:
    async with serve_in_process() as server:
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "batchpilot_server.cli", "loadgen",
            "--url", server.url, "--arrival", "poisson", "--rate", "50", "--requests", "8",
            "--output-len", "fixed:4", "--prompt-len", "lognormal:8,0.3",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        stdout, stderr = await proc.communicate()
        wall = time.monotonic() - started
    assert proc.returncode == 0, stderr.decode()
    lines = stdout.decode().strip().splitlines()
    final = json.loads(lines[-1])
    assert final["sent"] == final["ok"] == 8
    assert 0 < final["duration_s"] < wall
    assert final["tokens_per_s"] == pytest.approx(32 / final["duration_s"], rel=0.01)
    assert any(line.startswith("ttft") for line in lines)
    assert set(final["latency_s"]) == {"p50", "p90", "p99"}


async def test_cli_refuses_a_bad_distribution() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "batchpilot_server.cli", "loadgen",
        "--url", "http://127.0.0.1:1", "--requests", "1", "--output-len", "zipf:1",
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await proc.communicate()
    assert proc.returncode == 2
    assert "bad length distribution 'zipf:1'" in stderr.decode()


async def test_cancelled_run_leaves_no_request_behind() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        spec = LoadSpec(
            urls=[server.url],
            rate=50,
            duration_s=30,
            output_len=LengthDist.parse("fixed:400"),
        )
        load = asyncio.create_task(run_load(spec))
        async with asyncio.timeout(20):
            while (await scrape(session, server.url))[(names.REQUESTS_RUNNING, "")] < 2:
                await asyncio.sleep(0.02)
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        async with asyncio.timeout(20):  # the server sees every client go and frees its work
            while True:
                metrics = await scrape(session, server.url)
                busy = (names.REQUESTS_RUNNING, ""), (names.REQUESTS_WAITING, "")
                if sum(metrics[key] for key in busy) == 0:
                    break
                await asyncio.sleep(0.02)
    assert metrics[(names.KV_CACHE_USAGE, "")] == 0
    assert metrics[(names.REQUESTS_TOTAL, "error")] >= 2


async def test_targets_change_while_a_run_lasts_and_a_leaver_answers_what_it_was_sent() -> None:
    async with serve_in_process() as staying, serve_in_process() as leaving:
        targets = Targets([staying.url])
        spec = LoadSpec(
            urls=[staying.url], arrival="concurrency", concurrency=4, num_requests=60,
            output_len=LengthDist.parse("fixed:24"), prompt_len=LengthDist.parse("fixed:4"),
        )  # fmt: skip
        ended: list[RequestResult] = []
        load = asyncio.create_task(run_load(spec, ended.append, targets=targets))
        async with asyncio.timeout(30):
            while len(ended) < 8:
                await asyncio.sleep(0.01)
        targets.add(leaving.url)
        async with asyncio.timeout(30):
            while targets.unanswered(leaving.url) == 0:
                await asyncio.sleep(0.005)
        targets.remove(leaving.url)
        sent_to_leaver = targets.unanswered(leaving.url) + sum(r.url == leaving.url for r in ended)
        assert await targets.wait_unanswered(leaving.url, timeout_s=30)
        report = await load
    assert (report.sent, report.ok) == (60, 60)
    assert sum(r.url == leaving.url for r in report.results) == sent_to_leaver >= 1
    assert targets.unanswered(staying.url) == targets.unanswered(leaving.url) == 0
    with pytest.raises(ValueError, match="last server"):
        targets.remove(staying.url)
