"""The sampler on SmolLM2-135M-Instruct against transformers: log-probabilities (each
generated token's, its top-k, the prompt's) equal transformers' log_softmax of the
same logits in float32, and greedy decoding with logit_bias, repetition_penalty and
min_tokens is token for token transformers' `generate` with sequence_bias,
repetition_penalty and min_new_tokens (it applies them in the same order).

One engine serves the module; its prefill budget of 12 tokens splits the longer
prompts into chunks, whose prompt log-probabilities the sequence gathers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine_api import EngineOptions, SamplingParams
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from tests.support.engine_helpers import collect
from tests.support.smollm2 import LOGIT_TOLERANCE

# a logprob is a logit less the row's logsumexp: each within LOGIT_TOLERANCE (measured
# 2.9e-5 on this machine, chunked prefill and batched decode against one full forward)
LOGPROB_TOLERANCE = 2 * LOGIT_TOLERANCE
PROMPTS = [
    "Hi",
    "The history of the Roman Empire is long and full of wars, emperors, roads and "
    "aqueducts; its fall is still argued over by historians, who",
    "def fibonacci(n):\n",
]
PREFILL_BUDGET = 12
CHAT = [{"role": "user", "content": "Say yes or no."}]  # greedy: "Yes.", then EOS
MIN_TOKENS, MAX_TOKENS = 8, 16

# one event loop for the module: the engine answers on the loop it started on
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.asyncio(loop_scope="module")]


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> PreTrainedModel:
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(smollm2_dir: Path) -> AsyncIterator[Engine]:
    options = EngineOptions(
        mode="continuous",
        config=BatchingConfig(
            max_batch_size=8, batch_timeout_ms=20, prefill_token_budget=PREFILL_BUDGET
        ),
        model=str(smollm2_dir),
        device="cpu",
        dtype="float32",  # compared with transformers in float32
        threads=1,
    )
    engine = Engine(options)
    await engine.start()
    yield engine
    await engine.shutdown()


def transformers_logprobs(model: PreTrainedModel, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def worst_top_error(top: tuple[tuple[int, float], ...], row: torch.Tensor, k: int) -> float:
    """How far `top` is from the reference row's k best: its values against the row's,
    and its least member against the row's k-th (near-ties may swap places)."""
    assert len(top) == k
    ids = [token for token, _ in top]
    values = torch.tensor([value for _, value in top])
    error = float((values - row[ids]).abs().max())
    return max(error, float(row.topk(k).values[-1] - row[ids].min()))


async def test_logprobs_equal_transformers_log_softmax(
    engine: Engine, reference: PreTrainedModel
) -> None:
    tokenizer = engine.tokenizer
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    assert max(len(ids) for ids in prompts) > 2 * PREFILL_BUDGET  # three chunks at least
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, prompt_logprobs=3)
    streams = [engine.submit(ids, params) for ids in prompts]
    outputs = await asyncio.gather(*(collect(s) for s in streams))
    worst = 0.0
    for ids, events in zip(prompts, outputs, strict=True):
        tokens = [e.token_id for e in events]
        theirs = transformers_logprobs(reference, ids + tokens)
        first, *rest = events[0].prompt_logprobs or ()
        assert first is None and [entry.token_id for entry in rest] == ids[1:]
        for position, entry in enumerate(rest, start=1):
            row = theirs[position - 1]
            worst = max(worst, abs(entry.logprob - float(row[ids[position]])))
            worst = max(worst, worst_top_error(entry.top, row, 3))
        for event in events:
            row = theirs[len(ids) - 1 + event.index]
            assert event.logprob is not None
            worst = max(worst, abs(event.logprob - float(row[event.token_id])))
            worst = max(worst, worst_top_error(event.top_logprobs, row, 5))
    assert worst <= LOGPROB_TOLERANCE


async def test_greedy_with_bias_repetition_and_min_tokens_is_transformers_generate(
    engine: Engine, reference: PreTrainedModel, smollm2_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    eos, blue = tokenizer.eos_token_id, tokenizer.encode(" blue")[0]
    plain = generate(reference, ids, eos)
    processed = generate(
        reference,
        ids,
        eos,
        sequence_bias={(blue,): 4.0},
        repetition_penalty=1.3,
        min_new_tokens=MIN_TOKENS,
    )
    assert eos in plain[:MIN_TOKENS]  # greedy alone ends before min_tokens
    assert eos not in processed[:MIN_TOKENS] and processed != plain
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        logit_bias=((blue, 4.0),),
        repetition_penalty=1.3,
        min_tokens=MIN_TOKENS,
    )
    events = await collect(engine.submit(ids, params))
    assert [e.token_id for e in events] == processed


def generate(model: PreTrainedModel, ids: list[int], eos: int, **knobs: object) -> list[int]:
    """transformers' greedy continuation of `ids`, up to and with its first EOS."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            **knobs,
        )
    return out[0, len(ids) :].tolist()
