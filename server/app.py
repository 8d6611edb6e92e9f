"""The aiohttp application every server pod runs: OpenAI API, admin, probes, metrics.

The app owns its engine's lifecycle: it starts the engine on startup and shuts
it down on cleanup.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import cache
from typing import Any, Protocol

from aiohttp import web
from batchpilot_server.batching_config import BatchingConfig, ConfigError
from batchpilot_server.engine_api import (
    DeadlineExceededError,
    EngineOptions,
    EngineStats,
    EngineStoppedError,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
    TokenEvent,
)
from batchpilot_server.generation_defaults import (
    MODEL_NEUTRAL,
    GenerationDefaults,
    generation_defaults,
)
from batchpilot_server.grammar_compiler import GrammarCompiler
from batchpilot_server.metrics import CONTENT_TYPE, MetricsCompat, ServerMetrics
from batchpilot_server.openapi import openapi_document
from batchpilot_server.protocol import (
    ApiError,
    BatchingState,
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
    DetokenizeResponse,
    FunctionCall,
    Limits,
    ModelCard,
    ModelList,
    TokenizeResponse,
    ToolCall,
    Usage,
    VersionResponse,
    invalid,
)
from batchpilot_server.protocol_output import (
    ChoiceDelta,
    ChoiceOutput,
    LogprobEntry,
    TokenSpeller,
    chat_logprobs,
    completion_logprobs,
)
from batchpilot_server.protocol_parse import (
    GenerationRequest,
    Served,
    decode_body,
    parse_json_body,
    read_batching_update,
    read_chat,
    read_completion,
    read_detokenize,
    read_tokenize,
)
from batchpilot_server.slo_judge import RequestTiming, judge
from batchpilot_server.tokenizer import ChatTemplate, Tokenizer
from batchpilot_server.tool_calls import ParsedCall, ToolCallStream, parse_tool_calls
from pydantic import BaseModel

log = logging.getLogger("batchpilot.server")

# a fixed token, or where to get the one in force (TokenFile.current); None: admin API off
AdminToken = str | Callable[[], str] | None


class RequestStream(Protocol):
    def __aiter__(self) -> RequestStream: ...
    async def __anext__(self) -> TokenEvent: ...
    def cancel(self) -> None: ...


class EngineLike(Protocol):
    """The part of `batchpilot_server.engine.Engine` the app uses."""

    @property
    def config(self) -> BatchingConfig:
        """The batching config in force: the app keeps no copy."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def failure(self) -> str | None: ...

    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
    def abort(self, reason: str) -> None: ...
    def submit(
        self, prompt_token_ids: list[int], params: SamplingParams, *, deadline_s: float | None
    ) -> RequestStream: ...
    def reconfigure(self, config: BatchingConfig) -> None: ...
    def stats(self) -> EngineStats: ...


