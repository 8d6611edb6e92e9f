"""How each endpoint writes a generation: completions' and chat's answers and stream events."""

from __future__ import annotations

from typing import Any, Protocol

from batchpilot_server.http.answers import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatDelta,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    DeltaToolCall,
    Usage,
)
from batchpilot_server.http.generation import Generation
from batchpilot_server.http.protocol import FunctionCall, ToolCall
from batchpilot_server.http.protocol_output import (
    ChoiceDelta,
    LogprobEntry,
    chat_logprobs,
    completion_logprobs,
)
from batchpilot_server.http.tool_calls import ParsedCall, parse_tool_calls
from pydantic import BaseModel


class AnswerFormat(Protocol):
    """How one endpoint writes a generation: the whole answer, or its stream of events."""

    id_prefix: str

    def answer(self, generation: Generation) -> BaseModel: ...
    def opening(self, generation: Generation) -> list[BaseModel]:
        """The events sent before the first text."""
        ...

    def event(
        self, generation: Generation, delta: ChoiceDelta, usage: Usage | None = None
    ) -> BaseModel: ...
    def usage_event(self, generation: Generation) -> BaseModel:
        """stream_options.include_usage: the last event, with no choices."""
        ...


class CompletionFormat:
    id_prefix = "cmpl"

    def answer(self, generation: Generation) -> Completion:
        choices = [
            CompletionChoice(
                index=output.index,
                text=output.text,
                logprobs=self._logprobs(generation, output.entries, 0),
                finish_reason=output.finish_reason,
            )
            for output in generation.outputs
        ]
        return Completion(**_identity(generation), choices=choices, usage=generation.usage())

    def opening(self, generation: Generation) -> list[BaseModel]:
        return []

    def event(
        self, generation: Generation, delta: ChoiceDelta, usage: Usage | None = None
    ) -> Completion:
        choice = CompletionChoice(
            index=delta.index,
            text=delta.text,
            logprobs=self._logprobs(generation, delta.entries, delta.offset),
            finish_reason=delta.finish_reason,
        )
        return Completion(**_identity(generation), choices=[choice], usage=usage)

    def usage_event(self, generation: Generation) -> Completion:
        return Completion(**_identity(generation), choices=[], usage=generation.usage())

    @staticmethod
    def _logprobs(
        generation: Generation, entries: list[LogprobEntry], offset: int
    ) -> CompletionLogprobs | None:
        k = generation.parsed.logprobs
        if k is None:
            return None
        return completion_logprobs(entries, generation.speller, k, offset)


class ChatFormat:
    id_prefix = "chatcmpl"

    def answer(self, generation: Generation) -> ChatCompletion:
        choices = []
        for output in generation.outputs:
            content: str | None = output.text
            calls: tuple[ParsedCall, ...] = ()
            if generation.parsed.tool_names:
                parsed = parse_tool_calls(output.text, generation.parsed.tool_names)
                content, calls = parsed.content, parsed.calls
            choices.append(
                ChatChoice(
                    index=output.index,
                    message=ChatCompletionMessage(
                        content=content, tool_calls=[_tool_call(call) for call in calls]
                    ),
                    logprobs=self._logprobs(generation, output.entries),
                    finish_reason="tool_calls" if calls else output.finish_reason,
                )
            )
        return ChatCompletion(**_identity(generation), choices=choices, usage=generation.usage())

    def opening(self, generation: Generation) -> list[BaseModel]:
        # As OpenAI: the first event of each choice names the role, the text follows.
        return [
            ChatCompletionChunk(
                **_identity(generation),
                choices=[
                    ChatChunkChoice(
                        index=output.index,
                        delta=ChatDelta(role="assistant", content=""),
                        finish_reason=None,
                    )
                ],
            )
            for output in generation.outputs
        ]

    def event(
        self, generation: Generation, delta: ChoiceDelta, usage: Usage | None = None
    ) -> ChatCompletionChunk:
        calls = [
            DeltaToolCall(index=i, id=call.id, function=_function(call))
            for i, call in enumerate(delta.tool_calls)
        ]
        choice = ChatChunkChoice(
            index=delta.index,
            delta=ChatDelta(content=delta.text, tool_calls=calls),
            logprobs=self._logprobs(generation, delta.entries),
            finish_reason=delta.finish_reason,
        )
        return ChatCompletionChunk(**_identity(generation), choices=[choice], usage=usage)

    def usage_event(self, generation: Generation) -> ChatCompletionChunk:
        return ChatCompletionChunk(**_identity(generation), choices=[], usage=generation.usage())

    @staticmethod
    def _logprobs(generation: Generation, entries: list[LogprobEntry]) -> ChatLogprobs | None:
        k = generation.parsed.logprobs
        if k is None:
            return None
        return chat_logprobs(entries, generation.speller, k)


def _function(call: ParsedCall) -> FunctionCall:
    return FunctionCall(name=call.name, arguments=call.arguments)


def _tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=call.id, function=_function(call))


COMPLETION_FORMAT = CompletionFormat()
CHAT_FORMAT = ChatFormat()


def _identity(generation: Generation) -> dict[str, Any]:
    return {"id": generation.id, "created": generation.created, "model": generation.model}
