"""The SLO targets and the prefill token budget, live over `PUT /admin/batching`, and what
/metrics then counts: each request's SLO verdict, and the work of every engine step."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from batchpilot_server import metric_names as names

from tests.support.engine_helpers import requires_c_compiler
from tests.support.servers import complete, labelled, scrape, serve_on_thread

pytestmark = pytest.mark.timeout(120)

TOKEN = "test-token"
GENEROUS_MS = 60_000.0  # a minute: every request on an idle tiny server meets it
IMPOSSIBLE_MS = 0.001  # a microsecond: none does
# each test's prompts start with token ids of their own, so no prompt finds another's
# blocks in the prefix cache (a cold cache: every prompt token is computed)
FIRST_IDS = itertools.count(11)


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_on_thread(mode="continuous", max_batch_size=8, admin_token=TOKEN) as server_url:
        yield server_url


def prompt(length: int) -> list[int]:
    return [next(FIRST_IDS), *([7] * (length - 1))]


async def put(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with session.put(f"{url}/admin/batching", json=body, headers=headers) as response:
        answer = await response.json()
        assert response.status == 200, answer
        return answer


async def slo_counts(session: aiohttp.ClientSession, url: str) -> dict[tuple[str, str], float]:
    """{(result, target): count} of batchpilot_requests_slo_total."""
    counts = await labelled(session, url, names.REQUESTS_SLO_TOTAL, "result", "target")
    return {(result, target): value for (result, target), value in counts.items()}


def delta(after: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    """What changed, zeros left out."""
    return {
        key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key)
    }


async def served(session: aiohttp.ClientSession, url: str, n: int, **body: Any) -> list[dict]:
    """`n` completions at once, each answered 200; their answers."""
    answers = await asyncio.gather(
        *(complete(session, url, prompt=prompt(8), ignore_eos=True, **body) for _ in range(n))
    )
    assert [status for status, _, _ in answers] == [200] * n, answers
    return [answer for _, answer, _ in answers]


async def test_a_generous_slo_is_met_by_every_request_and_its_targets_are_gauges(url: str) -> None:
    slo = {"ttft_ms": GENEROUS_MS, "tpot_ms": GENEROUS_MS, "e2e_ms": GENEROUS_MS}
    async with aiohttp.ClientSession() as session:
        state = await put(session, url, {"slo": slo})
        before = await slo_counts(session, url)
        histograms = await scrape(session, url)
        await served(session, url, 3, max_tokens=4)
        counts = delta(await slo_counts(session, url), before)
        after = await scrape(session, url)
        targets = await labelled(session, url, names.SLO_TARGET, "target")
    assert state["slo"] == {**slo, "classes": []}
    assert counts == {("met", target): 3 for target in ("ttft", "tpot", "e2e", "all")}
    assert targets == {("ttft",): 60.0, ("tpot",): 60.0, ("e2e",): 60.0}
    for histogram in (names.REQUEST_TIME_PER_OUTPUT_TOKEN, names.REQUEST_PROMPT_TOKENS):
        count = f"{histogram}_count"
        assert after[(count, "")] - histograms.get((count, ""), 0) == 3, histogram
    vllm_tpot = f"{names.VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN}_count"
    assert after[(vllm_tpot, "")] - histograms[(vllm_tpot, "")] == 3


async def test_an_impossible_target_is_missed_by_every_request(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await put(session, url, {"slo": {"ttft_ms": IMPOSSIBLE_MS}})
        before = await slo_counts(session, url)
        await served(session, url, 3, max_tokens=2)
        counts = delta(await slo_counts(session, url), before)
        targets = await labelled(session, url, names.SLO_TARGET, "target")
    assert counts == {("missed", "ttft"): 3, ("missed", "all"): 3}
    assert targets == {("ttft",): IMPOSSIBLE_MS / 1000}  # the targets no longer stated left


async def test_one_missed_target_of_two_misses_the_slo(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        await put(session, url, {"slo": {"ttft_ms": GENEROUS_MS, "tpot_ms": IMPOSSIBLE_MS}})
        before = await slo_counts(session, url)
        await served(session, url, 3, max_tokens=8)
        counts = delta(await slo_counts(session, url), before)
    assert counts == {("met", "ttft"): 3, ("missed", "tpot"): 3, ("missed", "all"): 3}


async def test_no_target_stated_judges_nothing(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        state = await put(session, url, {"slo": {}})
        before = await slo_counts(session, url)
        await served(session, url, 2, max_tokens=2)
        counts = delta(await slo_counts(session, url), before)
    assert state["slo"] == {"ttft_ms": None, "tpot_ms": None, "e2e_ms": None, "classes": []}
    assert counts == {}


async def test_requests_refused_with_429_miss_every_stated_target(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        slo = {"ttft_ms": GENEROUS_MS, "e2e_ms": GENEROUS_MS}
        await put(session, url, {"slo": slo, "max_batch_size": 1, "max_queue_size": 1})
        before = await slo_counts(session, url)
        # one runs, one waits, the others find the queue full
        answers = await asyncio.gather(
            *(
                complete(session, url, prompt=prompt(8), max_tokens=50, ignore_eos=True)
                for _ in range(8)
            )
        )
        counts = delta(await slo_counts(session, url), before)
        await put(session, url, {"max_batch_size": 8, "max_queue_size": 256})
    statuses = [status for status, _, _ in answers]
    ok, refused = statuses.count(200), statuses.count(429)
    assert ok + refused == 8 and ok and refused, statuses
    met = {("met", target): ok for target in ("ttft", "e2e", "all")}
    assert counts == {**met, **{("missed", target): refused for target in ("ttft", "e2e", "all")}}


STEP_COUNTERS = {
    "steps": (f"{names.STEP_DURATION}_count", ""),
    "decode_rows": (names.STEP_DECODE_ROWS_TOTAL, ""),
    "prefill_tokens": (names.STEP_PREFILL_TOKENS_TOTAL, ""),
    "kv_tokens": (names.STEP_KV_TOKENS_TOTAL, ""),
}


async def step_work(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    metrics = await scrape(session, url)
    return {name: metrics[key] for name, key in STEP_COUNTERS.items()}


async def work_of(session: aiohttp.ClientSession, url: str, **body: Any) -> dict[str, float]:
    """The step counters' growth over one completion (the server runs nothing else)."""
    before = await step_work(session, url)
    status, answer, _ = await complete(session, url, ignore_eos=True, **body)
    assert status == 200, answer
    after = await step_work(session, url)
    return {name: after[name] - before[name] for name in after}


