"""The whole OpenAI request, driven by the official `openai` SDK and raw HTTP against one
real server (the tiny model): every field the SDK defines is accepted at a value that
changes nothing, unknown fields are ignored and named in one log line, several prompts
and `n` run as separate sequences, and the logprobs and echo shapes are OpenAI's.

The values of the log-probabilities (top-k against log_softmax, prompt scores) need the
engine's batched sampler: tests/integration/test_logprob_values.py.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests
from batchpilot_server.http.protocol import MAX_LOGPROBS, MAX_N

from tests.support.servers import serve_on_thread

pytestmark = pytest.mark.timeout(120)

USER = [{"role": "user", "content": "Say hi"}]
TIMEOUT_S = 60


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_on_thread(max_tokens=64) as url:
        yield url


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def post(url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    response = requests.post(f"{url}{path}", json=body, timeout=TIMEOUT_S)
    return response.status_code, response.json()


# every field of completions.create, at a value that changes nothing (or a small real one)
COMPLETION_FIELDS: dict[str, Any] = {
    "best_of": 1,
    "echo": False,
    "frequency_penalty": 0,
    "logit_bias": {},
    "logprobs": None,
    "max_tokens": 4,
    "n": 1,
    "presence_penalty": 0,
    "seed": 3,
    "stop": ["\n\n\n\n"],
    "suffix": None,
    "temperature": 0.7,
    "top_p": 0.9,
    "user": "tester",
}
# every field of chat.completions.create, likewise
CHAT_FIELDS: dict[str, Any] = {
    "audio": None,
    "frequency_penalty": 0,
    "function_call": "auto",
    "functions": [],
    "logit_bias": {},
    "logprobs": False,
    "max_completion_tokens": 4,
    "max_tokens": None,
    "metadata": {"team": "ml"},
    "modalities": ["text"],
    "moderation": None,
    "n": 1,
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "hi"},
    "presence_penalty": 0,
    "prompt_cache_key": "k",
    "prompt_cache_options": {},
    "prompt_cache_retention": "in_memory",
    "reasoning_effort": "low",
    "response_format": {"type": "text"},
    "safety_identifier": "someone",
    "seed": 3,
    "service_tier": "auto",
    "stop": "\n\n\n\n",
    "store": False,
    "temperature": 0.7,
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 0.9,
    "user": "tester",
    "verbosity": "low",
    "web_search_options": None,
}
# vLLM's sampling extensions, which clients send in extra_body
VLLM_FIELDS: dict[str, Any] = {
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 1,
    "stop_token_ids": [],
    "ignore_eos": False,
}


def test_the_sdk_fields_cover_what_the_sdk_defines() -> None:
    """The lists above are the SDK's own parameters: a new SDK field fails this test."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_params

    sdk_completion = set(completion_create_params.CompletionCreateParamsBase.__annotations__)
    sdk_chat = set(chat_params.CompletionCreateParamsBase.__annotations__)
    core = {"model", "prompt", "messages", "stream", "stream_options"}
    assert sdk_completion - core == set(COMPLETION_FIELDS)
    assert sdk_chat - core == set(CHAT_FIELDS)


@pytest.mark.parametrize("stream", [False, True])
def test_every_completions_field_is_accepted(client: openai.OpenAI, stream: bool) -> None:
    answer = client.completions.create(
        model="tiny",
        prompt="Hello",
        stream=stream,
        extra_body=VLLM_FIELDS,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **COMPLETION_FIELDS,
    )
    if stream:
        chunks = list(answer)  # type: ignore[arg-type]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
        assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    else:
        assert answer.choices[0].finish_reason in ("stop", "length")  # type: ignore[union-attr]
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 4  # type: ignore[union-attr]


@pytest.mark.parametrize("stream", [False, True])
def test_every_chat_field_is_accepted(client: openai.OpenAI, stream: bool) -> None:
    answer = client.chat.completions.create(
        model="tiny",
        messages=USER,  # type: ignore[arg-type]
        stream=stream,
        extra_body=VLLM_FIELDS,
        **({"stream_options": {"include_usage": True}} if stream else {}),
        **CHAT_FIELDS,
    )
    if stream:
        chunks = list(answer)  # type: ignore[arg-type]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    else:
        assert answer.choices[0].message.role == "assistant"  # type: ignore[union-attr]
        assert answer.usage is not None and 1 <= answer.usage.completion_tokens <= 4  # type: ignore[union-attr]


def test_explicit_nulls_are_the_defaults(url: str) -> None:
    nulls = dict.fromkeys(
        ["temperature", "top_p", "n", "seed", "stop", "stream", "stream_options", "logprobs",
         "echo", "best_of", "frequency_penalty", "presence_penalty", "logit_bias", "user",
         "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "suffix"]
    )  # fmt: skip
    status, answer = post(url, "/v1/completions", {"prompt": "a", "max_tokens": None, **nulls})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] <= 16  # OpenAI's default max_tokens
    assert answer["choices"][0]["logprobs"] is None
    chat_nulls = {key: None for key in nulls if key not in ("echo", "best_of", "suffix")}
    body = {"messages": USER, "max_tokens": 3, "max_completion_tokens": None, **chat_nulls}
    status, answer = post(url, "/v1/chat/completions", body)
    assert status == 200, answer


