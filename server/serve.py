"""`batchpilot serve`: run one inference server until SIGTERM, then drain and exit 0."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import signal
import sys
from dataclasses import dataclass

from aiohttp import web
from batchpilot_server.admin_token import TokenFile
from batchpilot_server.engine.attention_kernel_build import KernelUnavailableError
from batchpilot_server.engine_api import EngineOptions
from batchpilot_server.http.app import begin_drain, build_app, end_in_flight, wait_drained
from batchpilot_server.http.connections import ConnectionGuard, ConnectionLimits
from batchpilot_server.http.protocol import Limits
from batchpilot_server.http.server_state import ClassKey
from batchpilot_server.serve_options import (
    ANSWER_MARGIN_S,
    ClassKeyFile,
    UsageError,
    admin_token,
    api_key,
    batching_config,
    chat_template,
    class_keys,
    connection_limits,
    engine_options,
    parser,
)

log = logging.getLogger("batchpilot.serve")


@dataclass(frozen=True)
class Secrets:
    admin_token: TokenFile | None
    api_key: str | TokenFile | None
    class_keys: list[ClassKeyFile]


async def serve(
    args: argparse.Namespace,
    options: EngineOptions,
    secrets: Secrets,
    connections: ConnectionLimits,
    template: str | None,
) -> int:
    limits = Limits(queue_timeout_s=args.queue_timeout_s)
    token, key = secrets.admin_token, secrets.api_key
    app = build_app(
        options,
        admin_token=None if token is None else token.current,
        limits=limits,
        api_key=key.current if isinstance(key, TokenFile) else key,
        class_keys=tuple(ClassKey(k.slo_class, k.file.current) for k in secrets.class_keys),
        chat_template=template,
        metrics_compat=args.metrics_compat,
    )
    guard = ConnectionGuard(connections)
    app.middlewares.append(guard.middleware)
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=ANSWER_MARGIN_S,
        keepalive_timeout=connections.keepalive_timeout_s,
    )
    await runner.setup()  # starts the engine
    listener: asyncio.Server | None = None
    try:
        listener = await guard.listen(runner, args.host, args.port)
        log.info(
            "serving %s (%s mode) on http://%s:%d",
            options.served_name,
            args.mode,
            args.host,
            args.port,
        )
        await _wait_for_signal()
        await _drain(app, args.shutdown_grace_s)
    finally:
        if listener is not None:
            listener.close()  # no new connections while the open ones drain
        await runner.cleanup()  # stops the engine
    log.info("stopped")
    return 0


async def _drain(app: web.Application, grace_s: float) -> None:
    """Not ready, admit nothing new, let in-flight requests finish within `grace_s`;
    then end the rest with an answer each, so that none is cut without a word."""
    begin_drain(app)
    log.info("draining: waiting up to %gs for in-flight requests", grace_s)
    if await wait_drained(app, grace_s):
        return
    ended = end_in_flight(
        app,
        f"the server is shutting down and its grace period of {grace_s:g} s ran out "
        "before this request finished",
    )
    log.warning("grace period over: %d requests in flight end with an error", ended)
    if not await wait_drained(app, ANSWER_MARGIN_S):
        log.warning("some error answers were not written in time; closing their connections")


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        if args.shutdown_grace_s < 0 or args.queue_timeout_s <= 0:
            raise UsageError("--shutdown-grace-s must be >= 0 and --queue-timeout-s > 0")
        # inf: no age bound at all, a choice; a finite one at the timeout never acts
        if math.isfinite(args.class_max_wait_s) and args.class_max_wait_s >= args.queue_timeout_s:
            raise UsageError(
                f"--class-max-wait-s ({args.class_max_wait_s:g}) must be below "
                f"--queue-timeout-s ({args.queue_timeout_s:g}): a request starved that long "
                "would be timed out the moment its age let it be served"
            )
        options = engine_options(args, batching_config(args))
        free_key = api_key(args)
        secrets = Secrets(admin_token(args.admin_token_file), free_key, class_keys(args, free_key))
        connections = connection_limits(args)
        template = chat_template(args.chat_template)
    except UsageError as exc:
        print(f"batchpilot serve: error: {exc}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args, options, secrets, connections, template))
    except OSError as exc:  # e.g. the port is taken
        print(f"batchpilot serve: error: {exc}", file=sys.stderr)
        return 1
    except (ValueError, KernelUnavailableError) as exc:  # no CUDA, no native kernel
        print(f"batchpilot serve: error: cannot start the engine: {exc}", file=sys.stderr)
        return 1
