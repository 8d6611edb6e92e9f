"""langchain-openai's `OpenAI` and `ChatOpenAI`, unmodified, against real servers: the tiny
model (its ChatML template renders tools) and SmolLM2-135M given a tools-capable
template as --chat-template gives it (its own has no tools).

Each client sends what it always sends (penalties of 0, `logit_bias`, `n`, lists of
prompts, `stream_options`, `tools`, `parallel_tool_calls`, assistant turns with
`tool_calls` and null content); the server must answer them all. On SmolLM2,
`.with_structured_output(PydanticModel)` parses into the model (methods json_schema and
function_calling) and `.bind_tools(..., tool_choice=...)` yields a parsed tool call.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import requests
from batchpilot_server.chat_template import CHATML_TEMPLATE
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.support.servers import serve_on_thread
from tests.support.smollm2 import hf_directory

pytestmark = pytest.mark.timeout(180)


@tool
def weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=20)
    age: int


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_on_thread(max_tokens=64) as url:
        yield url


@pytest.fixture(scope="module")
def smollm2_url() -> Iterator[str]:
    """SmolLM2-135M (its directory loads faster than the GGUF file: no dequantizing)
    with the server's --chat-template, in-process: the tiny preset's ChatML with tools."""
    model = hf_directory()
    with serve_on_thread(model=str(model), chat_template=CHATML_TEMPLATE, kv_cache_mb=64) as url:
        yield url


def _smollm2_chat(url: str, max_tokens: int) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{url}/v1",
        api_key="unused",
        model=hf_directory().name,
        max_tokens=max_tokens,
        temperature=0,
        max_retries=0,
    )


def test_completions_client_batches_its_prompts(url: str) -> None:
    llm = OpenAI(base_url=f"{url}/v1", api_key="unused", model="tiny", max_tokens=5, max_retries=0)
    single = llm.invoke("Hello")
    batch = llm.generate(["one", "two", "three"])
    streamed = list(llm.stream("Hello"))
    assert isinstance(single, str)
    assert [len(g) for g in batch.generations] == [1, 1, 1]
    assert batch.llm_output is not None
    assert batch.llm_output["token_usage"]["completion_tokens"] >= 3
    assert streamed and all(isinstance(piece, str) for piece in streamed)


def test_chat_client_answers_streams_and_takes_tool_turns(url: str) -> None:
    chat = ChatOpenAI(
        base_url=f"{url}/v1", api_key="unused", model="tiny", max_tokens=5, max_retries=0
    )
    answer = chat.invoke([SystemMessage("Be brief."), HumanMessage("hi")])
    streamed = list(chat.stream("hi"))
    with_tools = chat.bind_tools([weather])
    called = with_tools.invoke("What is the weather in Oslo?")
    follow_up = with_tools.invoke(
        [
            HumanMessage("What is the weather in Oslo?"),
            AIMessage(
                content="",
                tool_calls=[{"name": "weather", "args": {"city": "Oslo"}, "id": "call_1"}],
            ),
            ToolMessage("sunny in Oslo", tool_call_id="call_1"),
        ]
    )
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str)
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] >= 1
    assert streamed and isinstance(streamed[0].content, str)
    assert isinstance(called, AIMessage) and isinstance(follow_up, AIMessage)
    # the tools reached the prompt: it is longer than the same question without them
    bare = chat.invoke("What is the weather in Oslo?")
    assert called.usage_metadata is not None and bare.usage_metadata is not None
    assert called.usage_metadata["input_tokens"] > bare.usage_metadata["input_tokens"] + 50


def test_smollm2_with_a_tools_template_serves_bind_tools(smollm2_url: str) -> None:
    url = smollm2_url
    chat = _smollm2_chat(url, max_tokens=8)
    answer = chat.bind_tools([weather]).invoke("What is the weather in Oslo?")
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tools = [{"type": "function", "function": {
        "name": "weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]  # fmt: skip
    rendered = requests.post(
        f"{url}/tokenize", json={"messages": messages, "tools": tools}, timeout=60
    ).json()
    text = "Hello world, hi there"
    spelled = requests.post(
        f"{url}/tokenize",
        json={"prompt": text, "add_special_tokens": False, "return_token_strs": True},
        timeout=60,
    ).json()
    assert isinstance(answer, AIMessage) and isinstance(answer.content, str)
    assert answer.usage_metadata is not None
    assert answer.usage_metadata["input_tokens"] == rendered["count"]
    # byte-level tokens spell as their bytes: " world" with its space
    assert "".join(spelled["token_strs"]) == text
    assert " world" in spelled["token_strs"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_smollm2_structured_output_parses_into_the_model(smollm2_url: str, method: str) -> None:
    chat = _smollm2_chat(smollm2_url, max_tokens=120)
    structured = chat.with_structured_output(Person, method=method)  # type: ignore[arg-type]
    person = structured.invoke("Invent a person: a name and an age.")
    assert isinstance(person, Person), person


def test_smollm2_bind_tools_with_a_tool_choice_gives_a_parsed_call(smollm2_url: str) -> None:
    chat = _smollm2_chat(smollm2_url, max_tokens=120)
    for choice in ("weather", "any"):  # named, and langchain's "any" ("required")
        called = chat.bind_tools([weather], tool_choice=choice).invoke("Weather in Oslo?")
        assert isinstance(called, AIMessage)
        assert [call["name"] for call in called.tool_calls] == ["weather"], called
        assert isinstance(called.tool_calls[0]["args"]["city"], str)
        assert called.response_metadata["finish_reason"] == "tool_calls"