def test_unknown_fields_are_ignored_and_named_in_one_log_line(
    url: str, caplog: pytest.LogCaptureFixture
) -> None:
    body = {
        "prompt": "a",
        "max_tokens": 2,
        "guided_json": {"type": "object"},
        "stream_options": None,
        "x-trace": 1,
    }
    with caplog.at_level(logging.WARNING, logger="batchpilot.server"):
        status, answer = post(url, "/v1/completions", body)
        chat_body = {
            "messages": [{"role": "user", "content": "hi", "reasoning_content": "x\ny"}],
            "max_tokens": 2,
        }
        chat_status, _ = post(url, "/v1/chat/completions", chat_body)
    assert status == 200 and chat_status == 200, answer
    lines = [r.getMessage() for r in caplog.records if "does not know" in r.getMessage()]
    assert lines == [
        "/v1/completions: ignored request fields this server does not know: guided_json, x-trace",
        "/v1/chat/completions: ignored request fields this server does not know: "
        "messages[0].reasoning_content",
    ]


def test_developer_turns_are_system_turns_and_tool_turns_render(url: str) -> None:
    as_developer = [{"role": "developer", "content": "Be brief."}, *USER]
    as_system = [{"role": "system", "content": "Be brief."}, *USER]
    answers = [
        post(url, "/tokenize", {"messages": messages})[1]["tokens"]
        for messages in (as_developer, as_system)
    ]
    assert answers[0] == answers[1]
    conversation = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {}}}]
    status, answer = post(
        url, "/v1/chat/completions", {"messages": conversation, "tools": tools, "max_tokens": 2}
    )
    assert status == 200, answer
    rendered = post(url, "/tokenize", {"messages": conversation, "tools": tools})[1]
    text = post(url, "/detokenize", {"tokens": rendered["tokens"]})[1]["prompt"]
    # the tiny model's ChatML template writes tools and calls as Qwen2.5's does
    assert '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text
    listed = text.split("<tools>\n")[1].split("\n</tools>")[0]
    assert json.loads(listed) == tools[0]
    assert answer["usage"]["prompt_tokens"] == rendered["count"]


def test_a_list_of_prompts_gets_one_choice_each_in_order(url: str) -> None:
    prompts = ["one", "two two", "three three three"]
    body = {"prompt": prompts, "max_tokens": 3, "ignore_eos": True, "temperature": 0}
    status, answer = post(url, "/v1/completions", body)
    singles = [post(url, "/v1/completions", {**body, "prompt": prompt})[1] for prompt in prompts]
    assert status == 200, answer
    assert [c["index"] for c in answer["choices"]] == [0, 1, 2]
    assert [c["text"] for c in answer["choices"]] == [s["choices"][0]["text"] for s in singles]
    assert answer["usage"] == {
        "prompt_tokens": sum(s["usage"]["prompt_tokens"] for s in singles),
        "completion_tokens": 9,
        "total_tokens": sum(s["usage"]["total_tokens"] for s in singles),
    }
    ids = post(url, "/v1/completions", {**body, "prompt": [[65, 66], [67]]})[1]
    assert [c["index"] for c in ids["choices"]] == [0, 1]


def test_n_choices_are_prompt_major_with_distinct_reproducible_seeds(url: str) -> None:
    body = {
        "prompt": ["a", "b"],
        "n": 3,
        "max_tokens": 12,
        "ignore_eos": True,
        "temperature": 1.0,
        "seed": 11,
    }
    status, first = post(url, "/v1/completions", body)
    _, again = post(url, "/v1/completions", body)
    assert status == 200, first
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == list(range(6))
    assert texts == [c["text"] for c in again["choices"]]  # seeded: reproducible
    assert len(set(texts[:3])) == 3  # the seeds differ per choice
    assert first["usage"]["completion_tokens"] == 6 * 12
    assert first["usage"]["prompt_tokens"] == 2 * 2  # each prompt once (BOS + a byte)
    # choice 0 of a seeded request is the single request of that seed
    _, single = post(url, "/v1/completions", {**body, "prompt": "a", "n": 1})
    assert single["choices"][0]["text"] == texts[0]


def test_n_choices_stream_interleaved_each_with_its_index(url: str) -> None:
    body = {
        "messages": USER,
        "n": 2,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": {"ignore_eos": True},
    }
    with openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0) as client:
        chunks = list(client.chat.completions.create(model="tiny", **body))  # type: ignore[call-overload]
    by_index: dict[int, list[Any]] = {0: [], 1: []}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        by_index[choice.index].append(choice)
    for choices in by_index.values():
        assert choices[0].delta.role == "assistant"
        assert choices[-1].finish_reason == "length"
        assert len(choices) == 1 + 5
    assert chunks[-1].usage.completion_tokens == 10


