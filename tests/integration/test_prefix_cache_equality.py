"""Automatic prefix caching on the real engine: every greedy float32 output with the cache
equals the output without it (tiny and SmolLM2, both modes, chunked prefill, a repeated
prompt, eviction, KV pressure with preemption), the cache is really used (hits counted),
a cached block nobody holds counts as free, and the metrics and the flag reach the user."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import aiohttp
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.engine import model_build
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.serve_options import batching_config, engine_options, parser

from tests.support.engine_helpers import RecordingObserver, collect, started
from tests.support.servers import scrape, serve_in_process
from tests.support.smollm2 import load_float32

Waves = list[list[list[int]]]  # prompts submitted together, wave after wave


def byte_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids of tiny's byte vocabulary."""
    return random.Random(seed).choices(range(256), k=length)


SHARED = byte_prompt(70, seed=1)  # four full blocks of 16 and part of a fifth
TINY_WAVES: Waves = [
    [SHARED + byte_prompt(9, 2), SHARED + byte_prompt(30, 3), SHARED[:40]],
    # a repeat, a prompt that is exactly four cached blocks, a new suffix
    [SHARED + byte_prompt(9, 2), SHARED[:64], SHARED + byte_prompt(17, 4)],
    [SHARED + byte_prompt(30, 3) + byte_prompt(20, 5)],
]


async def run_waves(
    engine: Engine, waves: Waves, params: SamplingParams
) -> list[list[tuple[int, float]]]:
    """(token, logprob) of every request, wave by wave, each wave all at once."""
    outputs = []
    for wave in waves:
        results = await asyncio.gather(*(collect(engine.submit(p, params)) for p in wave))
        outputs += [[(e.token_id, e.logprob) for e in events] for events in results]
    return outputs


async def with_and_without_cache(
    waves: Waves, params: SamplingParams, mode: str = "continuous", **options: object
) -> tuple[list[list[int]], list[list[int]], RecordingObserver, Engine]:
    """The tokens of `waves` served with prefix caching and without; the cached run's
    observer and (stopped) engine."""
    tokens = []
    observers = []
    engines = []
    for caching in (True, False):
        observer = RecordingObserver()
        engine = await started(mode, observer, prefix_caching=caching, **options)  # type: ignore[arg-type]
        try:
            outputs = await run_waves(engine, waves, params)
        finally:
            await engine.shutdown()
        tokens.append([[token for token, _ in out] for out in outputs])
        observers.append(observer)
        engines.append(engine)
        assert engine.stats().kv_blocks_used == 0, "blocks still held after every request ended"
    assert observers[1].cache_queried == 0  # off: nothing looked up
    return tokens[0], tokens[1], observers[0], engines[0]


GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize(
    ("mode", "budget"), [("continuous", 2048), ("continuous", 24), ("dynamic", 2048)]
)
async def test_outputs_with_the_cache_equal_outputs_without_it(mode: str, budget: int) -> None:
    cached, uncached, observer, _ = await with_and_without_cache(
        TINY_WAVES, GREEDY, mode, prefill_token_budget=budget, batch_timeout_ms=5
    )
    assert cached == uncached
    # later waves share the first's four full blocks (the repeat and the exact four
    # blocks a little less: their last token is always computed)
    assert observer.cache_hit >= 4 * 16 * 3
    queried = sum(len(p) for wave in TINY_WAVES for p in wave)
    assert observer.cache_queried == queried


async def test_under_kv_pressure_with_preemption_and_eviction_outputs_are_unchanged() -> None:
    """Eight shared-prefix requests that cannot all hold their KV (preemption, and a
    preempted one re-admitted onto its cached prefix), chunked prefill, then distinct
    prompts that need more blocks than the pool has (evicting the cached prefix), then
    the first wave again."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = [SHARED + byte_prompt(3 + n, 10 + n) for n in range(8)]
    flood = [byte_prompt(100, 30 + n) for n in range(4)]
    waves = [first, flood, first]
    cached, uncached, observer, engine = await with_and_without_cache(
        waves, params, kv_cache_mb=1, prefill_token_budget=32, max_batch_size=8
    )
    assert cached == uncached
    stats = engine.stats()
    assert observer.preemptions > 0
    assert sum(-(-(len(p) + 40) // 16) for p in flood) > stats.kv_blocks_total
    assert observer.cache_hit > 0


async def test_the_torch_decode_attention_turns_prefix_caching_off(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer = RecordingObserver()
    engine = await started("continuous", observer, attention="torch")
    try:
        await run_waves(engine, TINY_WAVES[:2], GREEDY)
    finally:
        await engine.shutdown()
    assert observer.cache_queried == 0
    assert "prefix caching is off" in caplog.text


@pytest.mark.parametrize(("mode", "budget"), [("continuous", 48), ("dynamic", 2048)])
async def test_smollm2_chats_sharing_a_system_prompt_decode_as_without_the_cache(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, mode: str, budget: int
) -> None:
    # float32, loaded once for all the engines of this test
    monkeypatch.setattr(model_build, "load_model", lambda source, **_: load_float32(source))
    tokenizer = load_float32(str(smollm2_dir)).tokenizer
    system = (
        "You are a careful assistant for a bicycle repair shop. Answer in one short "
        "sentence, name the tool needed, and never invent prices. The shop opens at nine, "
        "closes at six, and repairs brakes, gears, wheels and chains. "
    )
    questions = ["How do I fix a flat tyre?", "My chain slips.", "Brakes squeal, why?"]
    chats = [tokenizer.encode(f"{system}Customer: {q}\nAssistant:") for q in questions]
    waves = [chats[:2], [chats[2], chats[0]]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    cached, uncached, observer, _ = await with_and_without_cache(
        waves, params, mode, model=str(smollm2_dir), kv_cache_mb=24, prefill_token_budget=budget
    )
    assert cached == uncached
    assert observer.cache_hit >= 2 * 16 * (len(tokenizer.encode(system)) // 16 - 1)


async def test_the_hit_and_query_counters_are_served_in_tokens() -> None:
    prompt = "".join(chr(ord("a") + n % 26) for n in range(100))  # tiny: a token a byte
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        for suffix in ("1", "2"):
            body = {"prompt": prompt + suffix, "max_tokens": 2}
            async with session.post(f"{server.url}/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
        samples = await scrape(session, server.url)
    queries = samples[(names.PREFIX_CACHE_QUERIES_TOTAL, "")]
    hits = samples[(names.PREFIX_CACHE_HITS_TOTAL, "")]
    assert queries >= 2 * 101
    assert hits == 6 * 16  # the second request shares the first's six full blocks


def test_no_prefix_caching_flag_turns_it_off() -> None:
    for argv, expected in (([], True), (["--no-prefix-caching"], False)):
        args = parser().parse_args(argv)
        assert engine_options(args, batching_config(args)).prefix_caching is expected
