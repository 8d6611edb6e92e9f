"""Reading requests: the body, its JSON, its validation, and what it asks the engine for.

Every mistake of the caller becomes an `ApiError` with a 4xx status and OpenAI's error
shape `{"error": {"message", "type", "code", "param"}}` naming the field, never a 500.
The wire models themselves are protocol.py's.
"""

from __future__ import annotations

import json
import logging
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache
from typing import Any, TypeVar

from batchpilot_server.batching_config import brief
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.generation_defaults import MODEL_NEUTRAL, GenerationDefaults
from batchpilot_server.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_SEED,
    MAX_SEQUENCES,
    ApiError,
    BatchingUpdate,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    SamplingFields,
    TokenizeRequest,
    Tool,
    ToolCall,
    invalid,
    unsupported,
)
from batchpilot_server.tokenizer import ChatTemplateError, Tokenizer
from pydantic import BaseModel, TypeAdapter, ValidationError

log = logging.getLogger("batchpilot.server")

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
TOKENIZE_REQUEST = TypeAdapter(TokenizeRequest)
DETOKENIZE_REQUEST = TypeAdapter(DetokenizeRequest)


def read_batching_update(body: Any) -> BatchingUpdate:
    update = validate(BATCHING_UPDATE, body)
    if not update:
        fields = ", ".join(_fields(BATCHING_UPDATE))
        raise invalid(f"request body names no field to change; send one of {fields}")
    return update


# --- fields this server does not know ------------------------------------------------

# the log line names this many unknown fields at most, each cut to this length
MAX_NAMED_UNKNOWN = 16
MAX_UNKNOWN_NAME = 64


def unknown_fields(model: BaseModel, path: str = "") -> list[str]:
    """The paths of every field no model declares (`messages[0].reasoning`), in order."""
    names = [_join(path, key) for key in model.model_extra or {}]
    for name in type(model).model_fields:
        names += _unknown_in(getattr(model, name), _join(path, name))
    return names


def _unknown_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, path)
    if isinstance(value, list) and value and isinstance(value[0], BaseModel | list):
        # (a prompt of token ids is a long list of plain integers: not walked)
        return [name for i, item in enumerate(value) for name in _unknown_in(item, f"{path}[{i}]")]
    return []


def _join(path: str, key: str) -> str:
    # escaped: a name may hold a newline or a lone surrogate, and the log line is one line
    key = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in key[:MAX_UNKNOWN_NAME])
    return f"{path}.{key}" if path else key


def log_unknown_fields(model: BaseModel, route: str) -> None:
    """One log line per request naming what was ignored, as vLLM logs it."""
    names = unknown_fields(model)
    if not names:
        return
    more = len(names) - MAX_NAMED_UNKNOWN
    listed = ", ".join(names[:MAX_NAMED_UNKNOWN]) + (f" and {more} more" if more > 0 else "")
    log.warning("%s: ignored request fields this server does not know: %s", route, listed)


# --- what a request asks the engine for ---------------------------------------------


@dataclass(frozen=True)
class Served:
    """What the server serves: the bounds every request is checked against."""

    model_name: str
    max_model_len: int
    tokenizer: Tokenizer
    limits: Limits
    defaults: GenerationDefaults = MODEL_NEUTRAL


@dataclass(frozen=True)
class PromptInput:
    ids: list[int]
    text: str  # what `echo` prepends: the prompt as sent, or its token ids decoded


@dataclass(frozen=True)
class GrammarRequest:
    """What a request wants its output to match (grammar_compiler.py compiles it): any
    JSON object, or a JSON schema. `param`: the request field an error names."""

    schema: dict[str, Any] | None  # None: any JSON object (json_object)
    param: str

    @property
    def key(self) -> str:
        """The schema's text, as the compiled grammars are cached by (keys in their
        order: the output writes properties in the schema's order)."""
        return "" if self.schema is None else json.dumps(self.schema)


