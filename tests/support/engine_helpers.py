"""Shared pieces of the engine tests: a recording observer and stream collection."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.engine.core import Engine, RequestStream
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.models import Decoder
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import (
    AttentionBackend,
    EngineOptions,
    Execution,
    SamplingParams,
    TokenEvent,
)

from tests.support import runner_steps

requires_c_compiler = pytest.mark.skipif(
    shutil.which(os.environ.get("CC", "cc")) is None,
    reason="no C compiler ($CC, else cc) to build the native attention kernel",
)
# both decode attention paths, the native one only where it can be built
ATTENTIONS = [pytest.param("native", marks=requires_c_compiler), "torch"]


@dataclass
class RecordingObserver:
    """Keeps what the engine reports, as the server's metrics would."""

    scheduled: list[float] = field(default_factory=list)
    steps: list[tuple[int, float]] = field(default_factory=list)
    work: list[tuple[int, int, int]] = field(default_factory=list)  # (decode, prefill, kv)
    busy: list[float] = field(default_factory=list)
    batches: list[int] = field(default_factory=list)
    hostage: list[float] = field(default_factory=list)
    preemptions: int = 0
    cache_queried: int = 0
    cache_hit: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    slot_steps: dict[str, int] = field(
        default_factory=lambda: {"active": 0, "finished": 0, "padding": 0}
    )
    lock: threading.Lock = field(default_factory=threading.Lock)

    def on_scheduled(self, queue_wait_s: float) -> None:
        with self.lock:
            self.scheduled.append(queue_wait_s)

    def on_step(self, batch_size: int, duration_s: float) -> None:
        with self.lock:
            self.steps.append((batch_size, duration_s))

    def on_step_work(self, decode_rows: int, prefill_tokens: int, kv_tokens: int) -> None:
        with self.lock:
            self.work.append((decode_rows, prefill_tokens, kv_tokens))

    def on_busy(self, seconds: float) -> None:
        with self.lock:
            self.busy.append(seconds)

    def on_batch(self, batch_size: int) -> None:
        with self.lock:
            self.batches.append(batch_size)

    def on_hostage(self, seconds: float) -> None:
        with self.lock:
            self.hostage.append(seconds)

    def on_preemption(self) -> None:
        with self.lock:
            self.preemptions += 1

    def on_slot_steps(self, active: int, finished: int, padding: int) -> None:
        with self.lock:
            for state, count in (("active", active), ("finished", finished), ("padding", padding)):
                self.slot_steps[state] += count

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        with self.lock:
            self.cache_queried += queried_tokens
            self.cache_hit += hit_tokens

    def on_spec_decode(self, drafted: list[int], accepted: list[int]) -> None:
        with self.lock:
            self.spec_drafted += sum(drafted)
            self.spec_accepted += sum(accepted)


async def started(
    mode: Mode,
    observer: RecordingObserver | None = None,
    kv_cache_mb: float = 16.0,
    attention: AttentionBackend = "auto",
    dynamic_execution: Execution = "ragged",
    max_wait_ms: float | None = None,
    prefix_caching: bool = True,
    model: str = "tiny",
    **config: float,
) -> Engine:
    defaults = {"max_batch_size": 8, "batch_timeout_ms": 20.0, "max_queue_size": 256}
    options = EngineOptions(
        mode=mode,
        # config: BatchingConfig's fields (prefill_token_budget among them)
        config=BatchingConfig(**{**defaults, **config}),  # type: ignore[arg-type]
        device="cpu",
        kv_cache_mb=kv_cache_mb,
        threads=1,  # two torch threads thrash when the 2-core machine is busy with other tests
        attention=attention,
        dynamic_execution=dynamic_execution,
        max_wait_ms=max_wait_ms,
        prefix_caching=prefix_caching,
        model=model,
    )
    engine = Engine(options, observer)
    await engine.start()
    return engine


async def collect(stream: RequestStream) -> list[TokenEvent]:
    return [event async for event in stream]


def prompt(engine: Engine, n: int) -> list[int]:
    """A distinct prompt per n, as the tokenizer would make it."""
    return engine.tokenizer.encode(f"request {n}: " + "abcdefgh"[: n % 8])


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `condition` until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s}s")
        await asyncio.sleep(0.005)


def paged_against_full_recompute(
    model: Decoder, attention: str, prompts: list[list[int]], steps: int
) -> float:
    """Greedy decode of `prompts` through the paged cache, blocks scattered over the
    pool; the largest |logit| difference from recomputing each sequence in full."""
    block_size = 16
    needed = sum(-(-(len(p) + steps) // block_size) for p in prompts)
    cache = KVCache(model.spec, num_blocks=2 * needed, block_size=block_size, device="cpu")
    rng = random.Random(1)
    # take blocks out of order so no sequence's cache is contiguous
    scattered: list[int] = []
    cache.pool.grow(scattered, 2 * needed * block_size)
    cache.pool.release(rng.sample(scattered, len(scattered)))
    runner = ModelRunner(model, cache, attention)  # type: ignore[arg-type]
    assert runner.attention == attention
    seqs = [
        Sequence(str(n), prompt, SamplingParams(max_tokens=steps), 0.0, None, None)
        for n, prompt in enumerate(prompts)
    ]
    for seq in seqs:
        assert cache.pool.grow(seq.block_table, seq.max_total_tokens)
    worst = 0.0
    logits = runner_steps.prefill(runner, seqs)
    for _ in range(steps):
        for seq, row in zip(seqs, logits, strict=True):
            reference = model.full_logits(seq.token_ids)[-1]
            worst = max(worst, float((row - reference).abs().max()))
            seq.token_ids.append(int(row.argmax()))
        logits = runner_steps.decode(runner, seqs)
    return worst