def test_caps_on_n_logprobs_and_sequences_are_named(url: str) -> None:
    cases = [
        ({"prompt": "a", "n": MAX_N + 1}, "n"),
        ({"prompt": "a", "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
        ({"prompt": ["a"] * 8, "n": MAX_N}, "prompt"),
    ]
    for body, param in cases:
        status, answer = post(url, "/v1/completions", body)
        assert status == 400 and answer["error"]["param"] == param, answer


def test_completion_logprobs_have_openais_shape(client: openai.OpenAI) -> None:
    answer = client.completions.create(
        model="tiny", prompt="Hi", max_tokens=4, logprobs=2, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    logprobs = answer.choices[0].logprobs
    assert logprobs is not None
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 4  # type: ignore[arg-type]
    assert logprobs.text_offset == [0, *_cumulative(logprobs.tokens)][:4]  # type: ignore[arg-type]
    for token, value, top in zip(
        logprobs.tokens,
        logprobs.token_logprobs,
        logprobs.top_logprobs,
        strict=True,  # type: ignore[arg-type]
    ):
        assert isinstance(value, float) and value <= 0.0
        assert token in top  # the chosen token is among its top ones, as vLLM's


def test_echo_prepends_the_prompt_with_its_tokens_first(client: openai.OpenAI) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs 1, max_tokens 1 (or 0)."""
    for max_tokens in (1, 0):
        answer = client.completions.create(
            model="tiny", prompt="The cat", max_tokens=max_tokens, logprobs=1, echo=True,
            temperature=0,
        )  # fmt: skip
        choice = answer.choices[0]
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.tokens is not None
        assert choice.text.startswith("The cat")
        prompt_tokens = len("The cat") + 1  # BOS + bytes
        assert len(logprobs.tokens) == prompt_tokens + max_tokens
        assert logprobs.token_logprobs[0] is None  # type: ignore[index]
        assert logprobs.top_logprobs[0] is None  # type: ignore[index]
        assert "".join(logprobs.tokens[:prompt_tokens]) == "The cat"
        assert answer.usage is not None and answer.usage.completion_tokens == max_tokens
        if max_tokens == 0:
            assert choice.text == "The cat" and choice.finish_reason == "length"


def test_echo_streams_the_prompt_first(url: str) -> None:
    body = {"prompt": "Hey", "max_tokens": 3, "echo": True, "stream": True, "temperature": 0}
    with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=TIMEOUT_S) as r:
        events = [line for line in r.iter_lines() if line.startswith(b"data: ")]
    status, whole = post(url, "/v1/completions", {**body, "stream": False})
    assert status == 200, whole
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert events[-1] == b"data: [DONE]"
    assert chunks[0]["choices"][0]["text"].startswith("Hey")
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_openais_shape(client: openai.OpenAI, stream: bool) -> None:
    answer = client.chat.completions.create(
        model="tiny", messages=USER, max_tokens=3, logprobs=True, top_logprobs=2,  # type: ignore[arg-type]
        temperature=0, stream=stream, extra_body={"ignore_eos": True},
    )  # fmt: skip
    if stream:
        chunks = [c for c in answer if c.choices and c.choices[0].logprobs]  # type: ignore[union-attr]
        content = [item for c in chunks for item in c.choices[0].logprobs.content]  # type: ignore[union-attr]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)  # type: ignore[union-attr]
    else:
        content = answer.choices[0].logprobs.content  # type: ignore[union-attr]
        text = answer.choices[0].message.content  # type: ignore[union-attr]
    assert len(content) == 3 and isinstance(text, str)
    for item in content:
        assert item.logprob <= 0.0
        # tiny's tokens are bytes: one each, its text where it is a whole character
        assert item.bytes is not None and len(item.bytes) == 1
        assert item.token == bytes(item.bytes).decode("utf-8", errors="replace")
        assert len(item.top_logprobs) <= 2


def _cumulative(tokens: list[str]) -> list[int]:
    total, offsets = 0, []
    for token in tokens:
        total += len(token)
        offsets.append(total)
    return offsets


def test_tokenize_detokenize_version_and_health(url: str) -> None:
    status, tokenized = post(url, "/tokenize", {"prompt": "Hi", "return_token_strs": True})
    assert status == 200
    assert tokenized["tokens"] == [256, 72, 105]  # tiny: BOS, then the bytes
    assert tokenized["count"] == 3 and tokenized["token_strs"] == ["", "H", "i"]
    assert tokenized["max_model_len"] > 0
    plain = post(url, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})[1]
    assert plain["tokens"] == [72, 105] and plain["token_strs"] is None
    assert post(url, "/detokenize", {"tokens": [72, 105]}) == (200, {"prompt": "Hi"})
    status, refused = post(url, "/detokenize", {"tokens": [1_000_000]})
    assert status == 400 and refused["error"]["param"] == "tokens[0]"
    status, refused = post(url, "/tokenize", {"prompt": "a", "messages": USER})
    assert status == 400 and refused["error"]["param"] == "prompt"
    version = requests.get(f"{url}/version", timeout=TIMEOUT_S)
    assert version.status_code == 200 and version.json()["version"]
    assert requests.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200
