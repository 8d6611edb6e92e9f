"""Speculative decoding (n-gram prompt lookup) on the real engine: greedy float32
outputs token for token as without it (tiny and SmolLM2, the parity prompts, prefix
caching, chunked prefill beside verification, KV pressure with preemption), every KV
block back in the pool after, temperature 1 sampling keeping its distribution, and the
knob and the metrics over real HTTP."""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.engine import model_build
from batchpilot_server.engine_api import SamplingParams
from scipy.stats import chi2_contingency

from tests.support.engine_helpers import ATTENTIONS, RecordingObserver, collect, started
from tests.support.servers import labelled, scrape, serve_in_process
from tests.support.smollm2 import PARITY_PROMPTS, load_float32

pytestmark = pytest.mark.timeout(300)


def byte_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids of tiny's byte vocabulary."""
    return random.Random(seed).choices(range(256), k=length)


async def outputs_and_observer(
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    k: int,
    **options: object,
) -> tuple[list[list[int]], RecordingObserver]:
    """The tokens of `prompts` (each with its `params`, or all with the one), all
    submitted at once, served with `k` draft tokens; the engine must give every KV
    block back once they end."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    observer = RecordingObserver()
    engine = await started("continuous", observer, num_speculative_tokens=k, **options)  # type: ignore[arg-type]
    try:
        submitted = [engine.submit(p, q) for p, q in zip(prompts, each, strict=True)]
        results = await asyncio.gather(*map(collect, submitted))
    finally:
        await engine.shutdown()
    assert engine.stats().kv_blocks_used == 0, "blocks still held after every request ended"
    for events in results:
        assert [e.index for e in events] == list(range(len(events)))
    return [[e.token_id for e in events] for events in results], observer


async def assert_same_greedy_outputs(
    prompts: list[list[int]], params: SamplingParams, **options: object
) -> RecordingObserver:
    """Greedy outputs with 4 draft tokens equal those without; the speculative run's
    observer, which must have accepted drafts (else the test proved nothing)."""
    plain, _ = await outputs_and_observer(prompts, params, 0, **options)
    speculated, observer = await outputs_and_observer(prompts, params, 4, **options)
    assert speculated == plain
    assert observer.spec_accepted > 0
    return observer


# repeats for the proposer to find: tiny's random weights loop on their own too
SHARED = byte_prompt(40, seed=1)
TINY_PROMPTS = [
    SHARED * 3,
    SHARED + byte_prompt(20, 2) * 2,
    byte_prompt(60, 3),
    SHARED[:30] + byte_prompt(7, 4) * 4,
]


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("budget", [2048, 24])
async def test_tiny_greedy_outputs_equal_those_without_speculation(
    budget: int, attention: str
) -> None:
    """With prefix caching where the decode attention allows it (native: the repeats
    share blocks); a budget of 24 chunks the prompts, so verification runs in the steps
    that prefill others."""
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    observer = await assert_same_greedy_outputs(
        TINY_PROMPTS, params, prefill_token_budget=budget, batch_timeout_ms=5, attention=attention
    )
    assert observer.cache_hit > 0 or attention == "torch"


async def test_under_kv_pressure_with_preemption_outputs_are_unchanged() -> None:
    """More requests than the pool holds: drafts take only free blocks, sequences are
    preempted and recomputed (onto their cached prefix), rejected drafts' blocks return."""
    prompts = [SHARED + byte_prompt(5 + n, 10 + n) * 3 for n in range(8)]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    observer = await assert_same_greedy_outputs(
        prompts, params, kv_cache_mb=1, prefill_token_budget=32, max_batch_size=8
    )
    assert observer.preemptions > 0


@pytest.mark.parametrize("kv_cache_mb", [24, 6])
async def test_smollm2_parity_prompts_decode_as_without_speculation(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_cache_mb: float
) -> None:
    """Float32 SmolLM2: test_real_model's parity prompts and answers that quote their
    prompt, one batch, prefix caching on (the two quoting prompts share their text); in
    6 MiB of KV (about 130 tokens) the batch preempts its way through."""
    monkeypatch.setattr(model_build, "load_model", lambda source, **_: load_float32(source))
    tokenizer = load_float32(str(smollm2_dir)).tokenizer
    text = "The cat sat on the mat. The dog lay by the door. The bird sang in the tree."
    texts = [
        *PARITY_PROMPTS,
        f"Repeat this text exactly.\nText: {text}\nRepeated text: {text}\nRepeated text:",
        f"Repeat this text exactly.\nText: {text}\nRepeated text:",
    ]
    prompts = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    observer = await assert_same_greedy_outputs(
        prompts, params, model=str(smollm2_dir), kv_cache_mb=kv_cache_mb, prefill_token_budget=64
    )
    assert observer.preemptions > 0 or kv_cache_mb > 6