class InFlight:
    """Counts completion requests in progress, so that shutdown can wait for them."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every request finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


@dataclass
class ServerState:
    engine: EngineLike
    metrics: ServerMetrics
    limits: Limits
    admin_token: Callable[[], str] | None  # the token in force now (TokenFile.current)
    api_key: Callable[[], str] | None = None  # the OpenAI routes' bearer key; None: open
    chat_template: str | None = None  # --chat-template: replaces the model's at start
    defaults: GenerationDefaults = MODEL_NEUTRAL
    # response_format and forced tool calls: compiled once the engine has its tokenizer
    structured: GrammarCompiler | None = None
    config_version: int = 1  # of the engine's config: increases with every accepted PUT
    ready: bool = False
    draining: bool = False
    inflight: InFlight = field(default_factory=InFlight)

    @property
    def model_name(self) -> str:
        return self.metrics.model


STATE = web.AppKey("batchpilot_state", ServerState)


def create_app(
    engine: EngineLike,
    *,
    metrics: ServerMetrics,
    admin_token: AdminToken,
    limits: Limits,
    api_key: AdminToken = None,
    chat_template: str | None = None,
    defaults: GenerationDefaults = MODEL_NEUTRAL,
) -> web.Application:
    """The HTTP app around a not yet started engine built with `metrics` as its observer.

    `api_key` (a key, or where to get the one in force): the OpenAI routes and
    /tokenize, /detokenize then need `Authorization: Bearer <key>`; probes, /metrics,
    /version and /openapi.json stay open, the admin API keeps its own token."""
    state = ServerState(
        engine=engine,
        metrics=metrics,
        limits=limits,
        admin_token=_current(admin_token),
        api_key=_current(api_key),
        chat_template=chat_template,
        defaults=defaults,
    )
    metrics.set_config(engine.config)
    app = web.Application(
        client_max_size=limits.max_body_bytes,
        middlewares=[error_middleware, api_key_middleware],
        # aiohttp would unpack a compressed body in its parser, where one that is not what
        # its Content-Encoding says gets a plain-text 400 the app never sees: read_json does.
        handler_args={"auto_decompress": False},
    )
    app[STATE] = state
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
    app.router.add_get("/health", health)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics_endpoint)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/admin/batching", get_batching)
    app.router.add_put("/admin/batching", put_batching)
    app.on_startup.append(_start_engine)
    app.on_cleanup.append(_stop_engine)
    return app


def begin_drain(app: web.Application) -> None:
    """Graceful shutdown, step one: not ready, admit nothing new."""
    state = app[STATE]
    state.draining = True
    state.ready = False


async def wait_drained(app: web.Application, timeout_s: float) -> bool:
    """Graceful shutdown, step two: True when in-flight requests all finished in time."""
    return await app[STATE].inflight.wait_idle(timeout_s)


def end_in_flight(app: web.Application, reason: str) -> int:
    """Graceful shutdown, step three, when the grace ran out: every admitted request
    ends now with `reason`, a 503 (or, once a stream has begun, its final error event
    and `data: [DONE]`). Returns how many requests were in flight."""
    state = app[STATE]
    state.engine.abort(reason)
    return state.inflight.count


def _current(token: AdminToken) -> Callable[[], str] | None:
    return (lambda: token) if isinstance(token, str) else token


async def _start_engine(app: web.Application) -> None:
    state = app[STATE]
    await state.engine.start()
    if state.chat_template is not None:
        tokenizer = state.engine.tokenizer  # loaded by start
        special = tokenizer.chat_template.special_tokens
        tokenizer.chat_template = ChatTemplate(state.chat_template, special)
    phases = state.metrics.structured_output
    state.structured = GrammarCompiler(state.engine.tokenizer, phases["compile"], phases["mask"])
    state.ready = True


async def _stop_engine(app: web.Application) -> None:
    state = app[STATE]
    state.ready = False
    await state.engine.shutdown()
    if state.structured is not None:
        state.structured.close()


# --- errors ------------------------------------------------------------------

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_ERROR_CODES = {
    404: ("not_found_error", "route_not_found"),
    405: ("invalid_request_error", "method_not_allowed"),
    413: ("invalid_request_error", "body_too_large"),
}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as err:
        return error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(_from_http_exception(request, exc))
    except Exception:
        log.exception("unhandled error serving %s %s", request.method, request.path)
        return error_response(
            ApiError(500, "internal server error; see the server log", type_="server_error")
        )


def _from_http_exception(request: web.Request, exc: web.HTTPException) -> ApiError:
    type_, code = _HTTP_ERROR_CODES.get(exc.status, ("invalid_request_error", None))
    messages = {
        404: f"no route {request.path}; see /openapi.json for the endpoints",
        405: f"method {request.method} is not allowed on {request.path}",
        413: f"request body exceeds the limit of {request.app[STATE].limits.max_body_bytes} bytes",
    }
    message = messages.get(exc.status, exc.reason)
    headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
    return ApiError(exc.status, message, type_=type_, code=code, headers=headers)


def error_response(err: ApiError) -> web.Response:
    return _json_answer(err.answer(), status=err.status, headers=err.headers)


def _json_answer(
    answer: BaseModel, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    body = answer.model_dump_json().encode()
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")


async def read_json(request: web.Request) -> Any:
    """The request's JSON body, its Content-Encoding undone."""
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:  # e.g. a body shorter than its Content-Length
        raise invalid(f"request body could not be read: {exc}", code="invalid_body") from exc
    limit = request.app[STATE].limits.max_body_bytes
    return parse_json_body(decode_body(raw, request.headers.get("Content-Encoding"), limit))


