"""SLO classes over HTTP: a request's class from its API key, the
x-gateway-inference-objective header or its `priority` field, each class judged against
its own targets on /metrics, and the class reaching the engine's sequence."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.http.server_state import STATE, ClassKey
from batchpilot_server.http.slo_class import OBJECTIVE_HEADER

from tests.support.servers import labelled, serve_in_process, serve_on_thread

pytestmark = pytest.mark.timeout(120)

ADMIN = "test-token"
FREE_KEY = "free-key"  # any class
BATCH_KEY = "batch-key"  # bound to the class batch
GENEROUS_MS = 60_000.0  # every request on an idle tiny server meets it
IMPOSSIBLE_MS = 0.001  # none does
# chat is served first, batch last; default (the top-level targets) sits at 0 between
CLASSES = [
    {"name": "chat", "priority": 10, "ttft_ms": GENEROUS_MS},
    {"name": "batch", "priority": -5, "e2e_ms": IMPOSSIBLE_MS},
]
FIRST_IDS = itertools.count(211)  # prompts of their own: no prefix-cache sharing


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    bound = (ClassKey("batch", lambda: BATCH_KEY),)
    with serve_on_thread(admin_token=ADMIN, api_key=FREE_KEY, class_keys=bound) as server_url:
        yield server_url


async def put_classes(session: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    body = {"slo": {"tpot_ms": GENEROUS_MS, "classes": CLASSES}}
    headers = {"Authorization": f"Bearer {ADMIN}"}
    async with session.put(f"{url}/admin/batching", json=body, headers=headers) as response:
        answer = await response.json()
        assert response.status == 200, answer
        return answer


async def post(
    session: aiohttp.ClientSession,
    url: str,
    *,
    key: str | None = FREE_KEY,
    objective: str | None = None,
    **body: Any,
) -> tuple[int, dict[str, Any]]:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    if objective is not None:
        headers[OBJECTIVE_HEADER] = objective
    prompt = [next(FIRST_IDS), 7, 7, 7]
    payload = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True, **body}
    async with session.post(f"{url}/v1/completions", json=payload, headers=headers) as response:
        return response.status, await response.json()


async def judged(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, ...], float]:
    """{(class, result): count} of the requests judged on every stated target."""
    counts = await labelled(
        session, url, names.REQUESTS_SLO_TOTAL, names.CLASS_LABEL, "result", "target"
    )
    return {key[:2]: value for key, value in counts.items() if key[2] == names.SLO_ALL}


def grown(after: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


async def test_the_put_classes_are_in_force_and_shown(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        state = await put_classes(session, url)
    shown = state["slo"]["classes"]
    assert [(c["name"], c["priority"]) for c in shown] == [("chat", 10), ("batch", -5)]
    assert shown[1]["e2e_ms"] == IMPOSSIBLE_MS and shown[1]["ttft_ms"] is None


async def test_the_header_picks_the_class_and_each_class_is_judged_on_its_own_targets(
    url: str,
) -> None:
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        before = await judged(session, url)
        for objective in ("chat", "batch"):
            status, answer = await post(session, url, objective=objective)
            assert status == 200, answer
        after = await judged(session, url)
    # chat's generous TTFT holds; batch's microsecond e2e cannot
    assert grown(after, before) == {("chat", "met"): 1, ("batch", "missed"): 1}


async def test_an_unknown_class_is_a_400_naming_the_known_ones(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        before = await judged(session, url)
        status, answer = await post(session, url, objective="gold")
        after = await judged(session, url)
    assert status == 400
    error = answer["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "unknown_slo_class"
    assert "'gold'" in error["message"]
    assert "known classes: default, chat, batch" in error["message"]
    assert after == before  # the client's error is not judged


@pytest.mark.parametrize(
    ("priority", "expected"),
    [(-100, "chat"), (-10, "chat"), (-9, "default"), (0, "default"), (1, "batch"), (99, "batch")],
)
async def test_the_priority_field_picks_the_class_by_vllms_order(
    url: str, priority: int, expected: str
) -> None:
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        before = await judged(session, url)
        status, answer = await post(session, url, priority=priority)
        after = await judged(session, url)
    assert status == 200, answer
    assert [key[0] for key in grown(after, before)] == [expected]


async def test_the_header_wins_over_the_priority_field(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        before = await judged(session, url)
        status, _ = await post(session, url, objective="batch", priority=-10)
        after = await judged(session, url)
    assert status == 200
    assert grown(after, before) == {("batch", "missed"): 1}


async def test_a_key_bound_to_a_class_keeps_its_requests_there(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        before = await judged(session, url)
        # the batch tenant asks for chat both ways: it stays in batch
        status, answer = await post(session, url, key=BATCH_KEY, objective="chat", priority=-10)
        assert status == 200, answer
        after = await judged(session, url)
        no_key, _ = await post(session, url, key=None)
        wrong_key, _ = await post(session, url, key="not-a-key")
    assert grown(after, before) == {("batch", "missed"): 1}
    assert (no_key, wrong_key) == (401, 401)


async def test_latency_histograms_count_by_class_and_vllms_names_keep_their_labels(
    url: str,
) -> None:
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        ours = f"{names.REQUEST_DURATION}_count"
        before = await labelled(session, url, ours, names.CLASS_LABEL)
        status, _ = await post(session, url, objective="chat")
        assert status == 200
        after = await labelled(session, url, ours, names.CLASS_LABEL)
        async with session.get(f"{url}/metrics") as response:
            text = await response.text()
    assert grown(after, before) == {("chat",): 1}
    vllm_lines = [line for line in text.splitlines() if line.startswith("vllm:e2e_request")]
    assert vllm_lines and all("class=" not in line for line in vllm_lines)


async def test_the_length_histograms_count_each_finished_request_in_its_class(
    url: str,
) -> None:
    # the tuner sizes each class's tails by its own prompts and answers (predictor.py)
    lengths = (names.REQUEST_PROMPT_TOKENS, names.REQUEST_GENERATION_TOKENS)
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        before = {h: await labelled(session, url, f"{h}_sum", names.CLASS_LABEL) for h in lengths}
        status, _ = await post(session, url, key=BATCH_KEY, max_tokens=5)
        assert status == 200
        after = {h: await labelled(session, url, f"{h}_sum", names.CLASS_LABEL) for h in lengths}
    prompt, output = (grown(after[h], before[h]) for h in lengths)
    assert (prompt, output) == ({("batch",): 4.0}, {("batch",): 5.0})


async def test_a_put_classs_series_exist_at_zero_before_its_first_request() -> None:
    # A series born at a class's first request has no earlier sample, so Prometheus's
    # increase() over a window would miss that request: the PUT opens them at 0.
    async with serve_in_process(admin_token=ADMIN) as server, aiohttp.ClientSession() as s:
        await put_classes(s, server.url)
        slo = await labelled(s, server.url, names.REQUESTS_SLO_TOTAL, names.CLASS_LABEL)
        counts = {
            h: await labelled(s, server.url, f"{h}_count", names.CLASS_LABEL)
            for h in (names.TIME_TO_FIRST_TOKEN, names.REQUEST_PROMPT_TOKENS)
        }
    assert {("chat",), ("batch",), ("default",)} <= slo.keys() and not any(slo.values())
    for histogram, count in counts.items():
        assert count == {("chat",): 0.0, ("batch",): 0.0, ("default",): 0.0}, histogram


async def test_the_class_and_its_priority_reach_the_engines_sequence() -> None:
    async with serve_in_process(admin_token=ADMIN) as server:
        engine: Any = server.app[STATE].engine
        scheduler = engine._scheduler
        added: list[Sequence] = []
        add = scheduler.add

        def record(seq: Sequence) -> None:
            added.append(seq)
            add(seq)

        scheduler.add = record
        async with aiohttp.ClientSession() as session:
            await put_classes(session, server.url)
            for body in ({"objective": "chat"}, {"priority": 7}, {}):
                status, answer = await post(session, server.url, key=None, **body)
                assert status == 200, answer
    assert [(s.slo_class, s.priority) for s in added] == [
        ("chat", 10),
        ("batch", -5),
        ("default", 0),
    ]


@pytest.mark.parametrize(
    ("classes", "words"),
    [
        (
            [{"name": "chat", "ttft_ms": 1.0}, {"name": "chat", "e2e_ms": 1.0}],
            "chat more than once",
        ),
        ([{"name": "default", "ttft_ms": 1.0}], "must not name a class 'default'"),
        ([{"name": "batch", "priority": -5}], "states no target"),
        ([{"name": "Chat UI", "ttft_ms": 1.0}], "name"),
    ],
    ids=["duplicate", "default", "no target", "not a DNS label"],
)
async def test_a_put_of_bad_classes_is_a_400_and_changes_nothing(
    url: str, classes: list[dict[str, Any]], words: str
) -> None:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    body = {"slo": {"tpot_ms": GENEROUS_MS, "classes": classes}}
    async with aiohttp.ClientSession() as session:
        await put_classes(session, url)
        async with session.put(f"{url}/admin/batching", json=body, headers=headers) as response:
            status, answer = response.status, await response.json()
        async with session.get(f"{url}/admin/batching") as response:
            state = await response.json()
    assert status == 400 and words in answer["error"]["message"], answer
    assert [c["name"] for c in state["slo"]["classes"]] == ["chat", "batch"]
