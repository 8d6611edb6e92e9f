"""The local actuator against real servers: applied, refused, unreachable, resynced."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from batchpilot_operator.actuators import LocalActuator, get_batching
from batchpilot_server.batching_config import BatchingConfig

from tests.support.servers import free_port, serve_in_process

TUNED = BatchingConfig(max_batch_size=24, batch_timeout_ms=3.5)


async def test_applies_to_every_server_and_keeps_their_queue_size() -> None:
    async with (
        serve_in_process(max_queue_size=77) as first,
        serve_in_process(max_queue_size=88) as second,
        aiohttp.ClientSession() as session,
    ):
        actuator = LocalActuator([first.url, second.url], first.token, session, BatchingConfig())
        report = await actuator.apply(TUNED)
        assert report.ok and report.refused == []
        assert sorted(a.target for a in report.applied) == sorted([first.url, second.url])
        assert all(a.version == 2 for a in report.applied)  # 1 at start, +1 per PUT
        for url, queue in ((first.url, 77), (second.url, 88)):
            in_force = await get_batching(session, url)
            assert (in_force.max_batch_size, in_force.batch_timeout_ms) == (24, 3.5)
            assert in_force.max_queue_size == queue


async def test_reports_a_wrong_token_and_an_unreachable_server_without_raising() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        report = await LocalActuator(
            [server.url, dead], "wrong-token", session, BatchingConfig()
        ).apply(TUNED)
        assert report.applied == []
        reasons = {r.target: r.reason for r in report.refused}
        assert reasons[server.url] == "HTTP 403: the admin token is not valid"
        assert reasons[dead].startswith("unreachable")
        assert "refused by" in report.summary()
        untouched = await get_batching(session, server.url)
        assert untouched.max_batch_size == BatchingConfig().max_batch_size


async def test_a_server_without_admin_api_refuses_with_its_reason() -> None:
    async with serve_in_process(admin_token=None) as server, aiohttp.ClientSession() as session:
        report = await LocalActuator([server.url], "any", session, BatchingConfig()).apply(TUNED)
        assert [r.reason.split(":")[0] for r in report.refused] == ["HTTP 403"]
        assert "admin-token-file" in report.refused[0].reason


async def test_the_config_in_force_is_the_record_and_resync_brings_servers_back_to_it() -> None:
    async with (
        serve_in_process() as held_other,
        serve_in_process(max_batch_size=TUNED.max_batch_size, batch_timeout_ms=3.5) as in_line,
        aiohttp.ClientSession() as session,
    ):
        actuator = LocalActuator([held_other.url, in_line.url], held_other.token, session, TUNED)
        assert await actuator.in_force() == TUNED
        report = await actuator.resync(TUNED)
        # Only the server that held other knobs is pushed to.
        assert [a.target for a in report.applied] == [held_other.url] and report.ok
        brought_back = await get_batching(session, held_other.url)
        assert (brought_back.max_batch_size, brought_back.batch_timeout_ms) == (24, 3.5)
        assert not (await actuator.resync(TUNED)).applied  # nothing left to bring back


async def test_a_refused_push_is_still_the_config_in_force() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        actuator = LocalActuator([server.url], "wrong-token", session, BatchingConfig())
        report = await actuator.apply(TUNED)
        assert report.applied == [] and report.refused
        assert await actuator.in_force() == TUNED
        again = await actuator.resync(TUNED)
        assert [r.reason for r in again.refused] == ["HTTP 403: the admin token is not valid"]


async def test_the_record_is_written_where_servers_started_later_read_it(tmp_path: Path) -> None:
    record = tmp_path / "batching.json"
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        start = BatchingConfig(max_batch_size=3, batch_timeout_ms=1.0)
        actuator = LocalActuator([server.url], server.token, session, start, record)
        assert BatchingConfig.from_file(record) == start  # before any change
        assert (await actuator.apply(TUNED)).ok
        assert BatchingConfig.from_file(record) == TUNED
        assert not list(tmp_path.glob("*.partial"))  # replaced whole


async def test_it_pushes_to_the_servers_it_is_told_to_follow() -> None:
    async with (
        serve_in_process() as leaving,
        serve_in_process() as joining,
        aiohttp.ClientSession() as session,
    ):
        actuator = LocalActuator([leaving.url], leaving.token, session, BatchingConfig())
        actuator.follow([joining.url])
        report = await actuator.apply(TUNED)
        assert [a.target for a in report.applied] == [joining.url]
        assert (await get_batching(session, joining.url)).max_batch_size == 24
        assert (await get_batching(session, leaving.url)).max_batch_size == 8  # left alone
        assert [a.target for a in (await actuator.resync(TUNED)).applied] == []


async def test_k_is_pushed_and_a_server_holding_another_k_is_brought_back() -> None:
    async with (
        serve_in_process() as speculating,
        serve_in_process() as off,
        aiohttp.ClientSession() as session,
    ):
        report = await LocalActuator(
            [speculating.url], speculating.token, session, BatchingConfig()
        ).apply(BatchingConfig(num_speculative_tokens=3))
        assert report.ok
        assert (await get_batching(session, speculating.url)).num_speculative_tokens == 3
        # the record says off (k = 0, which the ConfigMap leaves out): only the server
        # that speculates is pushed to, and k = 0 is sent explicitly
        actuator = LocalActuator(
            [speculating.url, off.url], speculating.token, session, BatchingConfig()
        )
        resynced = await actuator.resync(BatchingConfig())
        assert [a.target for a in resynced.applied] == [speculating.url]
        assert (await get_batching(session, speculating.url)).num_speculative_tokens == 0
        assert not (await actuator.resync(BatchingConfig())).applied
