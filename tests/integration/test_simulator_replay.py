"""The simulator against the engine users run: one short trace through both.

The trace is built so that nothing in it depends on how long a step takes:
every request is submitted before the first step may fire (a batch waits for
`max_batch_size` requests), so each step's plan follows from the requests and
the KV pool alone. The pool is small enough that continuous mode preempts and
dynamic mode cuts a batch, and the prefill budget small enough that a long
prompt is computed in chunks. Both must then agree on every step: which
requests complete at which step (the engine's final events carry it), the
batch size each step records, and the preemptions. Once more with SLO classes: the
same trace in two classes of different priority, which both serve by class rank (the
first `max_batch_size` requests in arrival order are also the highest ranked, so that a
first step fired before the rest were submitted plans the same).
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import numpy as np
import pytest
from batchpilot_operator.policy.types import Goal
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.engine_api import SamplingParams, TokenEvent
from batchpilot_tools.simulator import SimOptions, StepCurve, Workload, simulate_workload

from tests.support.engine_helpers import RecordingObserver, collect, started

# (prompt tokens, output tokens): long and short mixed, one prompt over the budget
TRACE = [(12, 70), (30, 8), (5, 90), (20, 45), (8, 3), (40, 30), (16, 80), (10, 12),
         (25, 20), (6, 60)]  # fmt: skip
CONFIG = BatchingConfig(max_batch_size=4, batch_timeout_ms=50.0, max_queue_size=64)
KV_CACHE_MB = 1.0  # 16 blocks of 16 tokens for the tiny model: four sequences outgrow it
PREFILL_BUDGET = 32
CURVE = StepCurve.from_points({1: 0.002, 64: 0.02}, "test")
# each request's class (classed runs): the first four high, then mixed
CLASSES = ("hi", "hi", "hi", "hi", "lo", "hi", "lo", "hi", "lo", "lo")
PRIORITIES = {"hi": 5, "lo": 0}
SLO = Slo(e2e_s=10.0, classes=tuple(SloClass(n, p, e2e_s=10.0) for n, p in PRIORITIES.items()))


async def through_the_engine(
    mode: Mode, classed: bool
) -> tuple[dict[int, int], list[int], int, int]:
    """(request -> the step that completed it, recorded batch sizes, preemptions, pool blocks)."""
    observer = RecordingObserver()
    engine = await started(
        mode, observer, kv_cache_mb=KV_CACHE_MB, attention="torch",
        **replace(CONFIG, prefill_token_budget=PREFILL_BUDGET).to_dict(),
    )  # fmt: skip
    try:
        classes = CLASSES if classed else ("default",) * len(TRACE)
        streams = [
            engine.submit(
                [1] * prompt,
                SamplingParams(max_tokens=output, ignore_eos=True),
                slo_class=name,
                priority=PRIORITIES.get(name, 0),
            )
            for (prompt, output), name in zip(TRACE, classes, strict=True)
        ]
        events = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 120)
        blocks = engine.stats().kv_blocks_total
    finally:
        await engine.shutdown()
    finals: list[TokenEvent] = [stream_events[-1] for stream_events in events]
    assert all(e.finish_reason == "length" for e in finals)
    return {i: e.step for i, e in enumerate(finals)}, observer.batches, observer.preemptions, blocks


def through_the_simulator(
    mode: Mode, blocks: int, fast_forward: bool, classed: bool
) -> tuple[dict[int, int], list[int], int]:
    work = Workload(
        arrivals=np.zeros(len(TRACE)),
        prompts=np.array([p for p, _ in TRACE]),
        outputs=np.array([o for _, o in TRACE]),
        classes=CLASSES if classed else (),
    )
    options = SimOptions(
        mode=mode, config=replace(CONFIG, prefill_token_budget=PREFILL_BUDGET),
        goal=Goal(SLO), kv_blocks=blocks,
        tune=False, fast_forward=fast_forward, trace=True,
    )  # fmt: skip
    result = simulate_workload(work, options, CURVE, run_s=60.0)
    assert result.completed == len(TRACE)
    steps = {c.request: c.step for c in result.completions}
    return steps, result.batch_sizes, sum(iv.preemptions for iv in result.intervals)


@pytest.mark.parametrize("classed", [False, True], ids=["one class", "two classes"])
@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
async def test_a_trace_completes_at_the_same_steps_in_the_simulator_and_the_engine(
    mode: Mode, classed: bool
) -> None:
    engine_steps, engine_batches, engine_preemptions, blocks = await through_the_engine(
        mode, classed
    )
    order = sorted(engine_steps, key=lambda i: (engine_steps[i], i))
    for fast_forward in (False, True):
        # in a thread: the simulation runs an event loop of its own
        sim_steps, sim_batches, sim_preemptions = await asyncio.to_thread(
            through_the_simulator, mode, blocks, fast_forward, classed
        )
        assert sorted(sim_steps, key=lambda i: (sim_steps[i], i)) == order
        assert sim_steps == engine_steps
        assert sim_batches == engine_batches
        assert sim_preemptions == engine_preemptions
    # The trace exercises what it is built for.
    if mode == "continuous":
        assert engine_preemptions > 0
    else:
        assert min(engine_batches) < CONFIG.max_batch_size  # a batch cut for KV
