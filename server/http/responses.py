"""JSON answers, and every error as OpenAI's error shape with its status: the
app's ApiErrors, aiohttp's own (404, 405, 413) and, logged, anything unexpected (500)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from aiohttp import web
from batchpilot_server.http.protocol import ApiError
from batchpilot_server.http.server_state import STATE
from pydantic import BaseModel

log = logging.getLogger("batchpilot.server")

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
    return json_answer(err.answer(), status=err.status, headers=err.headers)


def json_answer(
    answer: BaseModel, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    body = answer.model_dump_json().encode()
    return web.Response(body=body, status=status, headers=headers, content_type="application/json")
