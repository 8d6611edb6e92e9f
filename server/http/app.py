"""The aiohttp application every server pod runs: OpenAI API, admin, probes, metrics.

The app owns its engine's lifecycle: it starts the engine on startup and shuts
it down on cleanup.
"""

from __future__ import annotations

import logging

from aiohttp import web
from batchpilot_server.chat_template import ChatTemplate
from batchpilot_server.engine_api import EngineOptions
from batchpilot_server.http.admin import get_batching, put_batching
from batchpilot_server.http.auth import TokenSource, api_key_middleware, token_getter
from batchpilot_server.http.generation_defaults import (
    MODEL_NEUTRAL,
    GenerationDefaults,
    generation_defaults,
)
from batchpilot_server.http.grammar_compiler import GrammarCompiler
from batchpilot_server.http.metrics import MetricsCompat, ServerMetrics
from batchpilot_server.http.probes import (
    health,
    healthz,
    metrics_endpoint,
    openapi,
    readyz,
    version,
)
from batchpilot_server.http.protocol import Limits
from batchpilot_server.http.responses import error_middleware
from batchpilot_server.http.server_state import STATE, ClassKey, EngineLike, ServerState
from batchpilot_server.http.serving import (
    chat_completions,
    completions,
    detokenize,
    models,
    tokenize,
)

log = logging.getLogger("batchpilot.server")


def create_app(
    engine: EngineLike,
    *,
    metrics: ServerMetrics,
    admin_token: TokenSource,
    limits: Limits,
    api_key: TokenSource = None,
    class_keys: tuple[ClassKey, ...] = (),
    chat_template: str | None = None,
    defaults: GenerationDefaults = MODEL_NEUTRAL,
) -> web.Application:
    """The HTTP app around a not yet started engine built with `metrics` as its observer.

    `api_key` (a key, or where to get the one in force): the OpenAI routes and
    /tokenize, /detokenize then need `Authorization: Bearer <key>`; probes, /metrics,
    /version and /openapi.json stay open, the admin API keeps its own token. `class_keys`:
    more keys, each binding its requests to an SLO class (docs/server.md)."""
    state = ServerState(
        engine=engine,
        metrics=metrics,
        limits=limits,
        admin_token=token_getter(admin_token),
        api_key=token_getter(api_key),
        class_keys=class_keys,
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


def build_app(
    options: EngineOptions,
    *,
    admin_token: TokenSource = None,
    limits: Limits | None = None,
    api_key: TokenSource = None,
    class_keys: tuple[ClassKey, ...] = (),
    chat_template: str | None = None,
    metrics_compat: MetricsCompat = "vllm",
) -> web.Application:
    """A server app with its own engine and metrics registry (used by the CLI, tests, benches)."""
    from batchpilot_server.engine.core import Engine  # torch: imported only where a model runs

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
        class_keys=class_keys,
        chat_template=chat_template,
        defaults=generation_defaults(options.model),
    )