async def test_the_prefill_budget_applies_live(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        assert (await put(session, url, {"prefill_token_budget": 16}))["prefill_token_budget"] == 16
        budget = (await scrape(session, url))[(names.CONFIG_PREFILL_TOKEN_BUDGET, "")]
        chunked = await work_of(session, url, prompt=prompt(100), max_tokens=1)
        await put(session, url, {"prefill_token_budget": 4096})
        whole = await work_of(session, url, prompt=prompt(100), max_tokens=1)
    assert budget == 16
    # 6 chunks of 16 and one of 4, each attending everything computed so far
    ends = [16, 32, 48, 64, 80, 96, 100]
    assert chunked == {"steps": 7, "decode_rows": 0, "prefill_tokens": 100, "kv_tokens": sum(ends)}
    assert whole == {"steps": 1, "decode_rows": 0, "prefill_tokens": 100, "kv_tokens": 100}


async def test_the_step_counters_add_up_to_what_was_generated(url: str) -> None:
    prompt_tokens, output_tokens = 40, 10
    async with aiohttp.ClientSession() as session:
        await put(session, url, {"prefill_token_budget": 2048})
        work = await work_of(session, url, prompt=prompt(prompt_tokens), max_tokens=output_tokens)
    # the prompt in one prefill step, which samples the first token; each later token
    # is one decode row, attending the prompt and the tokens before it
    decodes = output_tokens - 1
    kv = prompt_tokens + sum(prompt_tokens + j for j in range(1, output_tokens))
    assert work == {
        "steps": 1 + decodes, "decode_rows": decodes, "prefill_tokens": prompt_tokens,
        "kv_tokens": kv,
    }  # fmt: skip


@requires_c_compiler  # prefix caching needs the native decode attention
async def test_siblings_of_one_prompt_share_its_blocks(url: str) -> None:
    """`n` choices of one prompt: the first computes it, the others wait a step for its
    blocks to be published and share them, computing only the block with the prompt's
    last token (always their own: the logits of their first token come from it)."""
    n, length, block = 4, 64, 16
    shared = (length - 1) // block * block  # 48 tokens: three whole blocks
    hits = (names.PREFIX_CACHE_HITS_TOTAL, "")
    queries = (names.PREFIX_CACHE_QUERIES_TOTAL, "")
    async with aiohttp.ClientSession() as session:
        await put(session, url, {"prefill_token_budget": 2048})
        before = await scrape(session, url)
        work = await work_of(session, url, prompt=prompt(length), max_tokens=2, n=n)
        after = await scrape(session, url)
    assert after[queries] - before[queries] == n * length
    assert after[hits] - before[hits] == (n - 1) * shared
    assert work["prefill_tokens"] == length + (n - 1) * (length - shared)
