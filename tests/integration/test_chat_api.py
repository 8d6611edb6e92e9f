"""POST /v1/chat/completions over real HTTP against the real app and engine (tiny)."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.chat_template import ChatTemplateError
from batchpilot_server.http.server_state import STATE
from batchpilot_server.tokenizer import ByteTokenizer

from tests.support.servers import InProcessServer, complete, scrape, serve_in_process, stream_events

pytestmark = pytest.mark.timeout(90)

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi!"},
    {"role": "user", "content": "How are you?"},
]


async def chat(session: aiohttp.ClientSession, url: str, **body: Any) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        return response.status, await response.json()


def prompt_ids(server: InProcessServer, messages: list[dict[str, Any]]) -> list[int]:
    """What the chat endpoint must generate from: the template's text, no extra BOS."""
    tokenizer = server.app[STATE].engine.tokenizer
    text = tokenizer.render_chat(messages, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


async def test_openai_client_chats_streaming_and_not() -> None:
    async with serve_in_process() as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            plain = await client.chat.completions.create(
                model="tiny",
                messages=CONVERSATION,
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            stream = await client.chat.completions.create(
                model="tiny",
                messages=CONVERSATION,
                max_completion_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [chunk async for chunk in stream]
        finally:
            await client.close()
        expected_prompt_tokens = len(prompt_ids(server, CONVERSATION))
    assert plain.object == "chat.completion"
    assert plain.id.startswith("chatcmpl-") and plain.model == "tiny"
    message = plain.choices[0].message
    assert message.role == "assistant" and isinstance(message.content, str)
    assert plain.choices[0].finish_reason == "length"
    assert plain.usage is not None
    assert plain.usage.prompt_tokens == expected_prompt_tokens
    assert plain.usage.completion_tokens == 12
    assert plain.usage.total_tokens == expected_prompt_tokens + 12
    # streamed: the role first, then the text, then the usage with no choices
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        message.content
    )  # greedy: the same text
    assert len(chunks) == 1 + 12 + 1  # role, one event per token, usage
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


async def test_chat_generates_from_the_rendered_prompt_as_completions_would() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        ids = prompt_ids(server, CONVERSATION)
        status, answer = await chat(
            session,
            server.url,
            messages=CONVERSATION,
            max_tokens=16,
            ignore_eos=True,
            temperature=0,
        )
        _, reference, _ = await complete(
            session, server.url, prompt=ids, max_tokens=16, ignore_eos=True, temperature=0
        )
    assert status == 200
    assert answer["choices"][0]["message"]["content"] == reference["choices"][0]["text"]
    assert answer["usage"] == reference["usage"]


async def test_text_parts_are_read_as_their_texts_joined_by_newlines() -> None:
    parts = [{"type": "text", "text": "How are"}, {"type": "text", "text": "you?"}]
    as_parts = [*CONVERSATION[:-1], {"role": "user", "content": parts}]
    as_text = [*CONVERSATION[:-1], {"role": "user", "content": "How are\nyou?"}]
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        answers = [
            await chat(
                session, server.url, messages=m, max_tokens=8, ignore_eos=True, temperature=0
            )
            for m in (as_parts, as_text)
        ]
    assert answers[0] == (200, {**answers[1][1], "id": answers[0][1]["id"],
                                "created": answers[0][1]["created"]})  # fmt: skip


async def test_tool_messages_and_names_reach_the_template() -> None:
    messages = [
        {"role": "user", "content": "weather?", "name": "ann"},
        {"role": "assistant", "content": "calling"},
        {"role": "tool", "content": "sunny", "tool_call_id": "call-1"},
    ]
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        status, answer = await chat(session, server.url, messages=messages, max_tokens=2)
        expected = len(prompt_ids(server, messages))
    assert status == 200
    assert answer["usage"]["prompt_tokens"] == expected


async def test_max_completion_tokens_wins_and_the_default_fills_what_the_server_allows() -> None:
    async with (
        serve_in_process(max_tokens=6) as server,
        aiohttp.ClientSession() as session,
    ):
        both = await chat(session, server.url, messages=CONVERSATION, max_tokens=2,
                          max_completion_tokens=4, ignore_eos=True)  # fmt: skip
        default = await chat(session, server.url, messages=CONVERSATION, ignore_eos=True)
        too_many = await chat(session, server.url, messages=CONVERSATION, max_tokens=7)
    assert both[1]["usage"]["completion_tokens"] == 4
    assert default[1]["usage"]["completion_tokens"] == 6
    assert too_many[0] == 400
    assert too_many[1]["error"]["param"] == "max_tokens"
    assert too_many[1]["error"]["message"] == "max_tokens is 7; this server allows at most 6"


@pytest.mark.parametrize("stream", [False, True])
async def test_stop_strings_end_a_chat_answer(stream: bool) -> None:
    body = {"messages": CONVERSATION, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        _, free = await chat(session, server.url, **body)
        text = free["choices"][0]["message"]["content"]
        stop = text[5:8]  # a piece the greedy answer is known to hold, three tokens long
        expected = text[: text.find(stop)]
        async with session.post(
            f"{server.url}/v1/chat/completions", json={**body, "stop": [stop], "stream": stream}
        ) as response:
            if stream:
                events = [e for e in await stream_events(response) if isinstance(e, dict)]
                got = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
                finish = events[-1]["choices"][0]["finish_reason"]
            else:
                choice = (await response.json())["choices"][0]
                got, finish = choice["message"]["content"], choice["finish_reason"]
    assert got == expected
    assert finish == "stop"


async def test_a_conversation_the_template_refuses_is_400(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(self: ByteTokenizer, messages: list[dict[str, Any]], **_: Any) -> str:
        raise ChatTemplateError("Conversation roles must alternate user/assistant")

    monkeypatch.setattr(ByteTokenizer, "render_chat", refuse)
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        status, answer = await chat(session, server.url, messages=CONVERSATION)
        metrics = await scrape(session, server.url)
    assert status == 400
    assert answer["error"] == {
        "message": "Conversation roles must alternate user/assistant",
        "type": "invalid_request_error",
        "code": "chat_template_error",
        "param": "messages",
    }
    assert metrics[(names.REQUESTS_TOTAL, "rejected")] == 1


USER = [{"role": "user", "content": "hi"}]

# (name, body, status, code, param)
BAD_CHATS: list[tuple[str, Any, int, str, str | None]] = [
    ("not an object", ["hi"], 400, "invalid_type", None),
    ("no messages", {"max_tokens": 2}, 400, "missing_field", "messages"),
    ("empty messages", {"messages": []}, 400, "invalid_value", "messages"),
    ("messages not a list", {"messages": "hi"}, 400, "invalid_type", "messages"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400,
     "invalid_value", "messages[0].role"),
    ("no content", {"messages": [{"role": "user"}]}, 400, "missing_field",
     "messages[0].content"),
    ("content a number", {"messages": [{"role": "user", "content": 7}]}, 400,
     "invalid_type", "messages[0].content"),
    ("image part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "invalid_value",
     "messages[0].content[0].type"),
    ("part without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
     400, "missing_field", "messages[0].content[0].text"),
    ("null content of a user", {"messages": [{"role": "user", "content": None}]}, 400,
     "missing_field", "messages[0].content"),
    ("tool call without id", {"messages": [{"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     400, "missing_field", "messages[0].tool_calls[0].id"),
    ("n above the cap", {"messages": USER, "n": 17}, 400, "invalid_value", "n"),
    ("json_schema without its schema", {"messages": USER,
     "response_format": {"type": "json_schema"}}, 400, "missing_field",
     "response_format.json_schema"),
    ("response_format yaml", {"messages": USER, "response_format": {"type": "yaml"}},
     400, "invalid_value", "response_format.type"),
    ("structured output with min_tokens", {"messages": USER, "min_tokens": 2,
     "response_format": {"type": "json_object"}}, 400, "unsupported", "min_tokens"),
    ("tool_choice required", {"messages": USER, "tool_choice": "required"}, 400,
     "invalid_value", "tool_choice"),
    ("tool_choice named", {"messages": USER, "tool_choice": {"type": "function",
     "function": {"name": "f"}}}, 400, "invalid_value", "tool_choice"),
    ("custom tool", {"messages": USER, "tools": [{"type": "custom", "custom": {"name": "f"}}]},
     400, "invalid_value", "tools[0].type"),
    ("top_logprobs without logprobs", {"messages": USER, "top_logprobs": 2}, 400,
     "invalid_value", "top_logprobs"),
    ("top_logprobs above the cap", {"messages": USER, "logprobs": True, "top_logprobs": 21},
     400, "invalid_value", "top_logprobs"),
    ("audio", {"messages": USER, "audio": {"voice": "alloy", "format": "mp3"}}, 400,
     "invalid_type", "audio"),
    ("store true", {"messages": USER, "store": True}, 400, "invalid_value", "store"),
    ("audio modality", {"messages": USER, "modalities": ["text", "audio"]}, 400,
     "invalid_value", "modalities[1]"),
    ("max_completion_tokens zero", {"messages": USER, "max_completion_tokens": 0}, 400,
     "invalid_value", "max_completion_tokens"),
    ("max_tokens over context", {"messages": USER, "max_tokens": 10**6}, 400,
     "context_length_exceeded", "max_tokens"),
    ("prompt over context", {"messages": [{"role": "user", "content": "x" * 5000}]}, 400,
     "context_length_exceeded", "messages"),
    ("temperature too high", {"messages": USER, "temperature": 2.5}, 400, "invalid_value",
     "temperature"),
    ("top_p zero", {"messages": USER, "top_p": 0}, 400, "invalid_value", "top_p"),
    ("stop too many", {"messages": USER, "stop": list("abcde")}, 400, "invalid_value", "stop"),
    ("stop empty string", {"messages": USER, "stop": [""]}, 400, "invalid_value", "stop[0]"),
    ("stream_options without stream", {"messages": USER, "stream_options":
     {"include_usage": True}}, 400, "invalid_value", "stream_options"),
    ("unknown model", {"messages": USER, "model": "gpt-9"}, 404, "model_not_found", "model"),
]  # fmt: skip


async def test_bad_chat_requests_get_their_exact_error_and_the_server_keeps_serving() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        seen = []
        for name, body, _, _, _ in BAD_CHATS:
            async with session.post(
                f"{server.url}/v1/chat/completions", data=json.dumps(body)
            ) as response:
                error = (await response.json())["error"]
                if error["code"] not in ("context_length_exceeded", "model_not_found"):
                    # the message names the field at fault first
                    assert error["message"].startswith(error["param"] or "request body"), error
                seen.append((name, response.status, error["code"], error["param"]))
        status, answer = await chat(session, server.url, messages=USER, max_tokens=3)
        metrics = await scrape(session, server.url)
    assert seen == [(name, s, c, p) for name, _, s, c, p in BAD_CHATS]
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1
    assert metrics[(names.REQUESTS_TOTAL, "rejected")] == len(BAD_CHATS)
    assert metrics[(names.REQUESTS_TOTAL, "error")] == 0
