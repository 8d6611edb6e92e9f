"""Connection limits for `batchpilot serve`: slow, idle and too many clients.

aiohttp closes an idle keep-alive connection (`keepalive_timeout`) but has no
bound on how long a request may take to arrive, nor on how many connections
are open. `ConnectionGuard` adds both, around aiohttp's own protocol:

- read deadline: a request's headers and body must arrive within
  `read_timeout_s` of its first byte. Headers that miss it: the connection is
  closed (no request to answer yet). A body that misses it: 408 in the API's
  error shape, then the connection is closed.
- connection cap: at `max_connections` open, a new connection first evicts
  the connection that has been without a request in progress the longest
  (idle, or still sending headers); when every connection has a request in
  progress, the new one is closed unanswered. A client holding many slow
  connections therefore cannot lock out probes and real clients.

Only asyncio's public protocol interface and aiohttp middleware are used; the
guard wraps the protocol factory of an `aiohttp.web.AppRunner`.
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from batchpilot_server.http.protocol import ApiError

log = logging.getLogger("batchpilot.connections")

# File descriptors kept for everything but client sockets (model files, logs, pipes).
RESERVED_FDS = 64

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class ConnectionLimits:
    read_timeout_s: float = 30.0  # first byte of a request -> its body complete
    keepalive_timeout_s: float = 75.0  # idle between requests, and before the first
    max_connections: int = 1024

    def __post_init__(self) -> None:
        if self.read_timeout_s <= 0 or self.keepalive_timeout_s <= 0:
            raise ValueError("HTTP read and keep-alive timeouts must be positive")
        if self.max_connections < 1:
            raise ValueError(f"max connections must be at least 1, got {self.max_connections}")

    def fd_warning(self) -> str | None:
        """Why the cap cannot protect the process' file descriptors, if it cannot."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or self.max_connections + RESERVED_FDS <= soft:
            return None
        return (
            f"--max-connections {self.max_connections} leaves fewer than {RESERVED_FDS} of the "
            f"{soft} file descriptors this process may open (ulimit -n) for anything else"
        )


class GuardedConnection(asyncio.Protocol):
    """One client connection: aiohttp's protocol inside, the guard's clocks around it."""

    def __init__(self, guard: ConnectionGuard, inner: asyncio.Protocol) -> None:
        self.guard = guard
        self.inner = inner
        self.transport: asyncio.Transport | None = None
        self.refused = False
        self.busy = False  # a request is in the app (its body may still be arriving)
        self.idle_since = time.monotonic()
        self.deadline: float | None = None  # loop time the request in arrival must be in by
        self._deadline_timer: asyncio.TimerHandle | None = None

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if not self.guard.admit(self):
            self.refused = True
            transport.abort()
            return
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if not self.busy and self.deadline is None and data:
            self._arm_deadline()  # the first byte of a new request
        self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return None if self.refused else self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_deadline()
        self.guard.forget(self)
        if not self.refused:
            self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()

    # -- what the middleware reports ----------------------------------------------------

    def request_started(self) -> None:
        self.busy = True
        if self.deadline is None:  # pipelined: it arrived during the previous request
            self._arm_deadline()

    def request_finished(self) -> None:
        self.busy = False
        self.idle_since = time.monotonic()
        self._disarm_deadline()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # -- the read deadline -----------------------------------------------------------------

    def _arm_deadline(self) -> None:
        loop = asyncio.get_running_loop()
        self.deadline = loop.time() + self.guard.limits.read_timeout_s
        self._deadline_timer = loop.call_at(self.deadline, self._headers_overdue)

    def _disarm_deadline(self) -> None:
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        self._deadline_timer = None
        self.deadline = None

    def _headers_overdue(self) -> None:
        self._deadline_timer = None
        if not self.busy:  # a request in the app has its body deadline in the middleware
            self.guard.headers_timed_out += 1
            log.debug("closing a connection whose request headers missed the read deadline")
            self.close()


class ConnectionGuard:
    """Every open connection of one server, and the rules above applied to them."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self._open: dict[asyncio.Transport, GuardedConnection] = {}
        # Totals since start, for logs and tests.
        self.refused = 0
        self.evicted = 0
        self.headers_timed_out = 0
        self.bodies_timed_out = 0

    @property
    def open_connections(self) -> int:
        return len(self._open)

    def protocol_factory(
        self, inner: Callable[[], asyncio.Protocol]
    ) -> Callable[[], GuardedConnection]:
        return lambda: GuardedConnection(self, inner())

    async def listen(self, runner: web.AppRunner, host: str, port: int) -> asyncio.Server:
        """Accept connections for `runner` (after its setup) through this guard."""
        assert runner.server is not None, "call runner.setup() first"
        loop = asyncio.get_running_loop()
        return await loop.create_server(self.protocol_factory(runner.server), host, port)

    def admit(self, connection: GuardedConnection) -> bool:
        assert connection.transport is not None
        if len(self._open) >= self.limits.max_connections and not self._evict_one():
            self.refused += 1
            log.warning(
                "refused a connection: all %d have a request in progress (--max-connections)",
                self.limits.max_connections,
            )
            return False
        self._open[connection.transport] = connection
        return True

    def forget(self, connection: GuardedConnection) -> None:
        if connection.transport is not None and self._open.get(connection.transport) is connection:
            del self._open[connection.transport]

    def _evict_one(self) -> bool:
        idle = [c for c in self._open.values() if not c.busy]
        if not idle:
            return False
        victim = min(idle, key=lambda c: c.idle_since)
        self.forget(victim)  # its slot is free now, whenever its transport closes
        victim.close()
        self.evicted += 1
        return True

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Marks the connection busy while the app has the request; the body must
        arrive by the request's read deadline or the answer is 408."""
        transport = request.transport
        connection = self._open.get(transport) if transport is not None else None
        if connection is None:  # a test client, or a connection going away
            return await handler(request)
        connection.request_started()
        try:
            if request.can_read_body and not await self._body_in_time(request, connection):
                return await self._request_timeout(request)
            return await handler(request)
        finally:
            connection.request_finished()

    async def _body_in_time(self, request: web.Request, connection: GuardedConnection) -> bool:
        try:
            async with asyncio.timeout_at(connection.deadline):
                # Cached by aiohttp: the handler's own read() returns these bytes.
                await request.read()
        except TimeoutError:
            return False
        except web.HTTPException:
            raise  # 413: the rest of the body was never read
        except Exception:
            # A body that cannot be decoded: the payload keeps the error, so the
            # handler meets it again in its own read() and answers it.
            pass
        return True

    async def _request_timeout(self, request: web.Request) -> web.StreamResponse:
        self.bodies_timed_out += 1
        error = ApiError(
            408,
            f"the request body did not arrive within {self.limits.read_timeout_s:g} s "
            "of the request's first byte (--http-read-timeout-s); the connection is closed",
            code="request_timeout",
        )
        response = web.json_response(error.body(), status=error.status)
        response.force_close()
        await response.prepare(request)
        await response.write_eof()
        # Flushed, then closed: the rest of the body is not waited for.
        request.protocol.force_close()
        return response
