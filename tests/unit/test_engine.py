"""Engine behaviour through its public API: correctness of decoding, sampling,
request errors, reconfiguration and shutdown."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest
import torch
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine import model_build, weights
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine.kv_cache import bytes_per_block
from batchpilot_server.engine.models import build_model, get_spec
from batchpilot_server.engine.weights import LoadedModel, ModelLoadError
from batchpilot_server.engine_api import (
    DeadlineExceededError,
    EngineOptions,
    EngineStoppedError,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
)

from tests.support.engine_helpers import ATTENTIONS, RecordingObserver, collect, prompt, started

MODES = ("dynamic", "continuous")
GREEDY_16 = SamplingParams(max_tokens=16, ignore_eos=True)
IDLE_S = 0.3


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("mode", MODES)
async def test_paged_decoding_matches_full_recompute(mode: str, attention: str) -> None:
    """Every token's log-probability, computed through the paged cache in a
    ragged batch, equals the one from recomputing the whole sequence."""
    engine = await started(mode, max_batch_size=4, attention=attention)  # type: ignore[arg-type]
    try:
        assert engine.attention == attention
        prompts = [prompt(engine, n) + [7] * (13 * n) for n in range(4)]  # 4 lengths
        streams = [
            engine.submit(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts
        ]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    model = build_model("tiny", "cpu")
    for ids, events in zip(prompts, outputs, strict=True):
        tokens = [e.token_id for e in events]
        reference = torch.log_softmax(model.full_logits(ids + tokens), -1)[len(ids) - 1 : -1]
        assert tokens == reference.argmax(-1).tolist()
        expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        got = torch.tensor([e.logprob for e in events])
        assert torch.allclose(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", MODES)
async def test_batching_never_changes_a_greedy_result(mode: str) -> None:
    engine = await started(mode, max_batch_size=16)
    try:
        alone = await collect(engine.submit(prompt(engine, 3), GREEDY_16))
        streams = [engine.submit(prompt(engine, n), GREEDY_16) for n in range(16)]
        batched = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    assert [e.token_id for e in batched[3]] == [e.token_id for e in alone]
    assert len({tuple(e.token_id for e in events) for events in batched}) > 1


async def test_seeded_sampling_is_reproducible() -> None:
    engine = await started("continuous")
    try:

        def sampled(seed: int) -> SamplingParams:
            return SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=seed)

        streams = [engine.submit(prompt(engine, 1), sampled(s)) for s in (5, 5, 6)]
        first, again, other = (
            [e.token_id for e in events]
            for events in await asyncio.gather(*(collect(s) for s in streams))
        )
    finally:
        await engine.shutdown()
    assert first == again
    assert first != other


async def test_stop_tokens_and_eos_end_a_sequence() -> None:
    engine = await started("continuous")
    try:
        free = await collect(engine.submit(prompt(engine, 2), GREEDY_16))
        stop_at = free[5].token_id
        stopped = await collect(
            engine.submit(
                prompt(engine, 2), SamplingParams(max_tokens=16, stop_token_ids=(stop_at,))
            )
        )
    finally:
        await engine.shutdown()
    first = next(i for i, e in enumerate(free) if e.token_id == stop_at)
    assert [e.token_id for e in stopped] == [e.token_id for e in free[: first + 1]]
    assert stopped[-1].finish_reason == "stop"
    assert free[-1].finish_reason == "length" and free[-1].index == 15


async def test_queue_full_is_refused_and_shrinking_keeps_admitted_requests() -> None:
    # a dynamic batch waits for 8 requests for up to a minute: the queue only fills
    engine = await started("dynamic", max_batch_size=8, batch_timeout_ms=60_000, max_queue_size=3)
    try:
        streams = [engine.submit(prompt(engine, n), GREEDY_16) for n in range(3)]
        with pytest.raises(QueueFullError, match="max_queue_size 3"):
            engine.submit(prompt(engine, 9), GREEDY_16)
        engine.reconfigure(
            BatchingConfig(max_batch_size=3, batch_timeout_ms=60_000, max_queue_size=1)
        )
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    assert [len(events) for events in outputs] == [16, 16, 16]


@pytest.mark.parametrize("mode", MODES)
async def test_a_request_waiting_past_its_deadline_fails(mode: str) -> None:
    engine = await started(mode, max_batch_size=8, batch_timeout_ms=60_000)
    try:
        stream = engine.submit(prompt(engine, 1), GREEDY_16, deadline_s=0.05)
        with pytest.raises(DeadlineExceededError, match="without being scheduled"):
            await collect(stream)
        assert engine.stats().waiting == 0
    finally:
        await engine.shutdown()


async def test_a_small_kv_pool_caps_the_context_and_longer_requests_are_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A request the pool could never hold is refused at once (it would wait forever):
    max_model_len is the model's context capped to the pool, and start says so."""
    spec = get_spec("tiny")
    pool_tokens = 8 * 16  # 0.5 MiB: 8 blocks of 16 tokens
    assert 8 * bytes_per_block(spec, 16, torch.float32) == 0.5 * 2**20
    with caplog.at_level(logging.WARNING, logger="batchpilot_server.engine.model_build"):
        engine = await started("continuous", kv_cache_mb=0.5)
    try:
        assert engine.max_model_len == pool_tokens < spec.max_seq_len
        warning = " ".join(r.getMessage() for r in caplog.records)
        assert f"holds {pool_tokens} tokens" in warning and f"of {spec.max_seq_len}" in warning
        assert "--kv-cache-mb" in warning
        with pytest.raises(PromptTooLongError, match=f"exceeds the context of {pool_tokens}"):
            engine.submit([1] * 100, SamplingParams(max_tokens=pool_tokens - 99))
        fits = await collect(
            engine.submit([1] * 100, SamplingParams(max_tokens=pool_tokens - 100, ignore_eos=True))
        )
        assert len(fits) == pool_tokens - 100
    finally:
        await engine.shutdown()


