"""response_format and forced tool calls against real servers (tiny random weights and
SmolLM2-135M), through the openai SDK: every answer that ends on EOS parses and
validates against its schema, greedy and sampled, streamed and not; bad schemas get a
400 naming response_format; tool calls come back parsed."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import requests
from batchpilot_server.chat_template import CHATML_TEMPLATE
from batchpilot_server.http import grammar_compiler

from tests.support.servers import serve_on_thread
from tests.support.smollm2 import hf_directory

pytestmark = pytest.mark.timeout(300)

NESTED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer"},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
        },
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "age", "address", "tags"],
}
OBJECT = {"type": "object"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def client(request: pytest.FixtureRequest) -> Iterator[openai.OpenAI]:
    options: dict[str, Any] = {"max_tokens": 400, "kv_cache_mb": 64}
    if request.param == "smollm2":
        options |= {"model": str(hf_directory()), "chat_template": CHATML_TEMPLATE}
    with serve_on_thread(**options) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        client.served = client.models.list().data[0].id  # type: ignore[attr-defined]
        client.url = url  # type: ignore[attr-defined]
        yield client


def _ask(client: openai.OpenAI, response_format: dict[str, Any], **sampling: Any) -> Any:
    return client.chat.completions.create(
        model=client.served,  # type: ignore[attr-defined]
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=response_format,  # type: ignore[arg-type]
        max_tokens=400,
        **sampling,
    )


def _schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema}}


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 7}])
@pytest.mark.parametrize(
    "response_format", [{"type": "json_object"}, _schema_format(NESTED)], ids=["object", "schema"]
)
def test_output_parses_and_validates(
    client: openai.OpenAI, response_format: dict[str, Any], sampling: dict[str, Any]
) -> None:
    answer = _ask(client, response_format, **sampling)
    choice = answer.choices[0]
    schema = response_format.get("json_schema", {}).get("schema", OBJECT)
    assert choice.finish_reason == "stop", f"ran out of tokens: {choice.message.content!r}"
    jsonschema.validate(json.loads(choice.message.content or ""), schema)


def test_streamed_output_validates(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=client.served,  # type: ignore[attr-defined]
        messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format=_schema_format(NESTED),  # type: ignore[arg-type]
        max_tokens=400,
        temperature=0.8,
        seed=3,
        stream=True,
    )
    text, reasons = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "stop", text
    jsonschema.validate(json.loads(text), NESTED)


def test_forced_tool_call_is_parsed(client: openai.OpenAI) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
        answer = client.chat.completions.create(
            model=client.served,  # type: ignore[attr-defined]
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice=choice,  # type: ignore[arg-type]
            max_tokens=200,
        )
        result = answer.choices[0]
        assert result.finish_reason == "tool_calls", result.message
        assert result.message.content is None
        (call,) = result.message.tool_calls or []
        assert call.function.name == "weather"
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_forced_tool_call_streams_as_delta(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=client.served,  # type: ignore[attr-defined]
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_tokens=200,
        stream=True,
    )
    calls, content, reasons = [], "", []
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            calls += choice.delta.tool_calls or []
            reasons.append(choice.finish_reason)
    assert reasons[-1] == "tool_calls"
    assert content == ""
    assert [call.function.name for call in calls] == ["weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])


@pytest.mark.parametrize(
    ("schema", "code"),
    [
        ({"type": "object", "properties": {"a": {"type": "nonsense"}}}, "invalid_schema"),
        (
            {"$ref": "#/$defs/node", "$defs": {"node": {"items": {"$ref": "#/$defs/node"}}}},
            "recursive_schema",
        ),
        ({"enum": list(range(5000))}, "schema_too_large"),
        (json.loads('{"items":' * 40 + "{}" + "}" * 40), "schema_too_deep"),
    ],
    ids=["invalid", "recursive", "huge-enum", "deep"],
)
def test_bad_schema_is_a_400_naming_response_format(
    client: openai.OpenAI, schema: dict[str, Any], code: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(client, _schema_format(schema))
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["code"] == code, error
    assert error["param"].startswith("response_format"), error


def test_cost_shows_in_the_metric(client: openai.OpenAI) -> None:
    _ask(client, _schema_format({"type": "object", "properties": {"n": {"type": "integer"}}}))
    text = requests.get(f"{client.url}/metrics", timeout=30).text  # type: ignore[attr-defined]
    counts = {
        phase: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("batchpilot_structured_output_seconds_count")
        for phase in ("compile", "mask")
        if f'phase="{phase}"' in line
    }
    assert counts.get("compile", 0) >= 1 and counts.get("mask", 0) >= 1, counts


def test_a_compile_past_its_time_limit_is_a_400(
    client: openai.OpenAI, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a limit no compilation meets: the request is answered without waiting for it
    monkeypatch.setattr(grammar_compiler, "COMPILE_TIMEOUT_S", 0.0)
    schema = {"type": "object", "properties": {"unseen": {"type": "string", "minLength": 3}}}
    with pytest.raises(openai.BadRequestError) as caught:
        _ask(client, _schema_format(schema))
    error = caught.value.body
    assert isinstance(error, dict)
    assert "did not compile within 0 s" in error["message"], error
    assert error["param"] == "response_format.json_schema.schema", error
    # the server keeps serving, and the refused schema stays refused at once
    monkeypatch.undo()
    with pytest.raises(openai.BadRequestError):
        _ask(client, _schema_format(schema))
    assert _ask(client, {"type": "json_object"}).choices[0].finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_parses_a_call_the_model_writes(
    client: openai.OpenAI, stream: bool
) -> None:
    # the model made to write Llama 3.1's JSON call by a schema: tool_choice "auto" must
    # find it in the text (Hermes tags are covered by tests/unit/test_tool_calls.py)
    call_schema = {
        "type": "object",
        "properties": {
            "name": {"const": "weather"},
            "arguments": WEATHER["function"]["parameters"],
        },
        "required": ["name", "arguments"],
    }
    answer = client.chat.completions.create(
        model=client.served,  # type: ignore[attr-defined]
        messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="auto",
        response_format=_schema_format(call_schema),  # type: ignore[arg-type]
        max_tokens=200,
        stream=stream,
    )
    chunks = list(answer) if stream else []
    if stream:
        calls = [c for chunk in chunks for ch in chunk.choices for c in ch.delta.tool_calls or []]
        reason = [ch.finish_reason for chunk in chunks for ch in chunk.choices][-1]
    else:
        calls, reason = answer.choices[0].message.tool_calls or [], answer.choices[0].finish_reason
    assert reason == "tool_calls"
    assert [call.function.name for call in calls] == ["weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