# --- completions and chat ---------------------------------------------------------


class RequestReader(Protocol):
    def __call__(self, body: Any, served: Served) -> GenerationRequest: ...


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve_generation(request, read_completion, COMPLETION_FORMAT)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve_generation(request, read_chat, CHAT_FORMAT)


async def _serve_generation(
    request: web.Request, reader: RequestReader, answer_format: AnswerFormat
) -> web.StreamResponse:
    state = request.app[STATE]
    arrival = time.monotonic()
    state.metrics.arrivals.inc()
    state.inflight.enter()
    end = RequestEnd(state, arrival)
    try:
        response = await _generate(request, state, arrival, reader, answer_format, end)
        end.record("ok")  # a JSON answer: before aiohttp sends it
        return response
    except _StreamEnded as ended:
        end.record("error")
        return ended.response
    except ApiError as err:
        end.record(err.outcome, err.status)
        raise
    except web.HTTPException:
        end.record("rejected")
        raise
    finally:
        end.record("error")  # the client went away and the handler was cancelled
        state.inflight.leave()


# answers that are the server's failure to serve (queue full, shutting down or failed,
# queue timeout): they miss every stated SLO target; a client's own error is not judged
SLO_FAILURES = frozenset({429, 503, 504})


class RequestEnd:
    """Counts a request's outcome, an answered one's duration and TPOT, and its SLO
    verdict, once. A stream records them before its last bytes go out, so that a client
    which saw its request end finds it counted in /metrics (a load test reading the
    server's counters right after)."""

    def __init__(self, state: ServerState, arrival: float) -> None:
        self.state = state
        self.timing = RequestTiming(arrival)  # Generation records each token's time here
        self.recorded = False

    def record(self, outcome: str, status: int | None = None) -> None:
        """`status`: the error's HTTP status (an ApiError's), which says whether a
        request that did not complete counts against the SLO."""
        if self.recorded:
            return
        self.recorded = True
        metrics, now = self.state.metrics, time.monotonic()
        if outcome == "ok":
            metrics.request_duration.observe(now - self.timing.arrival_s)
            if (tpot := self.timing.tpot_s) is not None:
                metrics.request_tpot.observe(tpot)
        metrics.count_request(outcome)
        targets = self.state.engine.config.slo  # the targets in force as it ends
        if outcome == "ok":
            metrics.count_slo(judge(targets, self.timing, now))
        elif status in SLO_FAILURES:
            metrics.count_slo(judge(targets, None, now))


async def _generate(
    request: web.Request,
    state: ServerState,
    arrival: float,
    reader: RequestReader,
    answer_format: AnswerFormat,
    end: RequestEnd,
) -> web.StreamResponse:
    if state.draining:
        raise ApiError(
            503,
            "server is shutting down and admits no new requests; retry on another replica",
            type_="service_unavailable_error",
            code="shutting_down",
            headers={"Retry-After": str(state.limits.retry_after_s)},
            outcome="rejected",
        )
    parsed = reader(await read_json(request), _served(state))
    if parsed.grammar is not None:
        # before submit, in a worker thread: the engine thread only masks
        assert state.structured is not None  # set once the engine started
        grammar = await state.structured.compile(parsed.grammar)
        parsed = replace(parsed, params=replace(parsed.params, grammar=grammar))
    generation = Generation(state, parsed, end.timing, answer_format.id_prefix)
    try:
        if parsed.stream:
            return await _stream(request, generation, answer_format, end)
        while await generation.next_delta() is not None:
            pass
        return _json_answer(answer_format.answer(generation))
    finally:
        generation.close()


