"""The two batching policies, observed through the engine's public API."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
from batchpilot_server.engine_api import Execution, SamplingParams

from tests.support.engine_helpers import RecordingObserver, collect, prompt, started

LENGTHS = (10, 50, 100, 200)


def forced(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


async def run_hostage_example(mode: str, observer: RecordingObserver) -> list[int]:
    """The README's example, four requests sent together; returns the step each one completed at."""
    # the timeout is generous so that all four surely arrive before it ends
    engine = await started(mode, observer, max_batch_size=8, batch_timeout_ms=100)
    try:
        streams = [engine.submit(prompt(engine, n), forced(n)) for n in LENGTHS]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    assert [len(events) for events in outputs] == list(LENGTHS)
    assert all(events[-1].finish_reason == "length" for events in outputs)
    return [events[-1].step for events in outputs]


async def test_dynamic_holds_every_response_until_the_longest_ends() -> None:
    observer = RecordingObserver()
    completed = await run_hostage_example("dynamic", observer)
    assert observer.batches == [4]  # one batch, fired by the timeout (8 never arrived)
    # the oldest waited the whole timeout; the others arrived microseconds later
    assert max(observer.scheduled) >= 0.1
    assert len(set(completed)) == 1
    held = sorted(observer.hostage)
    assert held[0] < held[1] < held[2] < held[3]  # the 200-token one waits for nobody
    assert held[0] < 0.01


async def test_continuous_completes_each_request_at_its_own_step() -> None:
    observer = RecordingObserver()
    completed = await run_hostage_example("continuous", observer)
    assert completed == sorted(completed) and len(set(completed)) == 4
    assert [b - a for a, b in itertools.pairwise(completed)] == [
        b - a for a, b in itertools.pairwise(LENGTHS)
    ]
    assert observer.hostage == []


async def test_dynamic_fires_at_max_size_before_the_timeout() -> None:
    observer = RecordingObserver()
    engine = await started("dynamic", observer, max_batch_size=4, batch_timeout_ms=60_000)
    try:
        streams = [engine.submit(prompt(engine, n), forced(8)) for n in range(4)]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    assert observer.batches == [4]
    assert [len(events) for events in outputs] == [8] * 4
    assert max(observer.scheduled) < engine.config.batch_timeout_s


async def test_dynamic_fires_a_partial_batch_at_the_timeout() -> None:
    observer = RecordingObserver()
    # A timeout far above a busy machine's scheduling hiccups: the three arrive within it.
    engine = await started("dynamic", observer, max_batch_size=8, batch_timeout_ms=1000)
    try:
        prompts = [prompt(engine, n) for n in range(3)]  # tokenized before the first arrives
        streams = [engine.submit(p, forced(4)) for p in prompts]
        await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    assert observer.batches == [3]
    # the batch fired once the oldest had waited the timeout; the others arrived after it,
    # by as long as a busy machine takes between the submits
    assert max(observer.scheduled) >= engine.config.batch_timeout_s


