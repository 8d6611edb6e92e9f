"""The OpenAI-compatible wire format, declared once: what callers send, and the error
answer (the other answers are answers.py's).

The pydantic models below and answers.py's are both the validation of what callers send
and the source of `/openapi.json` (openapi.py). Reading a request into what the engine runs
is protocol_parse.py's job; turning the engine's tokens into answers,
protocol_output.py's.

Every field the official `openai` SDK defines for `completions.create` and
`chat.completions.create` is declared here, with vLLM's sampling extensions. An
explicit `null` means the field's default. A field no model declares is kept
(`extra="allow"`) so that protocol_parse can name it in one log line and otherwise
ignore it, as vLLM does; a declared field whose value this server cannot honour gets a
400 naming it (docs/api.md lists them field by field).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from batchpilot_server.engine_api import GREEDY_BELOW_TEMPERATURE
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
)
from pydantic_core import PydanticCustomError

# OpenAI's default when a completion request names no `max_tokens`.
DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
# torch.Generator.manual_seed takes 64 bits; OpenAI's seed is a non-negative integer.
MAX_SEED = 2**64 - 1
MAX_REQUEST_PRIORITY = 2**63 - 1  # vLLM's field is a plain integer: any int64
# Caps that keep one request's cost bounded (docs/api.md): choices per prompt, engine
# sequences per request (prompts x n), top log-probabilities per token (vLLM's default
# max_logprobs), logit_bias entries (OpenAI's) and stop_token_ids.
MAX_N = 16
MAX_SEQUENCES = 64
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 300
MAX_STOP_TOKEN_IDS = 64
# a repetition_penalty beyond this only makes repeated tokens as unlikely as at 10
MAX_REPETITION_PENALTY = 10.0


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; the CLI and tests choose them."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: bounded by the model's context only
    max_tokens: int | None = None  # None: bounded by the model's context only
    queue_timeout_s: float = 30.0  # how long a request may wait unscheduled
    retry_after_s: int = 1  # what a 429 / 503 tells the caller to wait
    # `echo` with logprobs scores every prompt token over the whole vocabulary: prompts
    # longer than this are refused for it (echo without logprobs is free)
    max_echo_logprob_tokens: int = 4096


# --- errors ----------------------------------------------------------------------


class ApiError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        outcome: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}
        # The requests_total outcome this error counts as (see metrics.py).
        self.outcome = outcome or _default_outcome(status)

    def answer(self) -> ErrorResponse:
        detail = ErrorDetail(message=self.message, type=self.type, code=self.code, param=self.param)
        return ErrorResponse(error=detail)

    def body(self) -> dict[str, Any]:
        return self.answer().model_dump()


def _default_outcome(status: int) -> str:
    if status == 504:
        return "timeout"
    return "error" if status >= 500 else "rejected"


def invalid(message: str, *, code: str = "invalid_value", param: str | None = None) -> ApiError:
    return ApiError(400, message, code=code, param=param)


def unsupported(param: str, message: str) -> ApiError:
    """A declared field with a value this server cannot honour."""
    return ApiError(400, f"{param} {message}", code="unsupported", param=param)


# --- field types -----------------------------------------------------------------


def _valid_unicode(text: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PydanticCustomError(
            "invalid_unicode",
            "holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not valid Unicode",
        ) from None
    return text


def _json_kind(value: Any) -> str | None:
    """Picks a union member by the JSON type of the value, so that errors name its path."""
    if isinstance(value, str):
        return "<string>"
    return "<list>" if isinstance(value, list) else None


def _prompt_kind(value: Any) -> str | None:
    """One prompt (text or token ids) or a list of prompts (of texts or of id lists)."""
    if isinstance(value, str):
        return "<string>"
    if not isinstance(value, list):
        return None
    if value and all(isinstance(item, str) for item in value):
        return "<strings>"
    if value and all(isinstance(item, list) for item in value):
        return "<id lists>"
    return "<list>"


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[Text, Field(min_length=1)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
# checked against the model's vocabulary once the request is valid (protocol_parse)
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Annotated[
    Annotated[NonEmptyText, Tag("<string>")]
    | Annotated[list[NonEmptyText], Tag("<strings>"), Field(max_length=MAX_SEQUENCES)]
    | Annotated[list[TokenIds], Tag("<id lists>"), Field(max_length=MAX_SEQUENCES)]
    | Annotated[TokenIds, Tag("<list>")],
    Discriminator(
        _prompt_kind,
        custom_error_type="invalid_type",
        custom_error_message="must be a string, a list of integer token ids, or a list of either",
    ),
]
Stop = Annotated[
    Annotated[StopText, Tag("<string>")]
    | Annotated[list[StopText], Tag("<list>"), Field(max_length=MAX_STOP_SEQUENCES)],
    Discriminator(
        _json_kind,
        custom_error_type="invalid_type",
        custom_error_message="must be a string or a list of strings",
    ),
]
MaxTokens = Annotated[int, Field(ge=1)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
# a JSON object whose content this server reads no further (a no-op hint, or a feature
# refused unless null)
Json = dict[str, Any]


class Lenient(BaseModel):
    # strict: "5" is not an integer, 1 is not true. Unknown fields are kept, to be
    # named in the log and otherwise ignored (protocol_parse.unknown_fields).
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(Lenient):
    include_usage: bool | None = None
    include_obfuscation: bool | None = Field(None, description="Accepted; nothing to obfuscate.")


class SamplingFields(Lenient):
    """What both endpoints accept beyond their prompt. `null` is each field's default."""

    model: Text | None = Field(None, description="Must be the served model's name.")
    temperature: float | None = Field(
        None,
        ge=0.0,
        le=2.0,
        description="Default: the model's generation_config, else 1. 0 (and below "
        f"{GREEDY_BELOW_TEMPERATURE:g}) is greedy.",
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="-1 and 0: every token.")
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[Text, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS, description="Token id (as a string) -> bias."
    )
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Makes sampling reproducible.")
    stop: Stop | None = Field(None, description="Up to 4 strings that end the completion.")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    min_tokens: int | None = Field(None, ge=0, description="EOS and stop tokens wait this long.")
    stream: bool | None = None
    stream_options: StreamOptions | None = Field(None, description="Only with `stream`.")
    ignore_eos: bool | None = Field(None, description="Generate past the end-of-sequence token.")
    n: int | None = Field(None, ge=1, le=MAX_N, description="Choices per prompt.")
    user: Text | None = None
    priority: int | None = Field(
        None,
        ge=-MAX_REQUEST_PRIORITY,
        le=MAX_REQUEST_PRIORITY,
        description="vLLM's: lower is served earlier. Picks the SLO class when no "
        "x-gateway-inference-objective header names one (docs/server.md).",
    )


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(
        None, ge=0, description=f"Default {DEFAULT_MAX_TOKENS}; 0 only with `echo`."
    )
    echo: bool | None = Field(None, description="The prompt before the completion.")
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="Top k per token.")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Only equal to `n`.")
    suffix: Literal[""] | None = Field(None, description="Only null or empty: no insertion.")


