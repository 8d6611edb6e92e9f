"""The whole tool loop, as a new user runs it, against SmolLM2-135M on its own chat template:
a forced tool call, then the answer to the tool's result.

The second turn is what every client sends back after a call: the assistant turn with
`tool_calls` and `"content": null` (the `openai` SDK's message as it came, LangChain's
AIMessage with empty content), then a `tool` turn. SmolLM2's template joins each
turn's content to text, so a null content must reach it as "" (as vLLM renders it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
import requests
from langchain_core.messages import AIMessage, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.support.servers import serve_on_thread
from tests.support.smollm2 import hf_directory

pytestmark = pytest.mark.timeout(180)

QUESTION = "What is the weather in Oslo?"
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    """SmolLM2-135M with its own chat template (no --chat-template), in-process."""
    with serve_on_thread(model=str(hf_directory()), kv_cache_mb=64) as url:
        yield url


def test_openai_client_runs_a_forced_call_then_answers_the_tool_result(url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = hf_directory().name
    messages: list[Any] = [{"role": "user", "content": QUESTION}]
    called = client.chat.completions.create(
        model=model,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "weather"}},
        max_tokens=60,
        temperature=0,
    )
    call_message = called.choices[0].message
    assert called.choices[0].finish_reason == "tool_calls"
    assert call_message.content is None and call_message.tool_calls
    call = call_message.tool_calls[0]
    assert call.type == "function" and call.function.name == "weather"
    # the SDK's message as it came back (content null), then the tool's result
    messages += [call_message, {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    answered = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], max_tokens=16, temperature=0
    )
    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in messages]
    rendered = requests.post(f"{url}/tokenize", json={"messages": sent}, timeout=60).json()
    assert answered.choices[0].finish_reason in ("stop", "length")
    assert isinstance(answered.choices[0].message.content, str)
    assert answered.usage is not None and called.usage is not None
    assert answered.usage.prompt_tokens == rendered["count"] > called.usage.prompt_tokens


def test_langchain_runs_a_forced_call_then_answers_the_tool_result(url: str) -> None:
    chat = ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        model=hf_directory().name,
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )
    question = HumanMessage(QUESTION)
    called = chat.bind_tools([weather], tool_choice="weather").invoke([question])
    assert isinstance(called, AIMessage)
    assert [call["name"] for call in called.tool_calls] == ["weather"], called
    result = weather.invoke(called.tool_calls[0])  # a ToolMessage with the call's id
    answered = chat.bind_tools([weather]).invoke([question, called, result])
    assert isinstance(answered, AIMessage) and isinstance(answered.content, str)
    assert answered.response_metadata["finish_reason"] in ("stop", "length")
    assert answered.usage_metadata is not None and called.usage_metadata is not None
    assert answered.usage_metadata["input_tokens"] > called.usage_metadata["input_tokens"]