@pytest.mark.parametrize("mode", MODES)
async def test_reconfigure_while_running_fails_no_request(mode: str) -> None:
    engine = await started(mode, max_batch_size=8, batch_timeout_ms=1)
    try:
        first = [engine.submit(prompt(engine, n), GREEDY_16) for n in range(8)]
        head = await first[0].__anext__()  # the first wave is running
        smaller = BatchingConfig(max_batch_size=2, batch_timeout_ms=1, max_queue_size=64)
        engine.reconfigure(smaller)
        assert engine.config == smaller
        later = [engine.submit(prompt(engine, n), GREEDY_16) for n in range(6)]
        first_rest = await asyncio.gather(*(collect(s) for s in first[1:]))
        later_out = await asyncio.gather(*(collect(s) for s in later))
    finally:
        await engine.shutdown()
    assert [len(events) for events in [[head], *first_rest]] == [1] + [16] * 7
    assert [len(events) for events in later_out] == [16] * 6
    # once the first wave is gone, no step runs more than the new max_batch_size
    first_end = max(e.step for events in first_rest for e in events)
    per_step: dict[int, int] = {}
    for events in later_out:
        for event in events:
            if event.finish_reason is None and event.step > first_end:
                per_step[event.step] = per_step.get(event.step, 0) + 1
    assert per_step and max(per_step.values()) <= 2


async def test_shutdown_finishes_running_and_refuses_unscheduled() -> None:
    engine = await started("dynamic", max_batch_size=1, batch_timeout_ms=0)
    # long enough that the batch surely still runs when shutdown begins
    running = engine.submit(prompt(engine, 1), SamplingParams(max_tokens=300, ignore_eos=True))
    await running.__anext__()
    queued = engine.submit(prompt(engine, 2), GREEDY_16)
    await engine.shutdown()
    assert len(await collect(running)) == 299  # the first event was read above
    with pytest.raises(EngineStoppedError, match="shutting down"):
        await collect(queued)
    with pytest.raises(EngineStoppedError, match="not running"):
        engine.submit(prompt(engine, 3), GREEDY_16)


async def test_shutdown_with_drain_serves_every_admitted_request() -> None:
    engine = await started("dynamic", max_batch_size=1, batch_timeout_ms=0)
    streams = [engine.submit(prompt(engine, n), GREEDY_16) for n in range(3)]
    await engine.shutdown(drain=True)
    assert [len(await collect(s)) for s in streams] == [16, 16, 16]


@pytest.mark.parametrize("mode", MODES)
async def test_abort_ends_every_admitted_request_at_once_and_frees_the_pool(mode: str) -> None:
    engine = await started(mode, max_batch_size=2, batch_timeout_ms=0)
    long = SamplingParams(max_tokens=900, ignore_eos=True)
    streams = [engine.submit(prompt(engine, n), long) for n in range(5)]
    await streams[0].__anext__()  # a batch of two runs, three wait
    engine.abort("grace period over")
    for stream in streams:
        with pytest.raises(EngineStoppedError, match="grace period over"):
            await collect(stream)
    await engine.shutdown()
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.kv_blocks_used) == (0, 0, 0)
    assert stats.steps < 900  # nothing ran to its end
    with pytest.raises(EngineStoppedError):
        engine.submit(prompt(engine, 9), GREEDY_16)


