"""The open, read-only routes: health probes, /metrics, /version and /openapi.json."""

from __future__ import annotations

import importlib.metadata
from functools import cache

from aiohttp import web
from batchpilot_server.http.answers import VersionResponse
from batchpilot_server.http.metrics import CONTENT_TYPE
from batchpilot_server.http.openapi import openapi_document
from batchpilot_server.http.responses import json_answer
from batchpilot_server.http.server_state import STATE


async def version(request: web.Request) -> web.Response:
    return json_answer(VersionResponse(version=package_version()))


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
