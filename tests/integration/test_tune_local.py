"""`batchpilot tune` and its loop on real servers: bad configs move the right way; the
demo's local scaler starts servers from the config in force and stops them without
losing a request."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import aiohttp
import pytest
from batchpilot_operator.actuators import LocalActuator, get_batching, write_config_file
from batchpilot_operator.policy.types import Cadence, Fleet, Goal, ScaleDecision
from batchpilot_operator.slo import Slo
from batchpilot_operator.tune_local import TuneOptions, main, options_from_args, parser, tune_loop
from batchpilot_operator.tuning_loop import TuneStep
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.demo.fleet import ProcessFleet
from batchpilot_tools.loadgen import LengthDist, LoadSpec, RequestResult, run_load

from tests.support.servers import free_port, serve_in_process, spawn_server

DEADLINE_S = 40.0  # the load stops here at the latest; the tuner acts well before


async def tune_until_first_change(
    url: str, token: str | None, slo: Slo, load: LoadSpec
) -> tuple[TuneStep, list[TuneStep]]:
    """Run the load and the tuner together; stop both at the tuner's first change."""
    stop = asyncio.Event()
    options = TuneOptions(
        servers=(url,), goal=Goal(slo), cadence=Cadence(2.0, 2.0), token=token, min_requests=10,
    )

    def on_step(step: TuneStep) -> None:
        if step.decision.action != "hold":
            stop.set()

    loader = asyncio.create_task(run_load(load))
    try:
        steps = await asyncio.wait_for(tune_loop(options, on_step, stop), DEADLINE_S)
    finally:
        loader.cancel()
        await asyncio.gather(loader, return_exceptions=True)
    changes = [s for s in steps if s.decision.action != "hold"]
    assert changes, [s.decision.reason for s in steps]
    return changes[0], steps


async def test_batch_of_one_under_heavy_load_grows(tmp_path: Path) -> None:
    # A server process of its own: the load generator must not starve it of the event loop.
    with spawn_server(
        tmp_path=tmp_path, max_batch_size=1, batch_timeout_ms=0, max_queue_size=4096
    ) as srv:
        load = LoadSpec(
            urls=[srv.url], rate=40.0, duration_s=DEADLINE_S,
            prompt_len=LengthDist("fixed", 16), output_len=LengthDist("fixed", 24),
        )
        change, _ = await tune_until_first_change(srv.url, srv.token, Slo(e2e_s=30.0), load)
        assert change.decision.action == "grow_batch", change.decision.reason
        assert change.report.ok
        async with aiohttp.ClientSession() as session:
            in_force = await get_batching(session, srv.url)
        assert in_force.max_batch_size == change.decision.config.max_batch_size > 1


async def test_batch_of_64_with_a_tight_slo_shrinks() -> None:
    async with serve_in_process(max_batch_size=64, batch_timeout_ms=0, kv_cache_mb=64) as srv:
        # 64 closed-loop clients keep the batch full: every step is a batch-64 step.
        load = LoadSpec(
            urls=[srv.url], arrival="concurrency", concurrency=64, duration_s=DEADLINE_S,
            prompt_len=LengthDist("fixed", 16), output_len=LengthDist("fixed", 32),
        )
        change, _ = await tune_until_first_change(srv.url, srv.token, Slo(e2e_s=0.05), load)
        assert change.decision.action == "backoff_batch", change.decision.reason
        async with aiohttp.ClientSession() as session:
            in_force = await get_batching(session, srv.url)
        assert in_force.max_batch_size == change.decision.config.max_batch_size < 64