@dataclass(frozen=True)
class GenerationRequest:
    """A valid request of either endpoint: `n` engine sequences per prompt, each its own
    choice, indexed prompt-major (choice p*n + j: prompt p's j-th), as OpenAI does."""

    prompts: tuple[PromptInput, ...]
    params: SamplingParams
    n: int = 1
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage_chunk: bool = False
    echo: bool = False
    # top log-probabilities per token on the wire (0: the chosen token's only); None: none
    logprobs: int | None = None
    # False for `max_tokens: 0` with `echo`: the engine's one token is not answered
    output: bool = True
    # the output constrained to a grammar (compiled by the app before submit)
    grammar: GrammarRequest | None = None
    # the tools offered (tool_choice not "none"): their calls are parsed from the output
    tool_names: tuple[str, ...] = ()

    @property
    def prompt_ids(self) -> list[int]:
        """The only prompt of a chat request (a completions request may hold several)."""
        return self.prompts[0].ids

    @property
    def max_tokens(self) -> int:
        return self.params.max_tokens

    @property
    def prompt_tokens(self) -> int:
        """Usage counts each prompt once, however many choices it has (as vLLM)."""
        return sum(len(prompt.ids) for prompt in self.prompts)

    def sequences(self) -> Iterator[tuple[int, PromptInput, SamplingParams]]:
        """(choice index, prompt, params) per engine sequence; a seeded request's
        choices get seeds seed, seed + 1, ... so that they differ yet reproduce."""
        seed = self.params.seed
        for p, prompt in enumerate(self.prompts):
            for j in range(self.n):
                index = p * self.n + j
                params = self.params
                if seed is not None and index:
                    params = replace(params, seed=(seed + index) % (MAX_SEED + 1))
                yield index, prompt, params


def read_completion(body: Any, served: Served) -> GenerationRequest:
    request = validate(COMPLETION_REQUEST, body)
    log_unknown_fields(request, "/v1/completions")
    _check_model(request.model, served.model_name)
    n = request.n or 1
    if request.best_of is not None and request.best_of != n:
        raise unsupported(
            "best_of",
            f"must equal n ({n}): choosing the best of several completions is not supported",
        )
    echo = bool(request.echo)
    prompts = _completion_prompts(request.prompt, served.tokenizer)
    _check_sequences(len(prompts), n, "prompt" if len(prompts) > 1 else "n")
    max_tokens = request.max_tokens
    if max_tokens is None:  # a default, not a request: it shrinks to the server's limit
        limit = served.limits.max_tokens
        max_tokens = DEFAULT_MAX_TOKENS if limit is None else min(DEFAULT_MAX_TOKENS, limit)
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens must be at least 1, got 0 (0 only with echo)", param="max_tokens")
    for i, prompt in enumerate(prompts):
        field = (
            f"prompt[{i}]" if isinstance(request.prompt, list) and len(prompts) > 1 else "prompt"
        )
        _check_lengths(len(prompt.ids), max(max_tokens, 1), served, (field, "max_tokens"))
        if echo and request.logprobs is not None:
            _check_echo_length(len(prompt.ids), served.limits, field)
    params = _sampling(
        request,
        served,
        max(max_tokens, 1),  # the engine makes one token at least; `output` drops it
        logprobs=request.logprobs,
        prompt_logprobs=request.logprobs if echo else None,
    )
    return _generation(request, prompts, params, n, echo=echo, output=max_tokens > 0)


def _completion_prompts(prompt: Any, tokenizer: Tokenizer) -> list[PromptInput]:
    if isinstance(prompt, str):
        return [PromptInput(list(tokenizer.encode(prompt)), prompt)]
    if prompt and isinstance(prompt[0], str):
        return [PromptInput(list(tokenizer.encode(text)), text) for text in prompt]
    if prompt and isinstance(prompt[0], list):
        for i, ids in enumerate(prompt):
            _check_token_ids(ids, tokenizer.vocab_size, f"prompt[{i}]")
        return [PromptInput(list(ids), tokenizer.decode(ids)) for ids in prompt]
    _check_token_ids(prompt, tokenizer.vocab_size, "prompt")
    return [PromptInput(list(prompt), tokenizer.decode(prompt))]


