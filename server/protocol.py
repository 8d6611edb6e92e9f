"""The OpenAI-compatible wire format, declared once.

The pydantic models below are both the validation of what callers send and
the source of `/openapi.json` (openapi.py). Every mistake of the caller
becomes an `ApiError` with a 4xx status and OpenAI's error shape
`{"error": {"message", "type", "code", "param"}}` naming the field, never a 500.
"""

from __future__ import annotations

import json
import re
import zlib
from dataclasses import dataclass
from functools import cache
from typing import Annotated, Any, Literal, TypeVar

from batchpilot_server.batching_config import (
    MAX_BATCH_SIZE_LIMIT,
    MAX_BATCH_TIMEOUT_MS,
    MAX_QUEUE_SIZE_LIMIT,
    Mode,
    brief,
)
from batchpilot_server.engine_api import GREEDY_BELOW_TEMPERATURE, FinishReason
from batchpilot_server.tokenizer import ChatTemplateError, Tokenizer
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
)
from pydantic_core import PydanticCustomError
from typing_extensions import TypedDict

# OpenAI's default when a completion request names no `max_tokens`.
DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256
# torch.Generator.manual_seed takes 64 bits; OpenAI's seed is a non-negative integer.
MAX_SEED = 2**64 - 1


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; the CLI and tests choose them."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: bounded by the model's context only
    max_tokens: int | None = None  # None: bounded by the model's context only
    queue_timeout_s: float = 30.0  # how long a request may wait unscheduled
    retry_after_s: int = 1  # what a 429 / 503 tells the caller to wait


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


# --- reading a JSON body -----------------------------------------------------------

