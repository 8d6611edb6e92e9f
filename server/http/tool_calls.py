"""Tool calls read out of a model's text, as vLLM's tool parsers read them.

Two formats, whichever the text holds:

- Hermes / Qwen 2.5 (the format the tiny preset's ChatML template asks for):
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more, possibly
  after some text (the content);
- Llama 3.1's JSON: the whole answer is `{"name": ..., "parameters": {...}}` (or
  `"arguments"`), optionally after `<|python_tag|>`, several joined by `;`. A forced
  call (`tool_choice` "required" or named) is written in this shape by the grammar.

Anything that does not parse, or names a tool the request did not offer, is not a
call: the text comes back as content, never as an error.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN = "<tool_call>"
HERMES_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None: the text was calls only
    calls: tuple[ParsedCall, ...] = ()


def parse_tool_calls(text: str, tools: tuple[str, ...]) -> ParsedOutput:
    """The calls `text` holds (of the tools offered), and the rest as content."""
    if HERMES_OPEN in text:
        calls = [_call(body, tools) for body in HERMES_CALL.findall(text)]
        if calls and all(call is not None for call in calls):
            content = text[: text.index(HERMES_OPEN)].strip()
            return ParsedOutput(content or None, tuple(c for c in calls if c is not None))
        return ParsedOutput(text)
    stripped = text.strip().removeprefix(PYTHON_TAG).strip()
    if stripped.startswith("{"):
        calls = [_call(part, tools) for part in _json_objects(stripped)]
        if calls and all(call is not None for call in calls):
            return ParsedOutput(None, tuple(c for c in calls if c is not None))
    return ParsedOutput(text)


def _json_objects(text: str) -> list[str]:
    """Llama 3.1's calls joined by `;` (a `;` inside a string does not split)."""
    decoder = json.JSONDecoder()
    parts, at = [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return [text]  # not JSON: _call refuses it
        parts.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \t\r\n;":
            at += 1
    return parts


def _call(body: str, tools: tuple[str, ...]) -> ParsedCall | None:
    try:
        value: Any = json.loads(body.strip())
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or value.get("name") not in tools:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as JSON text
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Streams a choice's text while holding back what may be a tool call: from
    `<tool_call>` on (or a prefix of it at the end), or the whole answer while it may
    be Llama 3.1's JSON. `finish` parses what was held."""

    def __init__(self, tools: tuple[str, ...]) -> None:
        self._tools = tools
        self._text = ""
        self._sent = 0
        self._held_from: int | None = None  # where a possible call starts

    def feed(self, delta: str) -> str:
        """The part of `delta` that is surely content, to send now."""
        self._text += delta
        if self._held_from is None:
            start = self._text.find(HERMES_OPEN, self._sent)
            lead = self._text.lstrip()
            if start >= 0:
                self._held_from = start
            elif self._sent == 0 and (
                lead.startswith("{") or PYTHON_TAG.startswith(lead) or lead.startswith(PYTHON_TAG)
            ):
                return ""  # may be a JSON call: decided when the choice ends
            else:
                return self._emit(len(self._text) - _partial_open(self._text))
        return self._emit(self._held_from)

    def finish(self) -> tuple[str, tuple[ParsedCall, ...]]:
        """(content not sent yet, the calls) once the choice has ended."""
        parsed = parse_tool_calls(self._text, self._tools)
        if parsed.calls:
            return "", parsed.calls
        return self._emit(len(self._text)), ()

    def _emit(self, end: int) -> str:
        end = max(end, self._sent)
        chunk = self._text[self._sent : end]
        self._sent = end
        return chunk


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that begins `<tool_call>`."""
    for size in range(min(len(HERMES_OPEN) - 1, len(text)), 0, -1):
        if HERMES_OPEN.startswith(text[-size:]):
            return size
    return 0