def _check_sequences(prompts: int, n: int, param: str) -> None:
    if prompts * n > MAX_SEQUENCES:
        raise invalid(
            f"{param}: {prompts} prompts x n={n} asks for {prompts * n} completions; this "
            f"server runs at most {MAX_SEQUENCES} per request",
            param=param,
        )


def _check_echo_length(prompt_len: int, limits: Limits, field: str) -> None:
    if prompt_len > limits.max_echo_logprob_tokens:
        raise invalid(
            f"{field} has {prompt_len} tokens; echo with logprobs scores at most "
            f"{limits.max_echo_logprob_tokens} prompt tokens (echo without logprobs has no cap)",
            code="context_length_exceeded",
            param=field,
        )


def read_chat(body: Any, served: Served) -> GenerationRequest:
    request = validate(CHAT_REQUEST, body)
    log_unknown_fields(request, "/v1/chat/completions")
    _check_model(request.model, served.model_name)
    tools = _template_tools(request.tools, request.functions)
    prompt_ids = render_chat_ids(served.tokenizer, request.messages, tools)
    n = request.n or 1  # at most MAX_N, below MAX_SEQUENCES
    if request.max_completion_tokens is not None:
        max_tokens, field = request.max_completion_tokens, "max_completion_tokens"
    elif request.max_tokens is not None:
        max_tokens, field = request.max_tokens, "max_tokens"
    else:  # as OpenAI: what the context leaves; too little of it is the prompt's fault
        room = served.max_model_len - len(prompt_ids)
        limit = served.limits.max_tokens
        max_tokens, field = max(1, room if limit is None else min(room, limit)), "messages"
    _check_lengths(len(prompt_ids), max_tokens, served, ("messages", field))
    if request.top_logprobs and not request.logprobs:
        raise invalid("top_logprobs needs logprobs: true", param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    params = _sampling(request, served, max_tokens, logprobs=logprobs, prompt_logprobs=None)
    prompt = PromptInput(prompt_ids, "")
    generation = _generation(request, [prompt], params, n, echo=False, output=True)
    grammar, tool_names = _structure(request, tools)
    if grammar is not None:
        _check_grammar_params(request)
    return replace(generation, grammar=grammar, tool_names=tool_names)


def _structure(
    request: ChatCompletionRequest, tools: list[dict[str, Any]] | None
) -> tuple[GrammarRequest | None, tuple[str, ...]]:
    """The grammar `response_format` or a forced tool choice asks for, and the names of
    the tools whose calls are parsed from the output."""
    functions = [tool["function"] for tool in tools or ()]
    names = tuple(function["name"] for function in functions)
    choice: Any = request.tool_choice
    param = "tool_choice"
    if choice is None and request.function_call is not None:
        choice, param = request.function_call, "function_call"
    if not isinstance(choice, str) and choice is not None:  # a named function
        name = choice.function.name if hasattr(choice, "function") else choice.name
        if name not in names:
            offered = ", ".join(names) or "none"
            raise invalid(
                f"{param} names the function {brief(printable(name))}, which is not among "
                f"the tools offered ({brief(offered)})",
                param=param,
            )
        functions, choice = [f for f in functions if f["name"] == name], "required"
    if choice == "required" and not functions:
        raise invalid(f"{param} is required, but the request offers no tools", param=param)
    if choice == "none":
        names = ()
    forced = _call_grammar(functions, param) if choice == "required" else None
    formatted = _response_grammar(request)
    if forced is not None and formatted is not None:
        raise invalid(
            "response_format cannot be combined with a required or named tool_choice: both "
            "constrain the output",
            param="response_format",
        )
    return forced or formatted, names


def _response_grammar(request: ChatCompletionRequest) -> GrammarRequest | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return GrammarRequest(None, "response_format")
    if response_format.json_schema is None:
        raise invalid(
            "response_format.json_schema is required with type json_schema",
            code="missing_field",
            param="response_format.json_schema",
        )
    schema = response_format.json_schema.schema_
    return GrammarRequest(schema, "response_format.json_schema.schema")


def _call_grammar(functions: list[dict[str, Any]], param: str) -> GrammarRequest:
    """One call of one of `functions`, written as Llama 3.1's JSON: {"name", "arguments"}.
    Each tool's `$defs` move to the root, where its `#/$defs/...` references point."""
    defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
    options = []
    for function in functions:
        arguments = dict(function.get("parameters") or {"type": "object"})
        for key, found in defs.items():
            found.update(arguments.pop(key, None) or {})
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": arguments},
                "required": ["name", "arguments"],
            }
        )
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    return GrammarRequest({**schema, **{key: found for key, found in defs.items() if found}}, param)


