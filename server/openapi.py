"""The OpenAPI 3.0 document served at /openapi.json."""

from __future__ import annotations

from functools import cache
from typing import Any

from batchpilot_server.batching import (
    MAX_BATCH_SIZE_LIMIT,
    MAX_BATCH_TIMEOUT_MS,
    MAX_QUEUE_SIZE_LIMIT,
)

ERROR_DESCRIPTIONS = {
    400: "Invalid request: malformed JSON, a wrong type, or a value out of range.",
    401: "Missing admin bearer token.",
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


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*statuses: int) -> dict[str, Any]:
    responses = {}
    for status in statuses:
        response = _json(_ref("Error"), ERROR_DESCRIPTIONS[status])
        if status in (429, 503, 504):
            response["headers"] = RETRY_AFTER
        responses[str(status)] = response
    return responses


def _get(summary: str, ok: dict[str, Any], *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": ok, **_errors(*errors)}}}


def _plain(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": {"type": "string"}}}}


SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {
                "type": "object",
                "required": ["message", "type", "code"],
                "properties": {
                    "message": {"type": "string"},
                    "type": {"type": "string"},
                    "code": {"type": "string", "nullable": True},
                    "param": {"type": "string", "nullable": True},
                },
            }
        },
    },
    "CompletionRequest": {
        "type": "object",
        "required": ["prompt"],
        "additionalProperties": False,
        "properties": {
            "model": {"type": "string"},
            "prompt": {
                "oneOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0}},
                ]
            },
            "max_tokens": {"type": "integer", "minimum": 1, "default": 16},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2, "default": 0},
            "top_p": {"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1},
            "seed": {"type": "integer"},
            "stop": {
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "maxItems": 4, "items": {"type": "string"}},
                ]
            },
            "stream": {"type": "boolean", "default": False},
            "stream_options": {
                "type": "object",
                "properties": {"include_usage": {"type": "boolean"}},
            },
            "ignore_eos": {"type": "boolean", "default": False},
            "n": {"type": "integer", "enum": [1]},
            "user": {"type": "string"},
        },
    },
    "Usage": {
        "type": "object",
        "properties": {
            "prompt_tokens": {"type": "integer"},
            "completion_tokens": {"type": "integer"},
            "total_tokens": {"type": "integer"},
        },
    },
    "Completion": {
        "type": "object",
        "required": ["id", "object", "created", "model", "choices"],
        "properties": {
            "id": {"type": "string"},
            "object": {"type": "string", "enum": ["text_completion"]},
            "created": {"type": "integer"},
            "model": {"type": "string"},
            "choices": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "index": {"type": "integer"},
                        "text": {"type": "string"},
                        "logprobs": {"nullable": True},
                        "finish_reason": {
                            "type": "string",
                            "enum": ["stop", "length"],
                            "nullable": True,
                        },
                    },
                },
            },
            "usage": _ref("Usage"),
        },
    },
    "BatchingUpdate": {
        "type": "object",
        "additionalProperties": False,
        "minProperties": 1,
        "properties": {
            "max_batch_size": {"type": "integer", "minimum": 1, "maximum": MAX_BATCH_SIZE_LIMIT},
            "batch_timeout_ms": {"type": "number", "minimum": 0, "maximum": MAX_BATCH_TIMEOUT_MS},
            "max_queue_size": {"type": "integer", "minimum": 1, "maximum": MAX_QUEUE_SIZE_LIMIT},
        },
    },
    "BatchingConfig": {
        "type": "object",
        "required": ["max_batch_size", "batch_timeout_ms", "max_queue_size", "mode", "version"],
        "properties": {
            "max_batch_size": {"type": "integer"},
            "batch_timeout_ms": {"type": "number"},
            "max_queue_size": {"type": "integer"},
            "mode": {"type": "string", "enum": ["dynamic", "continuous"]},
            "version": {"type": "integer", "description": "Increases with every accepted PUT."},
        },
    },
}


@cache
def openapi_document() -> dict[str, Any]:
    status = {"type": "object", "additionalProperties": True}
    completions = {
        "post": {
            "summary": "OpenAI-compatible text completion (streaming with SSE).",
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("CompletionRequest")}},
            },
            "responses": {
                "200": {
                    "description": "The completion, or with `stream` server-sent events "
                    "(`data: <Completion chunk>` per token, ending `data: [DONE]`).",
                    "content": {
                        "application/json": {"schema": _ref("Completion")},
                        "text/event-stream": {"schema": {"type": "string"}},
                    },
                },
                **_errors(400, 404, 405, 413, 429, 500, 503, 504),
            },
        }
    }
    admin = {
        **_get("The batching config in force.", _json(_ref("BatchingConfig"), "In force.")),
        "put": {
            "summary": "Change batching live; applies at the next scheduling decision.",
            "security": [{"adminToken": []}],
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": _ref("BatchingUpdate")}},
            },
            "responses": {
                "200": _json(_ref("BatchingConfig"), "The new config in force."),
                **_errors(400, 401, 403, 413),
            },
        },
    }
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "batchpilot inference server",
            "version": "1",
            "description": "OpenAI-compatible completions, live batching config, probes, metrics.",
        },
        "paths": {
            "/v1/completions": completions,
            "/v1/models": _get("The served model.", _json(status, "Model list.")),
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
            "/openapi.json": _get("This document.", _json(status, "OpenAPI 3 document.")),
            "/admin/batching": admin,
        },
        "components": {
            "schemas": SCHEMAS,
            "securitySchemes": {"adminToken": {"type": "http", "scheme": "bearer"}},
        },
    }
