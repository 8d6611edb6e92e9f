"""tool_calls.py on the texts models write: Hermes/Qwen tags, Llama 3.1 JSON, and text
that only looks like a call (which stays text)."""

from __future__ import annotations

import json

from batchpilot_server.http.tool_calls import ToolCallStream, parse_tool_calls

TOOLS = ("weather", "time")


def test_hermes_calls_after_content() -> None:
    text = (
        'Checking.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    )
    parsed = parse_tool_calls(
        text + '<tool_call>{"name": "time", "arguments": {}}</tool_call>', TOOLS
    )
    assert parsed.content == "Checking."
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("weather", {"city": "Oslo"}),
        ("time", {}),
    ]
    assert len({c.id for c in parsed.calls}) == 2


def test_llama_json_calls() -> None:
    text = (
        '<|python_tag|>{"name": "weather", "parameters": {"city": "a;b"}}; '
        '{"name": "time", "parameters": {}}'
    )
    parsed = parse_tool_calls(text, TOOLS)
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [
        ("weather", {"city": "a;b"}),
        ("time", {}),
    ]


def test_what_does_not_parse_stays_text() -> None:
    for text in (
        "<tool_call>{not json</tool_call>",
        '<tool_call>{"name": "unknown", "arguments": {}}</tool_call>',
        '{"name": "weather", "arguments": [1]}',
        '{"answer": 42}',
        "plain words",
    ):
        parsed = parse_tool_calls(text, TOOLS)
        assert (parsed.content, parsed.calls) == (text, ()), text


def test_stream_sends_content_and_holds_the_call() -> None:
    stream = ToolCallStream(TOOLS)
    pieces = [
        "Let me ",
        "check <tool",
        '_call>{"name": "weather", ',
        '"arguments": {}}</tool_call>',
    ]
    sent = "".join(stream.feed(piece) for piece in pieces)
    rest, calls = stream.finish()
    assert (sent, rest) == ("Let me check ", "")
    assert [c.name for c in calls] == ["weather"]


def test_stream_of_text_that_is_no_call_comes_out_whole() -> None:
    stream = ToolCallStream(TOOLS)
    sent = "".join(stream.feed(piece) for piece in ["{ not", " a call", " <tool"])
    rest, calls = stream.finish()
    assert (sent + rest, calls) == ("{ not a call <tool", ())
