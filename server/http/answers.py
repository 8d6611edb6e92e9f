"""The answers' wire models: completions, chat completions and their stream chunks,
tokenize, the model list, the batching config in force (the requests' models and the
error answer are protocol.py's)."""

from __future__ import annotations

from typing import Literal

from batchpilot_server.batching_config import Mode
from batchpilot_server.engine_api import FinishReason
from batchpilot_server.http.protocol import FunctionCall, ToolCall
from pydantic import BaseModel, Field


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    """Per token of the choice's text (the prompt's first with `echo`; its first is null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """The answer, and (with `stream`) each event: one per token, then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=lambda usage: usage is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: None = None


ChatFinishReason = Literal["stop", "length", "tool_calls"]


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda calls: not calls)


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaToolCall(BaseModel):
    """A streamed tool call: whole in one delta (id, name and arguments at once)."""

    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda role: role is None)
    content: str | None = Field(None, exclude_if=lambda content: content is None)
    tool_calls: list[DeltaToolCall] | None = Field(None, exclude_if=lambda calls: not calls)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(BaseModel):
    """With `stream`, each event: the role first, one per token, then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=lambda usage: usage is None)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class SloClassState(BaseModel):
    """A named class's targets in milliseconds (null: not stated) and priority."""

    name: str
    priority: int = Field(description="Higher is served first.")
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None


class SloState(BaseModel):
    """The SLO targets in force, in milliseconds; null: not stated. The top-level ones
    are the class `default`'s, of a request that names none."""

    ttft_ms: float | None = Field(description="Arrival to first token.")
    tpot_ms: float | None = Field(description="Mean time per output token after the first.")
    e2e_ms: float | None = Field(description="Arrival to last byte.")
    classes: list[SloClassState] = Field(
        default_factory=list, description="The named classes beside the default."
    )


class BatchingState(BaseModel):
    """The batching config in force."""

    max_batch_size: int
    batch_timeout_ms: float
    max_queue_size: int
    prefill_token_budget: int
    num_speculative_tokens: int = Field(
        default=0, description="Draft tokens verified per decode row and step; 0: off."
    )
    slo: SloState
    mode: Mode
    version: int = Field(description="Increases with every accepted PUT.")


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "batchpilot"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
