"""The OpenAPI 3.1 document served at /openapi.json, derived from the models of protocol.py,
admin_protocol.py and answers.py."""

from __future__ import annotations

from functools import cache
from typing import Any

from batchpilot_server.http.admin_protocol import BatchingUpdate
from batchpilot_server.http.answers import (
    BatchingState,
    ChatCompletion,
    ChatCompletionChunk,
    Completion,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
    VersionResponse,
)
from batchpilot_server.http.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
)
from pydantic import TypeAdapter

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON or body encoding, a wrong type, a value out of range, "
    "text that is not valid Unicode, or a conversation the chat template refuses.",
    401: "Missing admin bearer token, or (with --api-key) a missing or wrong API key.",
    403: "Wrong admin token, or the admin API is disabled (no --admin-token-file).",
    404: "Unknown route or model.",
    405: "Method not allowed on this route.",
    413: "Request body too large.",
    429: "The waiting queue is full; retry after `Retry-After` seconds.",
    500: "Server fault.",
    503: "The server is shutting down, or the engine stopped.",
    504: "The request waited past its deadline without being scheduled.",
}
RETRY_AFTER = {
    "Retry-After": {
        "description": "Seconds to wait before retrying.",
        "schema": {"type": "integer"},
    }
}
GENERATION_ERRORS = (400, 401, 404, 405, 413, 429, 500, 503, 504)
TOKENIZER_ERRORS = (400, 401, 404, 405, 413)

# Requests are documented as they are validated, answers as they are written.
REQUESTS: tuple[type, ...] = (
    CompletionRequest, ChatCompletionRequest, BatchingUpdate, TokenizeRequest, DetokenizeRequest,
)  # fmt: skip
ANSWERS: tuple[type, ...] = (
    Completion, ChatCompletion, ChatCompletionChunk, ErrorResponse, BatchingState, ModelList,
    TokenizeResponse, DetokenizeResponse, VersionResponse,
)  # fmt: skip


@cache
def component_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """({model name: $ref}, components.schemas) for every model of the API."""
    adapters = [(t.__name__, "validation", TypeAdapter(t)) for t in REQUESTS] + [
        (t.__name__, "serialization", TypeAdapter(t)) for t in ANSWERS
    ]
    refs, definitions = TypeAdapter.json_schemas(
        adapters,  # type: ignore[arg-type]
        ref_template="#/components/schemas/{model}",
    )
    schemas = definitions["$defs"]
    # what protocol_parse checks beyond the model: only an assistant turn may have no
    # content (a fuzzer that reads the document then sends conversations that pass)
    schemas["ChatMessage"]["anyOf"] = [
        {"properties": {"role": {"const": "assistant"}}},
        {"properties": {"content": {"not": {"type": "null"}}}, "required": ["content"]},
    ]
    return {name: ref for (name, _), ref in refs.items()}, schemas


def _ref(name: str) -> dict[str, Any]:
    return component_schemas()[0][name]


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    responses = {}
    for status in statuses:
        response = _json(_ref("ErrorResponse"), ERROR_DESCRIPTIONS[status])
        if status in (429, 503, 504):
            response["headers"] = RETRY_AFTER
        responses[str(status)] = response
    return responses


def _get(summary: str, ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def _plain(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


def _post(summary: str, request: str, answer: str, *errors: int) -> dict[str, Any]:
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {"200": _json(_ref(answer), "The answer."), **_errors(*errors)},
        }
    }


def _generation(summary: str, *, request: str, answer: str, chunk: str) -> dict[str, Any]:
    events = (
        f"With `stream`: server-sent events, `data: <{chunk}>` each, ending `data: [DONE]`; an "
        "error after the first event arrives as `data: <ErrorResponse>` before `[DONE]`."
    )
    return {
        "post": {
            "summary": summary,
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref(request)}},
            },
            "responses": {
                "200": {
                    "description": f"The {answer}. {events}",
                    "content": {
                        "application/json": {"schema": _ref(answer)},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(*GENERATION_ERRORS),
            },
        }
    }


@cache
def openapi_document() -> dict[str, Any]:
    status = {"type": "object", "additionalProperties": True}
    admin = {
        **_get("The batching config in force.", _json(_ref("BatchingState"), "In force.")),
        "put": {
            "summary": "Change batching live; applies at the next scheduling decision.",
            "security": [{"adminToken": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("BatchingUpdate")}},
            },
            "responses": {
                "200": _json(_ref("BatchingState"), "The new config in force."),
                **_errors(400, 401, 403, 405, 413),
            },
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchpilot inference server",
            "version": "1",
            "description": "OpenAI-compatible completions and chat, live batching config, "
            "probes, metrics.",
        },
        "paths": {
            "/v1/completions": _generation(
                "OpenAI-compatible text completion.",
                request="CompletionRequest",
                answer="Completion",
                chunk="Completion",
            ),
            "/v1/chat/completions": _generation(
                "OpenAI-compatible chat completion, rendered by the model's chat template.",
                request="ChatCompletionRequest",
                answer="ChatCompletion",
                chunk="ChatCompletionChunk",
            ),
            "/v1/models": _get("The served model.", _json(_ref("ModelList"), "Model list."), 401),
            "/tokenize": _post(
                "Token ids of a prompt, or of chat messages as the template renders them "
                "(vLLM's shape).",
                "TokenizeRequest",
                "TokenizeResponse",
                *TOKENIZER_ERRORS,
            ),
            "/detokenize": _post(
                "The text of token ids (vLLM's shape).",
                "DetokenizeRequest",
                "DetokenizeResponse",
                *TOKENIZER_ERRORS,
            ),
            "/version": _get("The server's version.", _json(_ref("VersionResponse"), "Version.")),
            "/health": {
                "get": {
                    "summary": "vLLM's, TGI's and llama.cpp's probe: 200 once serving.",
                    "responses": {
                        "200": {"description": "Serving; an empty body."},
                        "503": _json(status, "Not serving: starting, draining or failed."),
                    },
                }
            },
            "/healthz": {
                "get": {
                    "summary": "Liveness: fails once the engine thread has died.",
                    "responses": {
                        "200": _json(status, "Alive."),
                        "503": _json(status, "The engine failed; the reason says why."),
                    },
                }
            },
            "/readyz": {
                "get": {
                    "summary": "Readiness: false while starting and while shutting down.",
                    "responses": {
                        "200": _json(status, "Ready."),
                        "503": _json(status, "Not ready (starting or draining)."),
                    },
                }
            },
            "/metrics": _get("Prometheus metrics.", _plain("Prometheus text format.")),
            "/openapi.json": _get("This document.", _json(status, "OpenAPI 3.1 document.")),
            "/admin/batching": admin,
        },
        "components": {
            "schemas": component_schemas()[1],
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
        },
    }
