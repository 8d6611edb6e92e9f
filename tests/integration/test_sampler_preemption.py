"""The sampler's per-sequence state through preemption, on `tiny`: a long prompt
preempted part-way through its chunked prefill gathers its prompt log-probabilities
anew when prefilled again, and penalized, seeded sequences beside it give the tokens
they give with room to spare."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch
from batchpilot_server.engine import core as engine_module
from batchpilot_server.engine.kv_cache import bytes_per_block
from batchpilot_server.engine.models import get_spec
from batchpilot_server.engine.sampling import gather_prompt_logprobs
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import PromptLogprob, SamplingParams, TokenEvent

from tests.support.engine_helpers import RecordingObserver, collect, started

BLOCK = 16
SHORT = SamplingParams(
    max_tokens=60,
    ignore_eos=True,
    temperature=0.9,
    top_p=0.9,
    seed=3,
    repetition_penalty=1.2,
    frequency_penalty=0.5,
)
LONG = SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=2, logprobs=2)


async def run(prompts: list[list[int]], kv_cache_mb: float) -> tuple[int, list[list[TokenEvent]]]:
    """Preemptions, and every request's events; the long prompt is the last."""
    observer = RecordingObserver()
    engine = await started(
        "continuous",
        observer,
        kv_cache_mb=kv_cache_mb,
        prefill_token_budget=64,
        max_batch_size=len(prompts),  # all start at step 1
        batch_timeout_ms=60_000,
    )
    try:
        params = [SHORT] * (len(prompts) - 1) + [LONG]
        streams = [engine.submit(p, q) for p, q in zip(prompts, params, strict=True)]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    return observer.preemptions, outputs


async def test_state_survives_preemption_mid_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Four short sequences decode while the long one is prefilled in chunks of 64; the
    pool holds all five only until the short ones each need a second block."""
    starts: list[int] = []  # prefills of the long prompt from its first token

    def noting_starts(seq: Sequence, start: int, logits: torch.Tensor) -> list[PromptLogprob]:
        if start == 0:
            starts.append(seq.num_prompt)
        return gather_prompt_logprobs(seq, start, logits)

    monkeypatch.setattr(engine_module, "gather_prompt_logprobs", noting_starts)
    rng = random.Random(9)
    shorts = [rng.choices(range(256), k=12) for _ in range(4)]
    long_prompt = rng.choices(range(256), k=400)
    blocks = len(shorts) + -(-(len(long_prompt) + 1) // BLOCK) + 1
    tight_mb = blocks * bytes_per_block(get_spec("tiny"), BLOCK, torch.float32) / 2**20
    prompts = [*shorts, long_prompt]
    roomy, expected = await run(prompts, 16.0)
    assert roomy == 0 and starts == [len(long_prompt)]
    tight, outputs = await run(prompts, tight_mb)
    assert tight > 0 and starts[1:] == [len(long_prompt)] * 2  # preempted mid-prefill
    assert [[e.token_id for e in out] for out in outputs] == [
        [e.token_id for e in out] for out in expected
    ]
    ours, reference = outputs[-1][0].prompt_logprobs, expected[-1][0].prompt_logprobs
    assert ours is not None and reference is not None and len(ours) == len(long_prompt)
    for entry, wanted in zip(ours[1:], reference[1:], strict=True):
        assert entry is not None and wanted is not None
        assert entry.token_id == wanted.token_id
        assert abs(entry.logprob - wanted.logprob) <= 1e-4
        assert [t for t, _ in entry.top] == [t for t, _ in wanted.top]