def _served(state: ServerState) -> Served:
    engine = state.engine
    return Served(
        state.model_name, engine.max_model_len, engine.tokenizer, state.limits, state.defaults
    )


class Generation:
    """One admitted request: its engine sequences (one per choice), their text deltas
    merged in the order they come, and the request's metrics."""

    def __init__(
        self, state: ServerState, parsed: GenerationRequest, timing: RequestTiming, id_prefix: str
    ) -> None:
        self.state = state
        self.parsed = parsed
        self.timing = timing
        self.arrival = timing.arrival_s
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = state.model_name
        tokenizer = state.engine.tokenizer
        self.speller = TokenSpeller(tokenizer)
        self.outputs: list[ChoiceOutput] = []
        self._streams: list[RequestStream] = []
        self._prompt_tokens: list[int] = []  # per choice
        self._last_token_at: dict[int, float] = {}
        self._first_token = True
        # the next event of each unfinished choice, awaited together
        self._pending: dict[asyncio.Task[TokenEvent], int] = {}
        # streamed with tools: each choice's text held back where it may be a call
        self._tool_streams: list[ToolCallStream] = []
        try:
            for index, prompt, params in parsed.sequences():
                self.outputs.append(
                    ChoiceOutput(
                        index,
                        tokenizer,
                        self.speller,
                        parsed.stop,
                        echo_text=prompt.text if parsed.echo else None,
                        prompt_ids=prompt.ids,
                        logprobs=parsed.logprobs is not None,
                        output=parsed.output,
                    )
                )
                if parsed.tool_names and parsed.stream:
                    self._tool_streams.append(ToolCallStream(parsed.tool_names))
                self._streams.append(self._submit(prompt.ids, params))
                self._prompt_tokens.append(len(prompt.ids))
                state.metrics.prompt_tokens.inc(len(prompt.ids))
        except ApiError:
            self.close()  # the choices admitted before a refused one end with it
            raise

    def _submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        limits = self.state.limits
        try:
            return self.state.engine.submit(prompt_ids, params, deadline_s=limits.queue_timeout_s)
        except QueueFullError as exc:
            raise ApiError(
                429,
                f"the waiting queue is full ({self.state.engine.config.max_queue_size} requests); "
                f"retry after {limits.retry_after_s} s",
                type_="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(limits.retry_after_s)},
            ) from exc
        except PromptTooLongError as exc:  # protocol_parse refuses it first; the engine guards
            raise invalid(str(exc), code="context_length_exceeded", param="prompt") from exc
        except EngineStoppedError as exc:
            raise _engine_stopped(self.state, exc, "rejected") from exc

    @property
    def finished(self) -> bool:
        return all(output.finish_reason is not None for output in self.outputs)

    def usage(self) -> Usage:
        prompt = self.parsed.prompt_tokens
        completion = sum(output.completion_tokens for output in self.outputs)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    async def next_delta(self) -> ChoiceDelta | None:
        """The next delta of any choice, in the order their tokens come; None once all
        finished."""
        if len(self.outputs) == 1:  # no tasks for the common case
            output = self.outputs[0]
            if output.finish_reason is not None:
                return None
            return self._record(0, await self._next_event(0))
        for index, output in enumerate(self.outputs):
            if output.finish_reason is None and index not in self._pending.values():
                self._pending[asyncio.ensure_future(self._next_event(index))] = index
        if not self._pending:
            return None
        done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        task = min(done, key=lambda t: self._pending[t])  # one at a time, lowest index first
        index = self._pending.pop(task)
        return self._record(index, task.result())

    async def _next_event(self, index: int) -> TokenEvent:
        try:
            return await anext(self._streams[index])
        except StopAsyncIteration:
            raise ApiError(
                500, "the engine ended the request without a finish reason", type_="server_error"
            ) from None
        except DeadlineExceededError as exc:
            raise ApiError(
                504,
                f"the request waited longer than its deadline of "
                f"{self.state.limits.queue_timeout_s:g} s without being scheduled; the server "
                "is overloaded, retry later or on another replica",
                type_="timeout_error",
                code="queue_timeout",
                headers={"Retry-After": str(self.state.limits.retry_after_s)},
            ) from exc
        except EngineStoppedError as exc:
            raise _engine_stopped(self.state, exc, "error") from exc

    def _record(self, index: int, event: TokenEvent) -> ChoiceDelta:
        now = time.monotonic()
        metrics = self.state.metrics
        if self._first_token:
            metrics.ttft.observe(now - self.arrival)
            self._first_token = False
        elif index in self._last_token_at:
            metrics.inter_token.observe(now - self._last_token_at[index])
        self._last_token_at[index] = now
        self.timing.token(index, now)
        metrics.generation_tokens.inc()
        output = self.outputs[index]
        delta = output.feed(event)
        if self._tool_streams:
            tools = self._tool_streams[index]
            delta.text = tools.feed(delta.text)
            if delta.finish_reason is not None:
                rest, delta.tool_calls = tools.finish()
                delta.text += rest
                if delta.tool_calls:
                    delta.finish_reason = "tool_calls"
        if output.finish_reason is not None:
            self._streams[index].cancel()  # a stop string ends it before the engine does
            metrics.request_generation_tokens.observe(output.completion_tokens)
            metrics.request_prompt_tokens.observe(self._prompt_tokens[index])
        return delta

    def close(self) -> None:
        # Frees the request's KV blocks when it ends early (stop string, error,
        # client gone); a no-op for a finished request.
        for task in self._pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the request already ends with the first error
            task.cancel()
        for stream in self._streams:
            stream.cancel()


