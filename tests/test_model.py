"""The tiny decoder and its paged forwards, below the engine."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.kv_cache import KVCache
from batchpilot_server.model_runner import ModelRunner
from batchpilot_server.models import PRESETS, Decoder, build_model, get_spec, resolve_device
from batchpilot_server.sequence import Sequence
from engine_helpers import ATTENTIONS


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Two torch threads thrash when the 2-core machine is busy with other tests."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_presets_and_their_errors() -> None:
    spec = get_spec("tiny")
    shape = (spec.d_model, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim)
    assert shape == (256, 4, 4, 2, 64) and spec.architecture == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unknown model 'huge'; known: tiny"):
        get_spec("huge")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")
    assert resolve_device("auto") in ("cpu", "cuda") and set(PRESETS) >= {"tiny"}


def test_weights_come_from_the_seed() -> None:
    ids = [256, 1, 2, 3]
    same = build_model("tiny", "cpu", seed=0).full_logits(ids)
    assert torch.equal(build_model("tiny", "cpu", seed=0).full_logits(ids), same)
    assert not torch.allclose(build_model("tiny", "cpu", seed=1).full_logits(ids), same)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_paged_forwards_match_full_recompute_with_scattered_blocks(attention: str) -> None:
    """A ragged batch whose blocks are interleaved in the pool (as after churn),
    through the C kernel and through the torch fallback."""
    prompts = [[256, *range(1, 3 + 11 * n)] for n in range(4)]
    worst = paged_against_full_recompute(build_model("tiny", "cpu"), attention, prompts, 30)
    assert worst <= 1e-4


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
    logits = runner.prefill(seqs)
    for _ in range(steps):
        for seq, row in zip(seqs, logits, strict=True):
            reference = model.full_logits(seq.token_ids)[-1]
            worst = max(worst, float((row - reference).abs().max()))
            seq.token_ids.append(int(row.argmax()))
        logits = runner.decode(seqs)
    runner.close()
    return worst
