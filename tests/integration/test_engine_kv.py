"""KV pressure: preemption and recompute, cancellation, and that the pool
never leaks (every block is free again once the work is done). Chunked prefill:
a long prompt computed a budget's worth of tokens per step gives the tokens of
an unchunked prefill and of full recompute, running sequences keep decoding
meanwhile, and a sequence preempted part-way through its prompt still finishes."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine import model_build
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine.kv_cache import KVCache, bytes_per_block
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.models import build_model, get_spec
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import EngineOptions, SamplingParams, TokenEvent
from batchpilot_server.http.protocol import Limits
from batchpilot_server.http.protocol_parse import Served, read_chat
from batchpilot_server.serve import main as serve_main
from batchpilot_server.serve_options import batching_config, engine_options, parser

from tests.support import runner_steps
from tests.support.engine_helpers import (
    ATTENTIONS,
    RecordingObserver,
    collect,
    prompt,
    started,
    wait_until,
)
from tests.support.smollm2 import LOGIT_TOLERANCE, load_float32

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


BUDGET = 128  # prompt tokens per step


def byte_prompt(length: int, seed: int) -> list[int]:
    """`length` token ids of tiny's byte vocabulary."""
    return random.Random(seed).choices(range(256), k=length)


@pytest.mark.parametrize("attention", ATTENTIONS)
async def test_a_long_prompt_prefilled_in_chunks_decodes_as_unchunked(attention: str) -> None:
    long_prompt = byte_prompt(900, seed=5)  # seven chunks of 128 and a part of one
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    outputs = []
    for budget in (BUDGET, len(long_prompt)):
        engine = await started("continuous", prefill_token_budget=budget, attention=attention)
        try:
            outputs.append(await collect(engine.submit(long_prompt, greedy)))
        finally:
            await engine.shutdown()
    chunked, whole = outputs
    tokens = [e.token_id for e in chunked]
    assert tokens == [e.token_id for e in whole]
    # full recompute, no cache: the same greedy tokens with the same log-probabilities
    with torch.inference_mode():
        logits = build_model("tiny", "cpu").full_logits(long_prompt + tokens)
    reference = torch.log_softmax(logits, -1)[len(long_prompt) - 1 : -1]
    assert tokens == reference.argmax(-1).tolist()
    expected = reference.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    for events in outputs:
        got = torch.tensor([e.logprob for e in events])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_chunked_prefill_on_the_real_model_matches_full_recompute(
    smollm2_dir: Path, attention: str
) -> None:
    """SmolLM2 (three query heads per KV head): ragged prompts computed at most 64
    tokens per row and step, resuming mid-block and on block boundaries, then a
    decode step; each sampled row's logits against recomputing the sequence in full
    (measured 6.7e-5 with either attention path)."""
    model = load_float32(str(smollm2_dir)).model
    vocab = model.spec.vocab_size
    prompts = [random.Random(n).choices(range(vocab), k=k) for n, k in enumerate((300, 45, 130))]
    cache = KVCache(model.spec, num_blocks=64, block_size=16, device="cpu")
    runner = ModelRunner(model, cache, attention)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=1)
    seqs = [Sequence(str(n), p, params, 0.0, None, None) for n, p in enumerate(prompts)]
    for seq in seqs:
        assert cache.pool.grow(seq.block_table, seq.max_total_tokens)
    worst = 0.0
    with torch.inference_mode():
        while rows := [seq for seq in seqs if not seq.ready_to_sample]:
            logits = runner_steps.prefill(
                runner, rows, [min(64, seq.num_uncomputed) for seq in rows]
            )
            done = [seq for seq in rows if seq.ready_to_sample]
            for seq, row in zip(done, logits, strict=True):
                reference = model.full_logits(seq.token_ids)[-1]
                worst = max(worst, float((row - reference).abs().max()))
        for seq in seqs:
            seq.token_ids.append(int(model.full_logits(seq.token_ids)[-1].argmax()))
        for seq, row in zip(seqs, runner_steps.decode(runner, seqs), strict=True):
            worst = max(worst, float((row - model.full_logits(seq.token_ids)[-1]).abs().max()))
    assert worst <= LOGIT_TOLERANCE


