"""KV pressure: preemption and recompute, cancellation, and that the pool
never leaks (every block is free again once the work is done)."""

from __future__ import annotations

import asyncio
import random

import pytest
from batchpilot_server.engine import Engine
from batchpilot_server.engine_api import SamplingParams
from engine_helpers import RecordingObserver, collect, prompt, started, wait_until

TOKENS = 40
FORCED = SamplingParams(max_tokens=TOKENS, ignore_eos=True)


def idle(engine: Engine) -> bool:
    stats = engine.stats()
    return stats.running == 0 and stats.waiting == 0 and stats.kv_blocks_used == 0


async def test_kv_exhaustion_preempts_and_every_request_still_completes() -> None:
    roomy = await started("continuous", max_batch_size=8)
    try:
        prompts = [prompt(roomy, n) for n in range(8)]
        expected = await asyncio.gather(*(collect(roomy.submit(p, FORCED)) for p in prompts))
    finally:
        await roomy.shutdown()
    observer = RecordingObserver()
    tight = await started("continuous", observer, kv_cache_mb=0.5, max_batch_size=8)
    try:
        outputs = await asyncio.gather(*(collect(tight.submit(p, FORCED)) for p in prompts))
        stats = tight.stats()
    finally:
        await tight.shutdown()
    needed = sum(-(-(len(p) + TOKENS) // 16) for p in prompts)
    assert needed > stats.kv_blocks_total  # all eight cannot hold their KV at once
    assert observer.preemptions > 0 and stats.preemptions == observer.preemptions
    # recomputed sequences continue exactly where they were
    assert [[e.token_id for e in out] for out in outputs] == [
        [e.token_id for e in out] for out in expected
    ]
    assert [[e.index for e in out] for out in outputs] == [list(range(TOKENS))] * 8
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert len(observer.scheduled) == 8  # a preempted request is scheduled only once


@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
async def test_random_cancellations_free_every_block(mode: str) -> None:
    rng = random.Random(7)
    engine = await started(mode, kv_cache_mb=0.5, max_batch_size=4, batch_timeout_ms=1)
    try:
        streams = [engine.submit(prompt(engine, n), FORCED) for n in range(12)]
        cancel_after = {n: rng.randrange(1, TOKENS) for n in rng.sample(range(12), 6)}

        async def consume(n: int) -> int:
            count = 0
            async for _ in streams[n]:
                count += 1
                if cancel_after.get(n) == count:
                    streams[n].cancel()
            return count

        # some are cancelled before they ever run
        streams[11].cancel()
        cancel_after[11] = 0
        counts = await asyncio.gather(*(consume(n) for n in range(12)))
        await wait_until(lambda: idle(engine))
    finally:
        await engine.shutdown()
    for n, count in enumerate(counts):
        assert count == cancel_after.get(n, TOKENS)