def _engine_stopped(state: ServerState, error: EngineStoppedError, outcome: str) -> ApiError:
    """503: the engine failed (the reason), or is shutting down (why this request ends)."""
    failure = state.engine.failure
    return ApiError(
        503,
        f"{failure or error}; retry on another replica",
        type_="service_unavailable_error",
        code="engine_failed" if failure else "shutting_down",
        headers={"Retry-After": str(state.limits.retry_after_s)},
        outcome=outcome,
    )


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


async def _stream(
    request: web.Request, generation: Generation, answer_format: AnswerFormat, end: RequestEnd
) -> web.StreamResponse:
    # Wait for the first token before sending headers, so that a full queue or
    # a missed deadline still gets its own status code.
    delta = await generation.next_delta()
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    # Most events differ only in their text: serialize the rest once per choice.
    frames: dict[int, tuple[bytes, bytes]] = {}
    try:
        for event in answer_format.opening(generation):
            await _send_event(response, event)
        while delta is not None:
            if delta.finish_reason is not None:
                usage = generation.usage() if generation.finished else None
                await _send_event(response, answer_format.event(generation, delta, usage))
            elif delta.entries or generation.parsed.logprobs is not None:
                await _send_event(response, answer_format.event(generation, delta))
            else:
                head, tail = frames.get(delta.index) or _text_frame(
                    answer_format, generation, delta.index, frames
                )
                text = json.dumps(delta.text).encode()
                await response.write(b"data: " + head + text + tail + b"\n\n")
            delta = await generation.next_delta()
    except ApiError as err:
        # Headers are gone: the error travels as an event and the request counts as failed.
        end.record("error", err.status)
        await _send_event(response, err.answer())
        await response.write(b"data: [DONE]\n\n")
        raise _StreamEnded(response) from err
    except ConnectionResetError as exc:
        raise _StreamEnded(response) from exc
    if generation.parsed.include_usage_chunk:
        await _send_event(response, answer_format.usage_event(generation))
    end.record("ok")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _text_frame(
    answer_format: AnswerFormat,
    generation: Generation,
    index: int,
    frames: dict[int, tuple[bytes, bytes]],
) -> tuple[bytes, bytes]:
    """A text event of choice `index` split around its text, to be filled per token."""
    placeholder = answer_format.event(generation, ChoiceDelta(index, "\x00"))
    head, tail = placeholder.model_dump_json().encode().split(b'"\\u0000"')
    frames[index] = (head, tail)
    return head, tail