async def test_engine_reports_what_the_server_needs() -> None:
    observer = RecordingObserver()
    engine = Engine(
        EngineOptions(mode="continuous", config=BatchingConfig(), device="auto", kv_cache_mb=4),
        observer,
    )
    assert engine.device in ("cpu", "cuda") and engine.model_name == "tiny"
    assert engine.mode == "continuous"
    with pytest.raises(RuntimeError, match="loads its model in start"):
        engine.tokenizer  # noqa: B018
    with pytest.raises(EngineStoppedError):
        engine.submit([1], GREEDY_16)
    await engine.start()
    assert engine.max_model_len == 1024 and engine.tokenizer.eos_ids == {257}
    began = time.perf_counter()
    try:
        await asyncio.sleep(IDLE_S)  # the engine waits for work: that is not busy
        events = await collect(engine.submit(prompt(engine, 4), GREEDY_16))
        stats = engine.stats()
    finally:
        await engine.shutdown()
    wall = time.perf_counter() - began
    # K and V x 4 layers x 2 KV heads x 16 tokens x head_dim 64 x float32
    assert stats.kv_blocks_total == 4 * 2**20 // (2 * 4 * 2 * 16 * 64 * 4)
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.steps == 16
    assert [e.index for e in events] == list(range(16))
    assert len(observer.scheduled) == 1 and len(observer.steps) == 16
    # busy once per step, around the forward it times: never less than the forwards
    assert len(observer.busy) == 16
    assert sum(observer.busy) >= sum(duration for _, duration in observer.steps)
    assert sum(observer.busy) <= wall - IDLE_S


class ThreadRecordingObserver(RecordingObserver):
    """Also keeps which threads ran the model steps."""

    def __init__(self) -> None:
        super().__init__()
        self.step_threads: set[int] = set()

    def on_step(self, batch_size: int, duration_s: float) -> None:
        self.step_threads.add(threading.get_ident())
        super().on_step(batch_size, duration_s)


async def test_the_thread_that_steps_the_model_is_the_one_that_built_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's OpenMP runtime keeps a team of workers for each thread that ran a parallel
    op; a loader thread's idle team beside the engine thread's puts more workers than
    CPUs, and the workers then sleep at every barrier of every step (server/engine/core.py
    `_main`). So the engine thread loads the model itself."""
    loaded_in: list[int] = []

    def load_model(*args: object, **kwargs: object) -> LoadedModel:
        loaded_in.append(threading.get_ident())
        return weights.load_model(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(model_build, "load_model", load_model)
    observer = ThreadRecordingObserver()
    engine = await started("continuous", observer)
    try:
        await collect(engine.submit(prompt(engine, 4), GREEDY_16))
    finally:
        await engine.shutdown()
    assert len(loaded_in) == 1 and loaded_in[0] != threading.get_ident()
    assert observer.step_threads == set(loaded_in)


async def test_a_model_that_fails_to_load_fails_start_and_serves_nothing() -> None:
    engine = Engine(
        EngineOptions(
            mode="continuous", config=BatchingConfig(), model="/no/such/model", device="cpu"
        )
    )
    with pytest.raises(ModelLoadError, match="neither a preset"):
        await engine.start()
    with pytest.raises(EngineStoppedError):
        engine.submit([1], GREEDY_16)
    await engine.shutdown()  # returns: the thread ended with the failed load


class FailingObserver(RecordingObserver):
    """An observer that breaks on the first model step, as a faulty metrics sink would."""

    def on_step(self, batch_size: int, duration_s: float) -> None:
        raise RuntimeError("metrics sink is broken")


async def test_an_internal_failure_ends_every_stream_with_the_reason() -> None:
    engine = await started("continuous", FailingObserver())
    try:
        stream = engine.submit(prompt(engine, 1), GREEDY_16)
        with pytest.raises(EngineStoppedError, match="internal error: RuntimeError: metrics sink"):
            await collect(stream)
        with pytest.raises(EngineStoppedError, match="metrics sink is broken"):
            engine.submit(prompt(engine, 2), GREEDY_16)
    finally:
        await engine.shutdown()
