"""`batchpilot serve` as a real process: config file, graceful SIGTERM, usage errors."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
from pathlib import Path

import aiohttp
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.serve import main

from tests.support.servers import complete, scrape, spawn_server

pytestmark = pytest.mark.timeout(90)


async def test_config_file_wins_over_flags(tmp_path: Path) -> None:
    config = tmp_path / "batching.json"
    # the SLO classes too: the config file is how a local server gets them
    chat = {"name": "chat", "priority": 5, "ttft_ms": 200.0, "tpot_ms": None, "e2e_ms": None}
    slo = {"ttft_ms": 500.0, "tpot_ms": None, "e2e_ms": 9000.0, "classes": [chat]}
    config.write_text(
        json.dumps(
            {"max_batch_size": 3, "batch_timeout_ms": 7, "prefill_token_budget": 512, "slo": slo}
        )
    )
    # a flag the file leaves out stays in force
    extra = [
        *("--config-file", str(config), "--prefill-token-budget", "64"),
        *("--num-speculative-tokens", "3"),
    ]
    with spawn_server(tmp_path=tmp_path, mode="dynamic", max_batch_size=8, extra_args=extra) as srv:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{srv.url}/admin/batching") as response:
                in_force = await response.json()
            metrics = await scrape(session, srv.url)
    assert in_force == {
        "max_batch_size": 3, "batch_timeout_ms": 7, "max_queue_size": 256,
        "prefill_token_budget": 512, "num_speculative_tokens": 3, "slo": slo,
        "mode": "dynamic", "version": 1,
    }  # fmt: skip
    assert metrics[(names.CONFIG_MAX_BATCH_SIZE, "")] == 3
    assert metrics[(names.CONFIG_PREFILL_TOKEN_BUDGET, "")] == 512
    assert metrics[(names.CONFIG_BATCH_TIMEOUT, "")] == pytest.approx(0.007)


async def _read_stream(response: aiohttp.ClientResponse) -> dict[str, int]:
    usage: dict[str, int] = {}
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: {"):
            usage = json.loads(line.removeprefix("data: ")).get("usage") or usage
    return usage


async def test_sigterm_drains_in_flight_requests_and_exits_0(tmp_path: Path) -> None:
    with spawn_server(tmp_path=tmp_path) as srv:
        async with aiohttp.ClientSession() as session:
            async with session.get(f"{srv.url}/v1/models") as response:
                long = min(384, (await response.json())["data"][0]["max_model_len"] // 2)
            body = {"prompt": "drain me", "max_tokens": long, "ignore_eos": True, "stream": True}
            responses = [
                await session.post(f"{srv.url}/v1/completions", json=body) for _ in range(3)
            ]
            for response in responses:  # every request is generating
                await response.content.readline()
            srv.proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(10):
                while True:
                    async with session.get(f"{srv.url}/readyz") as ready:
                        if ready.status == 503:
                            break
                    await asyncio.sleep(0.02)
            status, refused, _ = await complete(session, srv.url, prompt="late", max_tokens=2)
            usages = [await _read_stream(response) for response in responses]
        exit_code = await asyncio.to_thread(srv.proc.wait, 30)
    assert status == 503
    assert refused["error"]["code"] == "shutting_down"
    assert [u["completion_tokens"] for u in usages] == [long] * 3
    assert exit_code == 0


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({"config.json": "{not json"}, "is not valid JSON"),
        ({"config.json": '{"max_batch_size": 0}'}, "max_batch_size must be between 1 and"),
        ({"config.json": '{"batch_size": 4}'}, "unknown batching field(s): batch_size"),
        ({"token": "  \n"}, "admin token file"),
    ],
)
def test_unusable_files_exit_2_with_a_clear_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], files: dict[str, str], message: str
) -> None:
    args = []
    for name, content in files.items():
        (tmp_path / name).write_text(content)
        flag = "--config-file" if name == "config.json" else "--admin-token-file"
        args += [flag, str(tmp_path / name)]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_missing_config_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config-file", str(tmp_path / "absent.json")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--max-batch-size", "0"], "max_batch_size must be between 1 and"),
        (["--batch-timeout-ms", "-5"], "batch_timeout_ms must be between 0 and"),
        (["--kv-cache-mb", "-1"], "--kv-cache-mb must be positive"),
        (["--threads", "0"], "--threads must be at least 1"),
        (["--queue-timeout-s", "0"], "--queue-timeout-s > 0"),
        (["--class-max-wait-s", "30"], "--class-max-wait-s (30) must be below --queue-timeout-s"),
        (["--queue-timeout-s", "10"], "--class-max-wait-s (20) must be below --queue-timeout-s"),
    ],
)
def test_bad_flags_exit_2_with_a_clear_message(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    assert main(flags) == 2
    assert message in capsys.readouterr().err


def test_port_in_use_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code = main(["--port", str(port), "--device", "cpu", "--threads", "1"])
    assert code == 1
    assert "address already in use" in capsys.readouterr().err.lower()
