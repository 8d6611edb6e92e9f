"""The OpenAI routes: completions and chat (admitted, generated, answered whole or
streamed), the model list, tokenize and detokenize."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, Protocol

from aiohttp import web
from batchpilot_server.http.accounting import RequestEnd
from batchpilot_server.http.answer_formats import CHAT_FORMAT, COMPLETION_FORMAT, AnswerFormat
from batchpilot_server.http.answers import (
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
)
from batchpilot_server.http.auth import BOUND_CLASS
from batchpilot_server.http.generation import Generation
from batchpilot_server.http.protocol import ApiError
from batchpilot_server.http.protocol_output import TokenSpeller
from batchpilot_server.http.protocol_parse import (
    GenerationRequest,
    Served,
    read_chat,
    read_completion,
    read_detokenize,
    read_tokenize,
)
from batchpilot_server.http.request_body import read_json
from batchpilot_server.http.responses import json_answer
from batchpilot_server.http.server_state import STATE, ServerState
from batchpilot_server.http.slo_class import OBJECTIVE_HEADER, class_of
from batchpilot_server.http.streaming import StreamEnded, stream_answer


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
    except StreamEnded as ended:
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
    parsed = reader(await read_json(request), state.served())
    slo_class = class_of(
        state.engine.config.slo,
        bound=request.get(BOUND_CLASS),
        header=request.headers.get(OBJECTIVE_HEADER),
        priority=parsed.priority,
    )
    end.slo_class = slo_class.name
    if parsed.grammar is not None:
        # before submit, in a worker thread: the engine thread only masks
        assert state.structured is not None  # set once the engine started
        grammar = await state.structured.compile(parsed.grammar)
        parsed = replace(parsed, params=replace(parsed.params, grammar=grammar))
    generation = Generation(state, parsed, end.timing, answer_format.id_prefix, slo_class)
    try:
        if parsed.stream:
            return await stream_answer(request, generation, answer_format, end)
        while await generation.next_delta() is not None:
            pass
        return json_answer(answer_format.answer(generation))
    finally:
        generation.close()


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = ModelCard(id=state.model_name, max_model_len=state.engine.max_model_len)
    return json_answer(ModelList(data=[card]))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    served = state.served()
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
    return json_answer(answer)


async def detokenize(request: web.Request) -> web.Response:
    served = request.app[STATE].served()
    ids = read_detokenize(await read_json(request), served)
    return json_answer(DetokenizeResponse(prompt=served.tokenizer.decode(ids)))
