"""The log-probabilities the API answers, against transformers' log_softmax of the same
logits in float32 (SmolLM2-135M, real weights): completions' top-k per token and `echo`'s
prompt scores (lm-evaluation-harness's loglikelihood request), chat's `top_logprobs`.

These values come from the engine's batched sampler (server/engine/sampling.py), which computes
the top-k and the prompt's own log-probabilities; the wire shapes are tested without it
in test_openai_fields.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.servers import serve_on_thread
from tests.support.smollm2 import LOGPROB_TOLERANCE

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

PROMPT = "The capital of France is"
K = 5
NEW_TOKENS = 3


@dataclass
class Scored:
    ids: list[int]  # prompt, then the greedy continuation
    logprobs: torch.Tensor  # [len(ids), vocab]: log_softmax of the logits at each position


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path) -> Scored:
    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    ids = tokenizer.encode(PROMPT)
    with torch.inference_mode():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids])).logits[0]
            ids.append(int(logits[-1].argmax()))
        logits = model(torch.tensor([ids])).logits[0].float()
    return Scored(ids, torch.log_softmax(logits, dim=-1))


@pytest.fixture(scope="module")
def url(smollm2_dir: Path) -> Iterator[str]:
    with serve_on_thread(model=str(smollm2_dir), kv_cache_mb=32, dtype="float32") as url:
        yield url


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = requests.post(f"{url}{path}", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _top(scored: Scored, position: int, k: int) -> list[float]:
    """The k best log-probabilities predicting the token at `position`."""
    return scored.logprobs[position - 1].topk(k).values.tolist()


def test_completion_top_logprobs_and_echo_match_log_softmax(url: str, reference: Scored) -> None:
    body = {"prompt": PROMPT, "max_tokens": NEW_TOKENS, "logprobs": K, "echo": True,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    answer = post(url, "/v1/completions", body)
    logprobs = answer["choices"][0]["logprobs"]
    prompt_len = len(reference.ids) - NEW_TOKENS
    assert len(logprobs["token_logprobs"]) == len(reference.ids)
    assert logprobs["token_logprobs"][0] is None
    for position in range(1, len(reference.ids)):
        expected = float(reference.logprobs[position - 1, reference.ids[position]])
        got = logprobs["token_logprobs"][position]
        assert got == pytest.approx(expected, abs=LOGPROB_TOLERANCE), position
        top = logprobs["top_logprobs"][position]
        # k best, plus the chosen token where it is not among them (as vLLM)
        assert K <= len(top) <= K + 1, position
        best = sorted(top.values(), reverse=True)[:K]
        assert best == pytest.approx(_top(reference, position, K), abs=LOGPROB_TOLERANCE)
    # the continuation is greedy: its tokens are the best of each position
    for position in range(prompt_len, len(reference.ids)):
        assert logprobs["token_logprobs"][position] == pytest.approx(
            _top(reference, position, 1)[0], abs=LOGPROB_TOLERANCE
        )


def test_chat_top_logprobs_match_log_softmax(url: str, reference: Scored) -> None:
    """The completion of the same ids through chat's shape: /v1/completions with token
    ids stands in for the template, which would change the prompt."""
    body = {"prompt": reference.ids[:-NEW_TOKENS], "max_tokens": NEW_TOKENS, "logprobs": 3,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": 3, "temperature": 0}  # fmt: skip
    completion = post(url, "/v1/completions", body)
    chat_answer = post(url, "/v1/chat/completions", chat)
    prompt_len = len(reference.ids) - NEW_TOKENS
    tops = completion["choices"][0]["logprobs"]["top_logprobs"]
    for offset, top in enumerate(tops):
        best = sorted(top.values(), reverse=True)[:3]
        assert best == pytest.approx(_top(reference, prompt_len + offset, 3), abs=LOGPROB_TOLERANCE)
    content = chat_answer["choices"][0]["logprobs"]["content"]
    for item in content:
        values = [alt["logprob"] for alt in item["top_logprobs"]]
        assert len(values) == 3 and values == sorted(values, reverse=True)
        assert item["logprob"] == pytest.approx(values[0], abs=LOGPROB_TOLERANCE)  # greedy