def _check_grammar_params(request: ChatCompletionRequest) -> None:
    """What structured output cannot honour: it must be free to end on EOS once the
    output is complete."""
    if request.ignore_eos:
        raise unsupported("ignore_eos", "cannot be combined with structured output")
    if request.min_tokens:
        raise unsupported("min_tokens", "cannot be combined with structured output")


def _template_tools(
    tools: list[Tool] | None, functions: list[Any] | None
) -> list[dict[str, Any]] | None:
    """The tools as transformers' apply_chat_template passes them (`tools=`): OpenAI's
    `{"type": "function", "function": {...}}` dicts; deprecated `functions` become such."""
    if tools:
        return [tool.model_dump(exclude_none=True) for tool in tools]
    if functions:
        return [
            {"type": "function", "function": function.model_dump(exclude_none=True)}
            for function in functions
        ]
    return None


def render_chat_ids(
    tokenizer: Tokenizer,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    turns = [_for_template(message, i) for i, message in enumerate(messages)]
    try:
        text = tokenizer.render_chat(
            turns, add_generation_prompt=add_generation_prompt, tools=tools
        )
    except ChatTemplateError as exc:
        raise invalid(str(exc), code="chat_template_error", param="messages") from exc
    # The template writes the special tokens itself, as transformers renders it.
    return tokenizer.encode(text, add_special_tokens=False)


# roles as chat templates know them: `developer` is OpenAI's newer name of the system turn
_TEMPLATE_ROLES = {"developer": "system", "function": "tool"}


def _for_template(message: ChatMessage, index: int) -> dict[str, Any]:
    """The message as chat templates read it (as vLLM and transformers hand it over):
    text parts joined into one string, tool-call arguments as the JSON object they hold.
    An assistant turn's null content (beside its tool calls) becomes "", as vLLM renders
    it: templates join content to text (SmolLM2's `+ message['content'] +`), and those
    that test it (`if message['content']`) read "" as they read null."""
    content = message.content
    calls = list(message.tool_calls or ())
    if content is None and not (message.role == "assistant" and (calls or message.function_call)):
        param = f"messages[{index}].content"
        raise invalid(
            f"{param} is required (null only in an assistant turn with tool_calls)",
            code="missing_field",
            param=param,
        )
    if isinstance(content, list):
        content = "\n".join(part.text for part in content)
    turn: dict[str, Any] = {"role": _TEMPLATE_ROLES.get(message.role, message.role)}
    turn["content"] = content or ""
    if message.name is not None:
        turn["name"] = message.name
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    if message.function_call is not None:
        calls.append(_legacy_call(message, index))
    if calls:
        turn["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {
                    "name": call.function.name,
                    "arguments": _arguments(call.function.arguments),
                },
            }
            for call in calls
        ]
    return turn


def _legacy_call(message: ChatMessage, index: int) -> ToolCall:
    assert message.function_call is not None
    return ToolCall(id=f"call_{index}", function=message.function_call)