async def test_cli_prints_json_decisions_and_holds_without_traffic(tmp_path: Path) -> None:
    async with serve_in_process() as srv:
        token_file = tmp_path / "token"
        token_file.write_text(f"{srv.token}\n")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "batchpilot_server.cli", "tune", "--server", srv.url,
            "--slo-p99-ms", "500", "--interval", "0.5", "--window", "0.5", "--iterations", "2",
            "--token-file", str(token_file), "--json",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    lines = [json.loads(line) for line in out.decode().splitlines()]
    assert [line["index"] for line in lines] == [0, 1]
    for line in lines:
        assert line["action"] == "hold"
        assert line["signals"]["status"] == "no_traffic"
        assert (line["max_batch_size"], line["batch_timeout_ms"]) == (8, 10.0)


def test_the_slo_flags_state_the_targets() -> None:
    args = parser().parse_args([
        "--server", "http://127.0.0.1:1", "--slo-ttft-ms", "800", "--slo-tpot-ms", "60",
        "--slo-attainment", "0.95", "--min-prefill-budget", "256", "--max-prefill-budget", "4096",
    ])  # fmt: skip
    goal = options_from_args(args).goal
    assert (goal.slo.ttft_s, goal.slo.tpot_s, goal.slo.e2e_s) == (0.8, 0.06, None)
    assert goal.slo.attainment == 0.95
    assert (goal.bounds.min_prefill_budget, goal.bounds.max_prefill_budget) == (256, 4096)
    old = parser().parse_args(["--server", "http://127.0.0.1:1", "--slo-p99-ms", "500"])
    assert options_from_args(old).goal.slo.e2e_s == 0.5  # the older name of --slo-e2e-ms
    assert options_from_args(old).follow_servers_k  # no k bounds given: the servers' k
    widened = parser().parse_args([
        "--server", "http://127.0.0.1:1", "--slo-p99-ms", "500", "--max-speculative-tokens", "4",
    ])  # fmt: skip
    options = options_from_args(widened)
    bounds = options.goal.bounds
    assert (bounds.min_speculative_tokens, bounds.max_speculative_tokens) == (0, 4)
    assert not options.follow_servers_k


async def test_the_local_tuner_keeps_the_k_a_server_runs() -> None:
    """Without k bounds the round keeps the servers' k: the default bounds (0..0) would
    clamp it and turn their speculation off."""
    async with serve_in_process() as srv, aiohttp.ClientSession() as session:
        speculating = BatchingConfig(num_speculative_tokens=3)
        pushed = await LocalActuator([srv.url], srv.token, session, speculating).apply(speculating)
        assert pushed.ok
        options = TuneOptions(
            servers=(srv.url,), goal=Goal(Slo(e2e_s=30.0)), cadence=Cadence(0.1, 0.1),
            token=srv.token, iterations=1, follow_servers_k=True,
        )  # fmt: skip
        (step,) = await tune_loop(options)
        assert step.decision.config.num_speculative_tokens == 3
        assert (await get_batching(session, srv.url)).num_speculative_tokens == 3


