"""The admin API: GET and PUT /admin/batching, the batching config in force."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from batchpilot_server.batching_config import ConfigError
from batchpilot_server.http.admin_protocol import BatchingUpdate
from batchpilot_server.http.answers import BatchingState
from batchpilot_server.http.auth import ADMIN_TOKEN, require_bearer
from batchpilot_server.http.protocol import ApiError, invalid
from batchpilot_server.http.request_body import read_json
from batchpilot_server.http.request_validation import known_fields, validate
from batchpilot_server.http.responses import json_answer
from batchpilot_server.http.server_state import STATE, ServerState
from pydantic import TypeAdapter

log = logging.getLogger("batchpilot.server")

BATCHING_UPDATE = TypeAdapter(BatchingUpdate)


def _batching_state(state: ServerState) -> BatchingState:
    return BatchingState(
        **state.engine.config.to_dict(), mode=state.metrics.mode, version=state.config_version
    )


async def get_batching(request: web.Request) -> web.Response:
    return json_answer(_batching_state(request.app[STATE]))


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
    return json_answer(_batching_state(state))


def _authorize(request: web.Request, current_token: Callable[[], str] | None) -> None:
    if current_token is None:
        raise ApiError(
            403,
            "the admin API is disabled: this server was started without --admin-token-file",
            type_="permission_error",
            code="admin_disabled",
        )
    require_bearer(request, current_token(), ADMIN_TOKEN)


def read_batching_update(body: Any) -> BatchingUpdate:
    update = validate(BATCHING_UPDATE, body)
    if not update:
        fields = ", ".join(known_fields(BATCHING_UPDATE))
        raise invalid(f"request body names no field to change; send one of {fields}")
    return update
