"""Bearer tokens: the one check that both the admin API's token and the OpenAI
routes' API key go through, and the middleware that guards the API routes."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web
from batchpilot_server.http.protocol import ApiError
from batchpilot_server.http.responses import Handler
from batchpilot_server.http.server_state import STATE, ServerState

# a fixed token, or where to get the one in force (TokenFile.current); None: no token,
# so the admin API is off, or the API routes are open
TokenSource = str | Callable[[], str] | None


def token_getter(token: TokenSource) -> Callable[[], str] | None:
    """The token in force, read anew at each check (a token file may be rotated)."""
    return (lambda: token) if isinstance(token, str) else token


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
    require_one_of(request, [expected], guard)


def require_one_of(request: web.Request, accepted: list[str], guard: BearerGuard) -> int:
    """The index in `accepted` of the bearer credential the request sends; an ApiError
    when it sends none of them."""
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
    # constant time, and every key compared, so that the timing tells nothing of the secrets
    matches = [
        hmac.compare_digest(given, expected.encode("utf-8", "surrogateescape"))
        for expected in accepted
    ]
    if True not in matches:
        unauthenticated = guard.invalid_status == 401  # a 401 names its scheme (RFC 9110)
        raise ApiError(
            guard.invalid_status,
            guard.invalid_message,
            type_="authentication_error" if unauthenticated else "permission_error",
            code=guard.invalid_code,
            headers=challenge if unauthenticated else None,
        )
    return matches.index(True)


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


# where the middleware leaves the SLO class a request's API key is bound to (--api-key-class)
BOUND_CLASS = web.RequestKey("batchpilot_bound_class", str)


def _keys_in_force(state: ServerState) -> list[tuple[str | None, str]]:
    """(bound class, key) of every key that opens the API routes: the free key, whose
    requests pick their own class, first; then each key bound to a class."""
    free = [] if state.api_key is None else [(None, state.api_key())]
    return free + [(k.slo_class, k.key()) for k in state.class_keys]


@web.middleware
async def api_key_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    path = request.path
    if path.startswith(KEYED_PREFIXES) or path in KEYED_PATHS:
        keys = _keys_in_force(request.app[STATE])
        if keys:  # none: the routes are open
            index = require_one_of(request, [key for _, key in keys], API_KEY)
            slo_class = keys[index][0]
            if slo_class is not None:
                request[BOUND_CLASS] = slo_class
    return await handler(request)