class _StreamEnded(Exception):
    """An SSE stream ended early (error event sent, or client gone) after its headers."""

    def __init__(self, response: web.StreamResponse) -> None:
        super().__init__("stream ended early")
        self.response = response


async def _send_event(response: web.StreamResponse, event: BaseModel) -> None:
    await response.write(b"data: " + event.model_dump_json().encode() + b"\n\n")


# --- other endpoints ----------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = ModelCard(id=state.model_name, max_model_len=state.engine.max_model_len)
    return _json_answer(ModelList(data=[card]))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    served = _served(state)
    tokenized = read_tokenize(await read_json(request), served)
    strs = None
    if tokenized.token_strs:
        speller = TokenSpeller(served.tokenizer)
        strs = [speller.text(token_id) for token_id in tokenized.ids]
    answer = TokenizeResponse(
        count=len(tokenized.ids),
        max_model_len=served.max_model_len,
        tokens=tokenized.ids,
        token_strs=strs,
    )
    return _json_answer(answer)


async def detokenize(request: web.Request) -> web.Response:
    served = _served(request.app[STATE])
    ids = read_detokenize(await read_json(request), served)
    return _json_answer(DetokenizeResponse(prompt=served.tokenizer.decode(ids)))


async def version(request: web.Request) -> web.Response:
    return _json_answer(VersionResponse(version=package_version()))


@cache
def package_version() -> str:
    try:
        return importlib.metadata.version("batchpilot")
    except importlib.metadata.PackageNotFoundError:  # run from a tree, not installed
        return "unknown"


async def health(request: web.Request) -> web.Response:
    """vLLM's, TGI's and llama.cpp's probe: 200 once the model serves, else 503."""
    state = request.app[STATE]
    if state.ready and not state.engine.failure:
        return web.Response(status=200)
    return await readyz(request)


async def healthz(request: web.Request) -> web.Response:
    """Alive unless the engine thread died: then only a restart helps."""
    failure = request.app[STATE].engine.failure
    if failure:
        return web.json_response({"status": "failed", "reason": failure}, status=503)
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    state = request.app[STATE]
    failure = state.engine.failure
    if state.ready and not failure:
        return web.json_response({"ready": True})
    reason = failure or ("shutting down" if state.draining else "engine not started")
    return web.json_response({"ready": False, "reason": reason}, status=503)


async def metrics_endpoint(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = state.metrics.exposition(state.engine.stats())
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document())


# --- admin ------------------------------------------------------------------


def _batching_state(state: ServerState) -> BatchingState:
    return BatchingState(
        **state.engine.config.to_dict(), mode=state.metrics.mode, version=state.config_version
    )


async def get_batching(request: web.Request) -> web.Response:
    return _json_answer(_batching_state(request.app[STATE]))