async def test_sampling_keeps_its_distribution() -> None:
    """Temperature 1 (top_k 2, so few outcomes): the joint distribution of the first four
    output tokens with 4 draft tokens is that without (a chi-square test of homogeneity
    over the outcomes seen, 400 seeded requests each, p > 0.001: a sampler that kept a
    draft token too often or too rarely shifts it by far more). The prompt ends in the
    loop tiny's greedy decode falls into, so drafts are proposed and often kept."""
    seed_prompt = byte_prompt(20, 5)
    (loop,), _ = await outputs_and_observer(
        [seed_prompt], SamplingParams(max_tokens=40, ignore_eos=True), 0
    )
    prompt = seed_prompt + loop
    runs = []
    for k in (0, 4):
        params = [
            SamplingParams(max_tokens=4, ignore_eos=True, temperature=1.0, top_k=2, seed=seed)
            for seed in range(k * 1000, k * 1000 + 400)
        ]
        outputs, observer = await outputs_and_observer(
            [prompt] * len(params), params, k, max_batch_size=32, max_queue_size=512
        )
        runs.append(Counter(map(tuple, outputs)))
        if k:
            assert observer.spec_accepted > 50  # drafts were tested, and kept (69 of 128)
    outcomes = sorted(set(runs[0]) | set(runs[1]))
    table = [[run[outcome] for outcome in outcomes] for run in runs]
    assert len(outcomes) > 2
    assert chi2_contingency(table).pvalue > 0.001


async def test_the_knob_over_http_and_the_counters_it_moves() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        headers = {"Authorization": f"Bearer {server.token}"}
        url = f"{server.url}/admin/batching"
        bad_values = [(-1, "invalid_value"), (17, "invalid_value"), ("4", "invalid_type")]
        for bad, code in [*bad_values, (1.5, "invalid_type")]:
            body = {"num_speculative_tokens": bad}
            async with session.put(url, json=body, headers=headers) as response:
                answer = await response.json()
                assert response.status == 400, answer
                assert answer["error"]["code"] == code
                assert "num_speculative_tokens" in answer["error"]["message"]
        body = {"num_speculative_tokens": 4}
        async with session.put(url, json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
        async with session.get(url) as response:
            assert (await response.json())["num_speculative_tokens"] == 4
        prompt = "".join(chr(ord("a") + n % 13) for n in range(80))  # tiny: a token a byte
        # greedy: tiny falls into a loop, which the proposer then drafts
        body = {"prompt": prompt, "max_tokens": 100, "ignore_eos": True, "temperature": 0}
        async with session.post(f"{server.url}/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
        samples = await scrape(session, server.url)
        per_position = await labelled(
            session, server.url, names.VLLM_SPEC_DECODE_ACCEPTED_PER_POS, "position"
        )
    drafted = samples[(names.SPEC_DRAFT_TOKENS_TOTAL, "")]
    accepted = samples[(names.SPEC_ACCEPTED_TOKENS_TOTAL, "")]
    assert 0 < accepted <= drafted
    assert samples[(names.VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS, "")] == drafted
    assert samples[(names.VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS, "")] == accepted
    assert 0 < samples[(names.VLLM_SPEC_DECODE_NUM_DRAFTS, "")] <= drafted
    assert sum(per_position.values()) == accepted
    assert per_position[("0",)] >= per_position.get(("3",), 0)


async def test_logprobs_of_verified_tokens_are_the_models() -> None:
    """A verified position's log-probabilities come from the same logits a decode step
    would compute (the prefill path's, so equal to float tolerance)."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=2)
    runs = []
    for k in (0, 4):
        observer = RecordingObserver()
        engine = await started("continuous", observer, num_speculative_tokens=k)
        try:
            runs.append(await collect(engine.submit(TINY_PROMPTS[0], params)))
        finally:
            await engine.shutdown()
    plain, speculated = runs
    assert observer.spec_accepted > 0
    assert [e.token_id for e in speculated] == [e.token_id for e in plain]
    for ours, theirs in zip(speculated, plain, strict=True):
        assert ours.logprob == pytest.approx(theirs.logprob, abs=1e-4)
        assert [t for t, _ in ours.top_logprobs] == [t for t, _ in theirs.top_logprobs]