# zlib's window bits per HTTP content coding (RFC 9110 8.4.1)
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode_body(raw: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body with its Content-Encoding undone (the server reads bodies raw so that a
    body that is not what its header says gets a 400 here, and a small compressed body
    cannot unpack past `max_bytes`)."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    for coding in reversed([c for c in codings if c and c != "identity"]):
        if coding not in _CODINGS:
            raise ApiError(
                415,
                f"Content-Encoding {printable(coding)!r} is not supported; send the body "
                "as is, or with gzip or deflate",
                code="unsupported_content_encoding",
            )
        raw = _decompress(raw, coding, max_bytes)
    return raw


def _decompress(raw: bytes, coding: str, max_bytes: int) -> bytes:
    decompressor = zlib.decompressobj(_CODINGS[coding])
    try:
        data = decompressor.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise invalid(
            f"request body is not {coding} data, as its Content-Encoding says: {exc}",
            code="invalid_content_encoding",
        ) from None
    if len(data) > max_bytes:
        raise ApiError(
            413,
            f"request body unpacks to more than the limit of {max_bytes} bytes",
            code="body_too_large",
        )
    if not decompressor.eof or decompressor.unused_data:
        raise invalid(
            f"request body is not one whole {coding} stream, as its Content-Encoding says",
            code="invalid_content_encoding",
        )
    return data


_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def parse_json_body(raw: bytes) -> Any:
    if not raw.strip():
        raise invalid("request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        field = _deepest_field(raw.decode("utf-8", errors="replace"))
        where = f"field {field}" if field else "request body"
        raise invalid(
            f"{where} is nested too deeply to read; this API's JSON nests a few levels at most",
            code="nesting_too_deep",
            param=field,
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from None


def _parse_int(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:
        # Beyond Python's int/str digit limit: its magnitude is all any limit here
        # needs, and the field it sits in gets the error that names it.
        digits = len(literal.lstrip("-"))
        return (-1 if literal.startswith("-") else 1) * 10 ** (digits - 1)


def _deepest_field(text: str) -> str | None:
    """The top-level key whose value nests deepest (None: not an object, or the body
    itself). The last string met at depth 1 before a nested value opens is its key."""
    depth, key, deepest, deepest_key = 0, None, 0, None
    in_object = text.lstrip().startswith("{")
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token.startswith('"'):
            if depth == 1 and in_object:
                key = token
        elif token in "[{":
            depth += 1
            if depth > deepest:
                deepest, deepest_key = depth, key if depth > 1 else None
        else:
            depth -= 1
    if deepest_key is None:
        return None
    try:
        return printable(json.loads(deepest_key))
    except ValueError:
        return None


def printable(text: str) -> str:
    """`text` with lone surrogates spelled out, so that it can travel in a UTF-8 answer."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


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


def _only_one(n: int) -> int:
    if n != 1:
        raise PydanticCustomError("unsupported", "must be 1: one choice per request is supported")
    return n


def _not_batched(prompt: Any) -> Any:
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise PydanticCustomError(
            "unsupported", "holds several prompts; batched prompts are not supported, send one"
        )
    return prompt


Text = Annotated[str, AfterValidator(_valid_unicode)]
NonEmptyText = Annotated[Text, Field(min_length=1)]
StopText = Annotated[Text, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
# checked against the model's vocabulary once the request is valid (read_completion)
TokenId = Annotated[int, Field(json_schema_extra={"minimum": 0})]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Prompt = Annotated[
    Annotated[NonEmptyText, Tag("<string>")] | Annotated[TokenIds, Tag("<list>")],
    Discriminator(
        _json_kind,
        custom_error_type="invalid_type",
        custom_error_message="must be a string or a list of integer token ids",
    ),
    BeforeValidator(_not_batched),
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
OnlyOne = Annotated[int, AfterValidator(_only_one), Field(json_schema_extra={"enum": [1]})]


class Strict(BaseModel):
    # Unknown fields are refused so that a typo (`max_token`) fails loudly instead
    # of being ignored; strict: "5" is not an integer, 1 is not true.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """What both endpoints accept beyond their prompt."""

    model: Text | None = Field(None, description="Must be the served model's name.")
    temperature: float = Field(
        0.0, ge=0.0, le=2.0, description=f"0 (and below {GREEDY_BELOW_TEMPERATURE:g}) is greedy."
    )
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, le=MAX_SEED, description="Makes sampling reproducible.")
    stop: Stop | None = Field(None, description="Up to 4 strings that end the completion.")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="Only with `stream`.")
    ignore_eos: bool = Field(False, description="Generate past the end-of-sequence token.")
    n: OnlyOne = 1
    user: Text | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS


class TextPart(Strict):
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


class ChatMessage(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: Content
    name: Text | None = None
    tool_call_id: Text | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it: text parts joined into one string."""
        content = self.content
        if not isinstance(content, str):
            content = "\n".join(part.text for part in content)
        fields = {"name": self.name, "tool_call_id": self.tool_call_id}
        return {"role": self.role, "content": content} | {
            key: value for key, value in fields.items() if value is not None
        }


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: MaxTokens | None = Field(None, description="Older name of max_completion_tokens.")
    max_completion_tokens: MaxTokens | None = Field(
        None, description="Default: what the model's context leaves after the prompt."
    )


class BatchingUpdate(TypedDict, total=False):
    """A PUT /admin/batching body: the fields to change."""

    __pydantic_config__ = ConfigDict(  # type: ignore[misc]
        extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra={"minProperties": 1}
    )
    max_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE_LIMIT)]
    batch_timeout_ms: Annotated[float, Field(ge=0.0, le=MAX_BATCH_TIMEOUT_MS)]
    max_queue_size: Annotated[int, Field(ge=1, le=MAX_QUEUE_SIZE_LIMIT)]


# --- answers -------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None
    param: str | None = Field(description="The request field at fault, if one is.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None


class Completion(BaseModel):
    """The answer, and (with `stream`) each event: one per token, then `data: [DONE]`."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(None, exclude_if=lambda usage: usage is None)


class ChatCompletionMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatCompletionMessage
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = Field(None, exclude_if=lambda role: role is None)
    content: str | None = Field(None, exclude_if=lambda content: content is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    logprobs: None = None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """With `stream`, each event: the role first, one per token, then `data: [DONE]`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(None, exclude_if=lambda usage: usage is None)


class BatchingState(BaseModel):
    """The batching config in force."""

    max_batch_size: int
    batch_timeout_ms: float
    max_queue_size: int
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


# --- validation --------------------------------------------------------------------


T = TypeVar("T")


def validate(adapter: TypeAdapter[T], body: Any) -> T:
    """`body` as the declared type, or the ApiError naming the first field at fault."""
    try:
        return adapter.validate_python(body)
    except ValidationError as exc:
        raise _api_error(exc, adapter) from None


def _api_error(exc: ValidationError, adapter: TypeAdapter[Any]) -> ApiError:
    # Never str(exc): it prints the input, which may be an integer of thousands of
    # digits (Python refuses to) or nested a thousand levels deep.
    errors = exc.errors(include_url=False)
    wrong = [e for e in errors if e["type"] not in ("missing", "extra_forbidden")]
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    if unknown and not wrong:
        # A typo (`max_token`) shows as an unknown field and often a missing one: name the
        # unknown first. A wrong value of a known field comes before both.
        names = [_param(loc) for loc in unknown]
        allowed = f"; allowed: {', '.join(_fields(adapter))}" if len(unknown[0]) == 1 else ""
        verb = "is not a known field" if len(names) == 1 else "are not known fields"
        return invalid(f"{', '.join(names)} {verb}{allowed}", code="unknown_field", param=names[0])
    first = (wrong or errors)[0]
    param = _param(first["loc"]) or None
    code, predicate = _describe(first)
    return invalid(f"{param or 'request body'} {predicate}", code=code, param=param)


@cache
def _fields(adapter: TypeAdapter[Any]) -> tuple[str, ...]:
    return tuple(sorted(adapter.json_schema().get("properties", {})))


def _param(loc: tuple[int | str, ...]) -> str:
    """`messages[0].content`: the error's location without the union tags (`<list>`)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith("<"):
            path += f".{printable(part)}" if path else printable(part)
    return path


_TYPE_PREDICATES = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
    "none_required": "must be null",
}


def _describe(error: Any) -> tuple[str, str]:
    """(code, predicate) for one pydantic error: 'must be at least 1, got 0'."""
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return "missing_field", "is required"
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return "invalid_value", f"is out of range, got {brief(value)}"
    if kind == "string_unicode":  # pydantic meets a lone surrogate in a field name
        return "invalid_unicode", "holds a field name that is not valid Unicode (a lone surrogate)"
    if kind == "finite_number":
        return "invalid_value", "must be a finite number"
    if kind in _TYPE_PREDICATES:
        return "invalid_type", _TYPE_PREDICATES[kind]
    got = f", got {brief(value)}"
    bounds = {
        "greater_than_equal": ("must be at least", "ge"),
        "greater_than": ("must be greater than", "gt"),
        "less_than_equal": ("must be at most", "le"),
        "less_than": ("must be less than", "lt"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        return "invalid_value", f"{words} {ctx[key]}{got}"
    if kind in ("string_too_short", "too_short") and ctx.get("min_length") == 1:
        return "invalid_value", "must not be empty"
    if kind == "string_too_short":
        return "invalid_value", f"must hold at least {ctx['min_length']} characters"
    if kind == "string_too_long":
        return "invalid_value", f"must hold at most {ctx['max_length']} characters"
    if kind == "too_short":
        return "invalid_value", f"must hold at least {ctx['min_length']} items"
    if kind == "too_long":
        return "invalid_value", f"must hold at most {ctx['max_length']} items"
    if kind == "literal_error":
        return "invalid_value", f"must be {ctx['expected']}"
    # PydanticCustomError from the validators above: the type is the code.
    custom = kind in ("invalid_unicode", "invalid_type", "unsupported")
    return (kind if custom else "invalid_value"), error["msg"]


COMPLETION_REQUEST = TypeAdapter(CompletionRequest)
CHAT_REQUEST = TypeAdapter(ChatCompletionRequest)
BATCHING_UPDATE = TypeAdapter(BatchingUpdate)


def read_batching_update(body: Any) -> BatchingUpdate:
    update = validate(BATCHING_UPDATE, body)
    if not update:
        fields = ", ".join(_fields(BATCHING_UPDATE))
        raise invalid(f"request body names no field to change; send one of {fields}")
    return update


# --- what a request asks the engine for ---------------------------------------------


@dataclass(frozen=True)
class Served:
    """What the server serves: the bounds every request is checked against."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    limits: Limits


@dataclass(frozen=True)
class GenerationRequest:
    """A valid request of either endpoint, as the engine runs it."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage_chunk: bool = False
    ignore_eos: bool = False


def read_completion(body: Any, served: Served) -> GenerationRequest:
    request = validate(COMPLETION_REQUEST, body)
    prompt = request.prompt
    if isinstance(prompt, str):
        prompt_ids = list(served.tokenizer.encode(prompt))
    else:
        _check_token_ids(prompt, served.tokenizer.vocab_size)
        prompt_ids = list(prompt)
    max_tokens = request.max_tokens
    if "max_tokens" not in request.model_fields_set and served.limits.max_tokens is not None:
        max_tokens = min(max_tokens, served.limits.max_tokens)  # a default, not a request
    return _generation(request, prompt_ids, max_tokens, served, ("prompt", "max_tokens"))


def read_chat(body: Any, served: Served) -> GenerationRequest:
    request = validate(CHAT_REQUEST, body)
    messages = [message.for_template() for message in request.messages]
    tokenizer = served.tokenizer
    try:
        text = tokenizer.render_chat(messages, add_generation_prompt=True)
    except ChatTemplateError as exc:
        raise invalid(str(exc), code="chat_template_error", param="messages") from exc
    # The template writes the special tokens itself, as transformers renders it.
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    if request.max_completion_tokens is not None:
        max_tokens, field = request.max_completion_tokens, "max_completion_tokens"
    elif request.max_tokens is not None:
        max_tokens, field = request.max_tokens, "max_tokens"
    else:  # as OpenAI: what the context leaves; too little of it is the prompt's fault
        room = served.max_model_len - len(prompt_ids)
        limit = served.limits.max_tokens
        max_tokens, field = max(1, room if limit is None else min(room, limit)), "messages"
    return _generation(request, prompt_ids, max_tokens, served, ("messages", field))


def _check_token_ids(ids: list[int], vocab_size: int) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(
                f"prompt[{index}] is {brief(token)}, not a token id of this model's "
                f"vocabulary 0..{vocab_size - 1}",
                code="invalid_token_id",
                param=f"prompt[{index}]",
            )


def _generation(
    request: CompletionRequest | ChatCompletionRequest,
    prompt_ids: list[int],
    max_tokens: int,
    served: Served,
    fields: tuple[str, str],
) -> GenerationRequest:
    """`fields`: the request's fields that hold the prompt and that set max_tokens."""
    _check_model(request.model, served.model_name)
    _check_lengths(len(prompt_ids), max_tokens, served, fields)
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    stop = request.stop
    return GenerationRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stream=request.stream,
        include_usage_chunk=bool(request.stream_options and request.stream_options.include_usage),
        ignore_eos=request.ignore_eos,
    )


def _check_model(model: str | None, served_name: str) -> None:
    if model is not None and model != served_name:
        raise ApiError(
            404,
            f"model {brief(model)} does not exist; this server serves {served_name!r}",
            type_="not_found_error",
            code="model_not_found",
            param="model",
        )


def _check_lengths(
    prompt_len: int, max_tokens: int, served: Served, fields: tuple[str, str]
) -> None:
    prompt_field, field = fields
    limits = served.limits
    if prompt_len == 0:  # a tokenizer may encode some text to nothing
        raise invalid(f"{prompt_field} encodes to no tokens", param=prompt_field)
    if limits.max_prompt_tokens is not None and prompt_len > limits.max_prompt_tokens:
        raise invalid(
            f"prompt has {prompt_len} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens}",
            code="context_length_exceeded",
            param=prompt_field,
        )
    if limits.max_tokens is not None and max_tokens > limits.max_tokens:
        raise invalid(
            f"{field} is {brief(max_tokens)}; this server allows at most {limits.max_tokens}",
            param=field,
        )
    if prompt_len + max_tokens > served.max_model_len:
        wanted = brief(prompt_len + max_tokens)
        advice = "shorten the prompt" + ("" if field == prompt_field else f" or lower {field}")
        raise invalid(
            f"this model's maximum context length is {served.max_model_len} tokens, however "
            f"you requested {wanted} tokens ({prompt_len} in the prompt, {brief(max_tokens)} "
            f"for the completion); {advice}",
            code="context_length_exceeded",
            param=field,
        )


# --- stop strings -------------------------------------------------------------------


class StopMatcher:
    """Finds stop sequences in a growing completion text.

    `feed` returns the text that is safe to send now: the tail that could
    still be the start of a stop sequence is held back until it is decided.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, full_text: str) -> str:
        """`full_text` is the whole completion so far; returns the new text to emit."""
        self.text = full_text
        # A stop starting before `sent` was whole when that text went out, and was
        # not found then: searching from `sent` keeps a long completion linear.
        found = (full_text.find(s, self.sent) for s in self._stops)
        cut = min((i for i in found if i >= 0), default=-1)
        if cut >= 0:
            self.text = full_text[:cut]
            self.stopped = True
            safe_end = cut
        else:
            safe_end = len(full_text) - self._holdback
            # A partial UTF-8 character decodes to U+FFFD until its last byte arrives.
            while safe_end > self.sent and full_text[safe_end - 1] == "\ufffd":
                safe_end -= 1
        return self._emit(max(safe_end, self.sent))

    def flush(self) -> str:
        """The held-back text, once the completion has ended without a stop."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        chunk = self.text[self.sent : end]
        self.sent = end
        return chunk