@pytest.mark.parametrize(
    ("args", "code", "message"),
    [
        (["--slo-p99-ms", "0"], 2, "SLO must be positive"),
        (["--slo-p99-ms", "500", "--interval", "30", "--window", "10"], 2,
         "must be at least the interval"),
        (["--slo-p99-ms", "500", "--min-batch", "9", "--max-batch", "4"], 2, "1 <= min <= max"),
        (["--slo-p99-ms", "500", "--token-file", "/nonexistent/token"], 2,
         "cannot read --token-file"),
        (["--slo-p99-ms", "500", "--iterations", "0"], 2, "--iterations must be at least 1"),
        ([], 2, "state at least one SLO target"),
        (["--slo-tpot-ms", "-1"], 2, "--slo-tpot-ms: the SLO must be positive"),
        (["--slo-ttft-ms", "500", "--slo-attainment", "1"], 2, "--slo-attainment must be in"),
        (["--slo-ttft-ms", "500", "--min-prefill-budget", "4096", "--max-prefill-budget", "256"],
         2, "prefill token budget bounds"),
        (["--slo-ttft-ms", "500", "--max-speculative-tokens", "17"], 2,
         "speculative token bounds"),
    ],
)
def test_cli_refuses_bad_options_with_a_clear_message(
    args: list[str], code: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--server", "http://127.0.0.1:1", *args]) == code
    assert message in capsys.readouterr().err


def test_cli_says_when_the_server_is_not_there(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert main(["--server", url, "--slo-p99-ms", "500", "--iterations", "1"]) == 1
    err = capsys.readouterr().err
    assert f"cannot read the batching config of {url}" in err
    assert "batchpilot serve" in err


# -- the demo's local scaler ----------------------------------------------------------------

READY_TIMEOUT_S = 90.0  # a server process on a busy 2-core machine
TUNED = BatchingConfig(max_batch_size=6, batch_timeout_ms=7.0, max_queue_size=512)


async def until_serving(fleet: ProcessFleet, count: int) -> None:
    async with asyncio.timeout(READY_TIMEOUT_S):
        while (await fleet.fleet()).ready != count:
            await asyncio.sleep(0.1)


async def test_a_scale_out_starts_a_server_that_serves_the_config_in_force(
    tmp_path: Path,
) -> None:
    async with ProcessFleet("tiny", tmp_path, READY_TIMEOUT_S) as fleet:
        await fleet.start(1)
        write_config_file(fleet.config_file, TUNED)  # what the local actuator records
        await fleet.scale(ScaleDecision(2, "scale_out", "test"))
        # counted at once, serving once ready: the replica rule waits for it meanwhile
        assert await fleet.fleet() == Fleet(desired=2, ready=1)
        async with aiohttp.ClientSession() as session:
            await until_serving(fleet, 2)
            first, new = fleet.servers
            assert fleet.serving() == [first.url, new.url] == fleet.load.urls
            held = await get_batching(session, new.url)
            assert held == TUNED
            async with session.get(f"{new.url}/admin/batching") as response:
                # version 1: it started from the record, nothing had to be pushed
                assert (await response.json())["version"] == 1
            body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True}
            async with session.post(f"{new.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                assert (await response.json())["usage"]["completion_tokens"] == 4
            # the first server keeps the config it runs: the tuner's resync is what moves it
            assert (await get_batching(session, first.url)).max_batch_size == 1


async def test_a_scale_in_under_load_stops_the_newest_server_and_loses_no_request(
    tmp_path: Path,
) -> None:
    async with ProcessFleet("tiny", tmp_path, READY_TIMEOUT_S) as fleet:
        await fleet.start(2)
        oldest, newest = fleet.servers
        ended: list[RequestResult] = []
        spec = LoadSpec(
            urls=fleet.serving(), rate=4.0, duration_s=12.0,
            prompt_len=LengthDist("fixed", 16), output_len=LengthDist("fixed", 48),
        )  # fmt: skip
        load = asyncio.create_task(run_load(spec, ended.append, targets=fleet.load))
        async with asyncio.timeout(30):  # tell it to go while it owes answers
            while fleet.load.unanswered(newest.url) < 2:
                await asyncio.sleep(0.01)
        owed = fleet.load.unanswered(newest.url)
        answered_before = sum(result.url == newest.url for result in ended)
        await fleet.scale(ScaleDecision(1, "scale_in", "test"))
        assert fleet.serving() == fleet.load.urls == [oldest.url]
        assert await fleet.fleet() == Fleet(desired=1, ready=1)
        report = await load
        async with asyncio.timeout(30):
            while newest.process.poll() is None:
                await asyncio.sleep(0.1)
        assert newest.process.returncode == 0  # SIGTERM's drain, not a kill
        assert oldest.process.poll() is None
    assert report.errors_by_status == {} and report.ok == report.sent > 0
    # Everything it was sent before it left was answered by it, and nothing after.
    to_newest = [result for result in report.results if result.url == newest.url]
    assert len(to_newest) == answered_before + owed
    assert all(result.ok for result in to_newest)
    # Its slot-step counters were read before the stop, for the demo's summary.
    retired = fleet.retired[newest.name]
    assert retired is not None and retired.total > 0