async def test_running_sequences_decode_every_step_while_a_long_prompt_prefills() -> None:
    # a batch of two fires as soon as both wait: both are admitted at step 1
    engine = await started(
        "continuous", prefill_token_budget=BUDGET, max_batch_size=2, batch_timeout_ms=60_000
    )
    try:
        short, long_prompt = prompt(engine, 1), byte_prompt(900, seed=5)
        running = engine.submit(short, FORCED)
        prefilling = engine.submit(long_prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        short_events, long_events = await asyncio.gather(collect(running), collect(prefilling))
    finally:
        await engine.shutdown()
    # the budget's worth of prompt tokens per step: the long prompt's first token comes
    # only once both prompts are computed...
    steps_to_prefill = -(-(len(short) + len(long_prompt)) // BUDGET)
    assert long_events[0].step == steps_to_prefill > 1
    # ...and the short one, its prompt done at step 1, gains a token at every step
    assert [e.step for e in short_events] == list(range(1, TOKENS + 1))


@dataclass
class PreemptionSteps(RecordingObserver):
    """Also notes how many steps had run when each preemption came."""

    engine: Engine | None = None
    steps_before: list[int] = field(default_factory=list)

    def on_preemption(self) -> None:
        super().on_preemption()
        assert self.engine is not None
        self.steps_before.append(self.engine.stats().steps)


async def test_a_sequence_preempted_mid_prefill_restarts_it_and_completes() -> None:
    """Four short sequences decode while a long prompt is prefilled in chunks of 64;
    the pool has room for all five only until the short ones each need a second
    block, so the newest, the long one, is preempted part-way through its prompt,
    waits for the short ones to finish, and is prefilled again from its first token."""
    shorts = [byte_prompt(12, seed=n) for n in range(4)]
    long_prompt = byte_prompt(400, seed=9)
    prompts = [*shorts, long_prompt]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    block = 16
    # each short prompt plus its first token fits one block; the long one's reserved
    # blocks leave one block for the four short ones' second blocks
    blocks = len(shorts) + -(-(len(long_prompt) + 1) // block) + 1
    kv_cache_mb = blocks * bytes_per_block(get_spec("tiny"), block, torch.float32) / 2**20

    async def run(pool_mb: float) -> tuple[PreemptionSteps, list[list[TokenEvent]]]:
        observer = PreemptionSteps()
        engine = await started(
            "continuous",
            observer,
            kv_cache_mb=pool_mb,
            prefill_token_budget=64,
            max_batch_size=len(prompts),  # all five start at step 1
            batch_timeout_ms=60_000,
        )
        observer.engine = engine
        try:
            streams = [engine.submit(p, params) for p in prompts]
            outputs = await asyncio.gather(*(collect(s) for s in streams))
            await wait_until(lambda: idle(engine))
        finally:
            await engine.shutdown()
        return observer, outputs

    results = [await run(16.0), await run(kv_cache_mb)]
    (roomy, expected), (tight, outputs) = results
    assert roomy.preemptions == 0 and tight.preemptions > 0
    # the first victim is the newest running sequence, the long one: preempted before
    # its first token, so part-way through its prefill
    assert min(tight.steps_before) < outputs[-1][0].step
    assert [[e.token_id for e in out] for out in outputs] == [
        [e.token_id for e in out] for out in expected
    ]
    assert len(tight.scheduled) == len(prompts)  # a preempted request is scheduled only once


def test_the_budget_flag_sets_the_initial_config_and_must_be_positive(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = parser().parse_args(["--prefill-token-budget", "256"])
    assert engine_options(args, batching_config(args)).config.prefill_token_budget == 256
    assert serve_main(["--prefill-token-budget", "0", "--port", "0"]) == 2
    assert "prefill_token_budget must be between 1 and" in capsys.readouterr().err


async def test_the_default_pool_caps_smollm2s_context_so_a_chat_without_max_tokens_runs(
    smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolLM2's 8192-token context needs more than the default 64 MiB of float32 KV:
    the engine serves what the pool holds, and the chat default (what the context
    leaves after the prompt) is admitted and runs instead of being refused."""
    monkeypatch.setattr(model_build, "load_model", lambda source, **_: load_float32(source))
    options = EngineOptions(
        mode="continuous", config=BatchingConfig(), model=str(smollm2_dir), threads=1
    )
    engine = Engine(options)
    await engine.start()
    try:
        spec = load_float32(str(smollm2_dir)).spec
        per_block = bytes_per_block(spec, options.block_size, torch.float32)
        pool_tokens = int(options.kv_cache_mb * 2**20 // per_block) * options.block_size
        assert engine.max_model_len == pool_tokens < spec.max_seq_len
        served = Served("smollm2", engine.max_model_len, engine.tokenizer, Limits())
        chat = read_chat({"messages": [{"role": "user", "content": "Hi"}]}, served)
        assert len(chat.prompt_ids) + chat.max_tokens == pool_tokens
        stream = engine.submit(chat.prompt_ids, SamplingParams(max_tokens=chat.max_tokens))
        assert (await anext(stream)).index == 0
        stream.cancel()
    finally:
        await engine.shutdown()


async def test_a_bfloat16_model_holds_its_kv_in_bfloat16_twice_the_tokens_per_mib() -> None:
    """The engine's cache takes a bfloat16 model's dtype: the same --kv-cache-mb holds
    twice the blocks of a float32 model's, and requests run through it."""
    blocks = {}
    for dtype in ("float32", "bfloat16"):
        options = EngineOptions(
            mode="continuous", config=BatchingConfig(), model="tiny", dtype=dtype,
            kv_cache_mb=4.0, threads=1,
        )  # fmt: skip
        engine = Engine(options)
        await engine.start()
        try:
            blocks[dtype] = engine.stats().kv_blocks_total
            tokens = await collect(engine.submit(prompt(engine, 1), FORCED))
            assert len(tokens) == TOKENS
        finally:
            await engine.shutdown()
    assert blocks["bfloat16"] == 2 * blocks["float32"]
