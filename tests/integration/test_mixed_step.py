"""A step with prefill rows and decode rows runs them as one forward
(ModelRunner.step): the same logits the two kinds of row get from forwards of
their own, each projection computed once for the step (the weights read once)."""

from __future__ import annotations

import pytest
import torch
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.models import build_model, get_spec
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import SamplingParams
from torch.profiler import ProfilerActivity, profile

from tests.support import runner_steps
from tests.support.engine_helpers import ATTENTIONS

SPEC = get_spec("tiny")
PARAMS = SamplingParams(max_tokens=8)


@pytest.fixture
def runners(request: pytest.FixtureRequest) -> tuple[ModelRunner, ModelRunner]:
    """Two runners over the same weights, each with a pool of its own."""
    model = build_model("tiny", "cpu")
    pair = tuple(
        ModelRunner(model, KVCache(SPEC, 64, block_size=16, device="cpu"), request.param, 2)
        for _ in range(2)
    )
    return pair  # type: ignore[return-value]


def sequences(runner: ModelRunner, prompts: list[list[int]]) -> list[Sequence]:
    seqs = [Sequence(str(n), p, PARAMS, 0.0, None, None) for n, p in enumerate(prompts)]
    for seq in seqs:
        assert runner.cache.pool.grow(seq.block_table, seq.max_total_tokens)
    return seqs


def decoding(runner: ModelRunner, rows: int) -> list[Sequence]:
    """`rows` sequences with their 20-token prompts computed and one token to feed."""
    seqs = sequences(runner, [[1 + n] * 20 for n in range(rows)])
    runner_steps.prefill(runner, seqs)
    for seq in seqs:
        seq.token_ids.append(7)
    return seqs


@pytest.mark.parametrize("runners", ATTENTIONS, indirect=True)
@torch.inference_mode()
def test_a_mixed_step_gives_the_logits_of_separate_forwards(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    mixed, separate = runners
    # new prompts of uneven length (padding in the prefill rectangle), one of them a
    # chunk that leaves part of its prompt for a later step
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12], [13] * 40]
    chunks = [7, 3, 17]
    old = [decoding(runner, 3) for runner in runners]
    new = [sequences(runner, prompts) for runner in runners]
    got = runner_steps.step(mixed, new[0], old[0], chunks)
    expected = torch.cat(
        (runner_steps.prefill(separate, new[1], chunks), runner_steps.decode(separate, old[1]))
    )
    assert got.shape == (2 + 3, SPEC.vocab_size)  # the chunked row samples nothing yet
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert [seq.num_computed for seq in new[0]] == chunks
    assert [seq.num_computed for seq in old[0]] == [21] * 3


def linear_calls(run: object) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()  # type: ignore[operator]
    names = ("aten::linear", "mkldnn::_linear_pointwise")
    return sum(event.count for event in prof.key_averages() if event.key in names)


@pytest.mark.parametrize("runners", ["auto"], indirect=True)
@torch.inference_mode()
def test_a_mixed_step_computes_each_projection_once(
    runners: tuple[ModelRunner, ModelRunner],
) -> None:
    runner = runners[0]
    alone = decoding(runner, 2)
    decode_only = linear_calls(lambda: runner_steps.decode(runner, alone))
    old, new = decoding(runner, 2), sequences(runner, [[5] * 9])
    both = linear_calls(lambda: runner_steps.step(runner, new, old))
    assert decode_only == 4 * SPEC.n_layers + 1  # q/k/v, o, gate/up, down; the LM head
    assert both == decode_only