async def test_dynamic_cuts_a_batch_that_would_overflow_the_kv_pool() -> None:
    observer = RecordingObserver()
    engine = await started(
        "dynamic", observer, kv_cache_mb=0.5, max_batch_size=4, batch_timeout_ms=60_000
    )
    try:
        prompts = [prompt(engine, n) for n in range(4)]
        streams = [engine.submit(p, forced(40)) for p in prompts]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
        total = engine.stats().kv_blocks_total
    finally:
        await engine.shutdown()
    per_request = -(-(len(prompts[0]) + 40) // 16)  # reserved up front, 16-token blocks
    fit = total // per_request
    assert 1 <= fit < 4  # the pool really is too small for the whole batch
    assert observer.batches[0] == fit and sum(observer.batches) == 4
    # the cut-off requests fired next without waiting out the minute-long timeout
    assert max(observer.scheduled) < engine.config.batch_timeout_s
    assert [len(events) for events in outputs] == [40] * 4


async def test_continuous_admits_prompts_within_the_prefill_token_budget() -> None:
    # equal prompts: without the prefix cache, which would skip the ones computed already
    engine = await started(
        "continuous", max_batch_size=8, prefill_token_budget=64, prefix_caching=False
    )
    try:
        prompts = [[256, *range(1, 40)] for _ in range(4)]  # 40 tokens, the budget 64 a step
        streams = [engine.submit(p, forced(4)) for p in prompts]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    first_steps = [events[0].step for events in outputs]
    # prompts fill each step's budget in arrival order, the one that does not fit
    # whole continuing in chunks: request n's last prompt token is computed in the
    # step where the running total 40 * (n + 1) crosses a multiple of 64
    assert first_steps == [-(-40 * (n + 1) // 64) for n in range(4)]


async def test_static_waits_past_the_timeout_until_the_batch_is_full() -> None:
    observer = RecordingObserver()
    # a dynamic batch would fire 1 ms after the first request; a static one waits for 4
    engine = await started("static", observer, max_batch_size=4, batch_timeout_ms=1)
    try:
        first = [engine.submit(prompt(engine, n), forced(4)) for n in range(3)]
        submitted = time.monotonic()
        await asyncio.sleep(0.05)  # let far more than the timeout pass
        assert engine.stats().steps == 0
        last = engine.submit(prompt(engine, 3), forced(4))
        waited = time.monotonic() - submitted
        outputs = await asyncio.gather(*(collect(s) for s in [*first, last]))
    finally:
        await engine.shutdown()
    assert observer.batches == [4]
    assert [len(events) for events in outputs] == [4] * 4
    assert sorted(observer.scheduled)[-1] >= waited


async def test_the_static_safety_valve_fires_a_partial_batch() -> None:
    observer = RecordingObserver()
    engine = await started("static", observer, max_batch_size=8, max_wait_ms=30)
    try:
        events = await collect(engine.submit(prompt(engine, 1), forced(4)))
    finally:
        await engine.shutdown()
    assert len(events) == 4 and observer.batches == [1]
    assert observer.scheduled[0] >= 0.030


async def padded_or_ragged(execution: Execution, observer: RecordingObserver) -> list[list[int]]:
    """Prompts of different lengths and outputs of 3..40 tokens in one dynamic batch."""
    engine = await started(
        "dynamic", observer, max_batch_size=4, batch_timeout_ms=60_000, dynamic_execution=execution
    )
    try:
        prompts = [prompt(engine, n) + [65] * (9 * n) for n in range(4)]
        streams = [
            engine.submit(p, forced(m)) for p, m in zip(prompts, (3, 40, 11, 25), strict=True)
        ]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    return [[e.token_id for e in events] for events in outputs]


async def test_padded_execution_yields_ragged_greedy_outputs_and_counts_its_padding() -> None:
    ragged, padded = RecordingObserver(), RecordingObserver()
    assert await padded_or_ragged("padded", padded) == await padded_or_ragged("ragged", ragged)
    # the 40-token member keeps the batch going: the others are held for 37, 29, 15 steps
    held = 37 + 29 + 15
    assert ragged.slot_steps["finished"] == held
    assert padded.slot_steps["finished"] == 0
    assert padded.slot_steps["padding"] - ragged.slot_steps["padding"] == held
    # the prefill rectangle pads the three shorter prompts to the longest in both
    assert ragged.slot_steps["padding"] > 0
    assert padded.slot_steps["active"] == ragged.slot_steps["active"]
    # one decode forward per step in both: padded runs 4 rows in each
    assert max(size for size, _ in padded.steps) == 4
    assert [size for size, _ in ragged.steps][-1] == 1


@pytest.mark.parametrize("mode", ["static", "dynamic", "continuous"])
async def test_every_step_reports_its_work_once(mode: str) -> None:
    """Each engine step is one step observation (the step-duration histogram's count)
    and one work report, whose sums are what the requests computed: each prompt once
    (short prompts: no full block to find in the prefix cache), then a decode row per
    token after the first, attending the context so far."""
    observer = RecordingObserver()
    outputs = (3, 6, 9)
    engine = await started(mode, observer, max_batch_size=3, batch_timeout_ms=100)
    try:
        prompts = [prompt(engine, n) for n in range(len(outputs))]
        streams = [engine.submit(ids, forced(n)) for ids, n in zip(prompts, outputs, strict=True)]
        await asyncio.gather(*(collect(s) for s in streams))
        steps = engine.stats().steps
    finally:
        await engine.shutdown()
    lengths = [len(ids) for ids in prompts]
    kv = sum(p + sum(p + j for j in range(1, g)) for p, g in zip(lengths, outputs, strict=True))
    assert len(observer.steps) == len(observer.work) == steps
    decode, prefill, attended = (sum(column) for column in zip(*observer.work, strict=True))
    assert (decode, prefill, attended) == (sum(outputs) - len(outputs), sum(lengths), kv)
