"""The sampler's outputs through the engine on `tiny`: prompt and top log-probabilities
(chunked prefill included) against recomputing each sequence in full, and the
penalties and masks acting on what the engine streams."""

from __future__ import annotations

import asyncio

import torch
from batchpilot_server.engine.models import build_model
from batchpilot_server.engine_api import SamplingParams, TokenEvent

from tests.support.engine_helpers import collect, prompt, started

# the same forwards in another batch shape and order of sums (test_engine.py's bound)
TOLERANCE = 1e-4


def assert_top(top: tuple[tuple[int, float], ...], row: torch.Tensor, k: int) -> None:
    """`top` is the k most likely (id, logprob) of the reference row `row`."""
    assert len(top) == k
    ids = [token for token, _ in top]
    values = torch.tensor([value for _, value in top])
    torch.testing.assert_close(values, row[ids], rtol=0, atol=TOLERANCE)
    assert values.tolist() == sorted(values.tolist(), reverse=True)
    assert float(row[ids].min()) >= float(row.topk(k).values[-1]) - TOLERANCE


async def test_prompt_and_top_logprobs_equal_a_full_recompute() -> None:
    """Prompts of 1 to 70 tokens prefilled in chunks of 16 beside each other."""
    engine = await started("continuous", prefill_token_budget=16)
    try:
        prompts = [prompt(engine, 1)[:1], prompt(engine, 2), prompt(engine, 3) + [7] * 60]
        params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=4, prompt_logprobs=2)
        streams = [engine.submit(p, params) for p in prompts]
        outputs = await asyncio.gather(*(collect(s) for s in streams))
    finally:
        await engine.shutdown()
    model = build_model("tiny", "cpu")
    for ids, events in zip(prompts, outputs, strict=True):
        tokens = [e.token_id for e in events]
        reference = torch.log_softmax(model.full_logits(ids + tokens), -1)
        first, *rest = events[0].prompt_logprobs or ()
        assert first is None and len(rest) == len(ids) - 1
        assert all(e.prompt_logprobs is None for e in events[1:])
        for position, entry in enumerate(rest, start=1):
            assert entry is not None and entry.token_id == ids[position]
            assert abs(entry.logprob - float(reference[position - 1, ids[position]])) <= TOLERANCE
            assert_top(entry.top, reference[position - 1], 2)
        for event in events:
            assert_top(event.top_logprobs, reference[len(ids) - 1 + event.index], 4)


async def test_no_logprobs_asked_none_given() -> None:
    engine = await started("continuous")
    try:
        events = await collect(engine.submit(prompt(engine, 1), SamplingParams(max_tokens=3)))
    finally:
        await engine.shutdown()
    assert all(e.top_logprobs == () and e.prompt_logprobs is None for e in events)


async def test_penalties_and_masks_act_on_the_stream() -> None:
    """Greedy, tiny repeats itself: a strong presence penalty forbids any repeat, a
    bias forces its token, min_tokens holds back a stop token that greedy picks first."""
    engine = await started("continuous")

    def run(params: SamplingParams) -> asyncio.Task[list[TokenEvent]]:
        return asyncio.ensure_future(collect(engine.submit(prompt(engine, 4), params)))

    try:
        plain = await run(SamplingParams(max_tokens=24, ignore_eos=True))
        stop = plain[0].token_id
        unrepeated, forced, held = await asyncio.gather(
            run(SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=100.0)),
            run(SamplingParams(max_tokens=8, ignore_eos=True, logit_bias=((65, 100.0),))),
            run(SamplingParams(max_tokens=8, stop_token_ids=(stop,), min_tokens=5)),
        )
    finally:
        await engine.shutdown()
    greedy = [e.token_id for e in plain]
    assert len(set(greedy)) < len(greedy)  # what the penalty has to change
    assert len({e.token_id for e in unrepeated}) == len(unrepeated) == 24
    assert [e.token_id for e in forced] == [65] * 8
    held_ids = [e.token_id for e in held]
    assert stop not in held_ids[:5]
    assert len(held_ids) >= 5 and held[-1].finish_reason in ("stop", "length")