def _arguments(text: str) -> Any:
    """Templates index the arguments (`tool_call.arguments | tojson`, `.items()`): the
    object the JSON text holds, as vLLM passes it; text that is no object stays text."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return text
    return value if isinstance(value, dict) else text


def _sampling(
    request: SamplingFields,
    served: Served,
    max_tokens: int,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    defaults, vocab_size = served.defaults, served.tokenizer.vocab_size
    top_k = defaults.top_k if request.top_k is None else request.top_k
    min_tokens = request.min_tokens or 0
    if min_tokens > max_tokens:
        raise invalid(
            f"min_tokens is {brief(min_tokens)}, more than the {max_tokens} tokens asked for",
            param="min_tokens",
        )
    stop_ids = tuple(request.stop_token_ids or ())
    _check_token_ids(list(stop_ids), vocab_size, "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_default(request.temperature, defaults.temperature),
        top_p=_default(request.top_p, defaults.top_p),
        seed=request.seed,
        stop_token_ids=stop_ids,
        ignore_eos=bool(request.ignore_eos),
        top_k=0 if top_k < 0 or top_k >= vocab_size else top_k,  # -1, 0, all: every token
        min_p=_default(request.min_p, defaults.min_p),
        repetition_penalty=_default(request.repetition_penalty, defaults.repetition_penalty),
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias, vocab_size),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} with its keys read as the ids they spell."""
    entries = []
    for key, value in (bias or {}).items():
        param = f"logit_bias.{printable(key)}"
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise invalid(
                f"{param}: {brief(printable(key))} is not a token id of this model's "
                f"vocabulary 0..{vocab_size - 1}",
                code="invalid_token_id",
                param=param,
            )
        if value:
            entries.append((int(key), value))
    return tuple(entries)


def _generation(
    request: CompletionRequest | ChatCompletionRequest,
    prompts: list[PromptInput],
    params: SamplingParams,
    n: int,
    *,
    echo: bool,
    output: bool,
) -> GenerationRequest:
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed when stream is true", param="stream_options")
    stop = request.stop
    return GenerationRequest(
        prompts=tuple(prompts),
        params=params,
        n=n,
        stop=(stop,) if isinstance(stop, str) else tuple(stop or ()),
        stream=bool(request.stream),
        include_usage_chunk=bool(request.stream_options and request.stream_options.include_usage),
        echo=echo,
        logprobs=params.logprobs,
        output=output,
    )


def _check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(
                f"{field}[{index}] is {brief(token)}, not a token id of this model's "
                f"vocabulary 0..{vocab_size - 1}",
                code="invalid_token_id",
                param=f"{field}[{index}]",
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


# --- tokenize and detokenize ------------------------------------------------------


@dataclass(frozen=True)
class Tokenized:
    ids: list[int]
    token_strs: bool  # the answer spells each token


def read_tokenize(body: Any, served: Served) -> Tokenized:
    """vLLM's POST /tokenize: a `prompt`, or `messages` rendered by the chat template."""
    request = validate(TOKENIZE_REQUEST, body)
    log_unknown_fields(request, "/tokenize")
    _check_model(request.model, served.model_name)
    tokenizer = served.tokenizer
    if (request.prompt is None) == (request.messages is None):
        raise invalid("send either prompt or messages, not both or neither", param="prompt")
    if request.messages is not None:
        tools = _template_tools(request.tools, None)
        generation_prompt = request.add_generation_prompt is not False
        ids = render_chat_ids(
            tokenizer, request.messages, tools, add_generation_prompt=generation_prompt
        )
        if request.add_special_tokens and tokenizer.bos_id is not None:
            ids = [tokenizer.bos_id, *ids]
    else:
        assert request.prompt is not None
        ids = tokenizer.encode(
            request.prompt, add_special_tokens=request.add_special_tokens is not False
        )
    return Tokenized(list(ids), bool(request.return_token_strs))


def read_detokenize(body: Any, served: Served) -> list[int]:
    request = validate(DETOKENIZE_REQUEST, body)
    log_unknown_fields(request, "/detokenize")
    _check_model(request.model, served.model_name)
    _check_token_ids(request.tokens, served.tokenizer.vocab_size, "tokens")
    return request.tokens