class TextPart(Lenient):
    type: Literal["text"]
    text: Text


Content = Annotated[
    Annotated[Text, Tag("<string>")] | Annotated[list[TextPart], Tag("<list>")],
    Discriminator(
        _json_kind,
        custom_error_type="invalid_type",
        custom_error_message='must be a string or a list of {"type": "text", "text": ...} parts',
    ),
]


class FunctionCall(Lenient):
    name: Text
    arguments: Text = Field(description="JSON text, as the model wrote it.")


class ToolCall(Lenient):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"] = Field(
        description="`developer` is a system turn; `function` is the deprecated tool turn."
    )
    content: Content | None = Field(
        None, description="Null only in an assistant turn with tool_calls or function_call."
    )
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = None
    refusal: Text | None = None


class FunctionDefinition(Lenient):
    name: NonEmptyText
    description: Text | None = None
    parameters: Json | None = None
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: NonEmptyText


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


def _choice_kind(value: Any) -> str | None:
    return "<string>" if isinstance(value, str) else "<object>"


# "required" and a named tool: decoding constrained to a call (grammar_compiler.py)
ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("<string>")]
    | Annotated[NamedToolChoice, Tag("<object>")],
    Discriminator(
        _choice_kind,
        custom_error_type="invalid_type",
        custom_error_message='must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
    ),
]
FunctionCallChoice = Annotated[
    Annotated[Literal["none", "auto"], Tag("<string>")] | Annotated[NamedFunction, Tag("<object>")],
    Discriminator(
        _choice_kind,
        custom_error_type="invalid_type",
        custom_error_message='must be "none", "auto" or {"name": ...}',
    ),
]


class JsonSchemaFormat(Lenient):
    name: Annotated[Text, Field(min_length=1, max_length=64)]
    description: Text | None = None
    schema_: Json | None = Field(
        None, alias="schema", description="The JSON schema the output matches (null: any object)."
    )
    strict: bool | None = Field(None, description="Honoured either way: no extra properties.")


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema.")


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = Field(None, description="Older name of max_completion_tokens.")
    max_completion_tokens: MaxTokens | None = Field(
        None, description="Default: what the model's context leaves after the prompt."
    )
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS, description="With logprobs.")
    tools: list[Tool] | None = Field(None, description="Rendered by the chat template.")
    tool_choice: ToolChoice | None = Field(
        None, description='"required" and a named tool constrain the output to a call.'
    )
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDefinition] | None = Field(None, description="Rendered as tools.")
    function_call: FunctionCallChoice | None = Field(None, description="Older tool_choice.")
    response_format: ResponseFormat | None = Field(
        None, description="json_object and json_schema: grammar-constrained output."
    )
    # accepted whatever their value: hints that change nothing this server computes
    metadata: dict[Text, Text] | None = None
    store: Literal[False] | None = Field(None, description="Only false: nothing is stored.")
    service_tier: Text | None = None
    prompt_cache_key: Text | None = None
    prompt_cache_retention: Text | None = None
    prompt_cache_options: Json | None = None
    reasoning_effort: Text | None = None
    verbosity: Text | None = None
    safety_identifier: Text | None = None
    prediction: Json | None = Field(None, description="Accepted; speeds nothing up here.")
    modalities: list[Literal["text"]] | None = Field(None, description='Only ["text"].')
    # features this server does not have: only null
    audio: None = Field(None, description="Only null: no audio output.")
    moderation: None = Field(None, description="Only null: no moderation.")
    web_search_options: None = Field(None, description="Only null: no web search.")


class TokenizeRequest(Lenient):
    """POST /tokenize, as vLLM: a `prompt`, or chat `messages` rendered by the template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="Default: true for a prompt.")
    add_generation_prompt: bool | None = Field(None, description="Default: true.")
    return_token_strs: bool | None = None
    tools: list[Tool] | None = None


class DetokenizeRequest(Lenient):
    model: Text | None = None
    tokens: list[TokenId]


# --- the error answer ----------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None = Field(description="The request field at fault, if one is.")


class ErrorResponse(BaseModel):
    error: ErrorDetail
