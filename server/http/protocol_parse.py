"""Reading requests: each endpoint's body, validated, as what it asks the engine for.

Every mistake of the caller becomes an `ApiError` with a 4xx status and OpenAI's error
shape `{"error": {"message", "type", "code", "param"}}` naming the field, never a 500.
The wire models are protocol.py's; the body's bytes and JSON are request_body.py's,
validation's wording request_validation.py's, the chat prompt chat_prompt.py's, output
grammars grammar_request.py's and the sampling fields sampling_fields.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from batchpilot_server.batching_config import brief
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.http.chat_prompt import render_chat_ids, template_tools
from batchpilot_server.http.generation_defaults import MODEL_NEUTRAL, GenerationDefaults
from batchpilot_server.http.grammar_request import (
    GrammarRequest,
    check_grammar_params,
    output_structure,
)
from batchpilot_server.http.protocol import (
    DEFAULT_MAX_TOKENS,
    MAX_SEED,
    MAX_SEQUENCES,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    Limits,
    TokenizeRequest,
    invalid,
    unsupported,
)
from batchpilot_server.http.request_validation import log_unknown_fields, validate
from batchpilot_server.http.sampling_fields import check_token_ids, sampling_params
from batchpilot_server.tokenizer import Tokenizer
from pydantic import TypeAdapter


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
    # the body's `priority` (vLLM's: lower earlier); slo_class.py maps it to a class
    priority: int | None = None

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


COMPLETION_REQUEST = TypeAdapter(CompletionRequest)
CHAT_REQUEST = TypeAdapter(ChatCompletionRequest)
TOKENIZE_REQUEST = TypeAdapter(TokenizeRequest)
DETOKENIZE_REQUEST = TypeAdapter(DetokenizeRequest)


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
    params = sampling_params(
        request,
        served.defaults,
        served.tokenizer.vocab_size,
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
            check_token_ids(ids, tokenizer.vocab_size, f"prompt[{i}]")
        return [PromptInput(list(ids), tokenizer.decode(ids)) for ids in prompt]
    check_token_ids(prompt, tokenizer.vocab_size, "prompt")
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
    tools = template_tools(request.tools, request.functions)
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
    params = sampling_params(
        request,
        served.defaults,
        served.tokenizer.vocab_size,
        max_tokens,
        logprobs=logprobs,
        prompt_logprobs=None,
    )
    prompt = PromptInput(prompt_ids, "")
    generation = _generation(request, [prompt], params, n, echo=False, output=True)
    grammar, tool_names = output_structure(request, tools)
    if grammar is not None:
        check_grammar_params(request)
    return replace(generation, grammar=grammar, tool_names=tool_names)


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
        priority=request.priority,
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
        tools = template_tools(request.tools, None)
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
    check_token_ids(request.tokens, served.tokenizer.vocab_size, "tokens")
    return request.tokens