async def put_batching(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _authorize(request, state.admin_token)
    changes = read_batching_update(await read_json(request))
    try:
        config = state.engine.config.merged(dict(changes))
    except ConfigError as exc:  # BatchingConfig's own checks, were they stricter than the schema
        raise invalid(str(exc)) from exc
    state.engine.reconfigure(config)
    state.config_version += 1
    state.metrics.set_config(config)
    log.info("batching config version %d: %s", state.config_version, config.to_dict())
    return _json_answer(_batching_state(state))


def _authorize(request: web.Request, current_token: Callable[[], str] | None) -> None:
    if current_token is None:
        raise ApiError(
            403,
            "the admin API is disabled: this server was started without --admin-token-file",
            type_="permission_error",
            code="admin_disabled",
        )
    require_bearer(request, current_token(), ADMIN_TOKEN)


@dataclass(frozen=True)
class BearerGuard:
    """How one kind of route answers a missing or wrong bearer credential: a missing one
    is always 401; a wrong one is the `invalid_status` the route's convention says
    (OpenAI's API key: 401; the admin token: 403, the caller is known but not allowed)."""

    realm: str
    missing_message: str
    missing_code: str
    invalid_status: int
    invalid_message: str
    invalid_code: str


ADMIN_TOKEN = BearerGuard(
    realm="batchpilot-admin",
    missing_message="missing admin token: send 'Authorization: Bearer <token>'",
    missing_code="missing_token",
    invalid_status=403,
    invalid_message="the admin token is not valid",
    invalid_code="invalid_token",
)
# OpenAI's answer to a missing or wrong key: 401, never the key itself
API_KEY = BearerGuard(
    realm="batchpilot",
    missing_message="this server needs an API key: send 'Authorization: Bearer <key>'",
    missing_code="missing_api_key",
    invalid_status=401,
    invalid_message="the API key is not valid",
    invalid_code="invalid_api_key",
)


def require_bearer(request: web.Request, expected: str, guard: BearerGuard) -> None:
    """The one bearer-token check: an ApiError unless the request sends `expected`."""
    challenge = {"WWW-Authenticate": f'Bearer realm="{guard.realm}"'}
    given = _bearer(request)
    if given is None:
        raise ApiError(
            401,
            guard.missing_message,
            type_="authentication_error",
            code=guard.missing_code,
            headers=challenge,
        )
    # constant time, so that the answer's timing tells nothing of the secret
    if not hmac.compare_digest(given, expected.encode("utf-8", "surrogateescape")):
        unauthenticated = guard.invalid_status == 401  # a 401 names its scheme (RFC 9110)
        raise ApiError(
            guard.invalid_status,
            guard.invalid_message,
            type_="authentication_error" if unauthenticated else "permission_error",
            code=guard.invalid_code,
            headers=challenge if unauthenticated else None,
        )


def _bearer(request: web.Request) -> bytes | None:
    """The bearer credential of the request, as bytes; None when it sends none."""
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return None
    # Header bytes that are not ASCII reach here as surrogate escapes: compare bytes.
    return given.strip().encode("utf-8", "surrogateescape")


# routes behind --api-key: what OpenAI clients call (vLLM guards the same ones)
KEYED_PREFIXES = ("/v1/",)
KEYED_PATHS = frozenset({"/tokenize", "/detokenize"})


@web.middleware
async def api_key_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    current_key = request.app[STATE].api_key
    path = request.path
    if current_key is not None and (path.startswith(KEYED_PREFIXES) or path in KEYED_PATHS):
        require_bearer(request, current_key(), API_KEY)
    return await handler(request)


def build_app(
    options: EngineOptions,
    *,
    admin_token: AdminToken = None,
    limits: Limits | None = None,
    api_key: AdminToken = None,
    chat_template: str | None = None,
    metrics_compat: MetricsCompat = "vllm",
) -> web.Application:
    """A server app with its own engine and metrics registry (used by the CLI, tests, benches)."""
    from batchpilot_server.engine import Engine  # torch: imported only where a model runs

    metrics = ServerMetrics(
        model=options.served_name,
        mode=options.mode,
        compat=metrics_compat,
        block_size=options.block_size,
    )
    engine = Engine(options, metrics)
    return create_app(
        engine,
        metrics=metrics,
        admin_token=admin_token,
        limits=limits or Limits(),
        api_key=api_key,
        chat_template=chat_template,
        defaults=generation_defaults(options.model),
    )
