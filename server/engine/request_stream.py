"""One request's stream of token events, read on the event loop, fed by the engine."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from batchpilot_server.engine_api import EngineError, TokenEvent

END_OF_STREAM = object()  # a stream's end marker
StreamItem = TokenEvent | EngineError | object


class RequestStream:
    """Async iterator of one request's `TokenEvent`s; raises the `EngineError` it ends with.

    A deque and one waiter future rather than an asyncio.Queue: the event loop
    hands out every token of every step, and its time there is time the engine
    thread may wait for the GIL."""

    def __init__(self, request_id: str, on_cancel: Callable[[], None]) -> None:
        self.request_id = request_id
        self._on_cancel = on_cancel
        self._items: deque[StreamItem] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False  # no more items will be yielded

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._closed:
            raise StopAsyncIteration
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is END_OF_STREAM or self._closed:
            self._closed = True
            raise StopAsyncIteration
        if isinstance(item, EngineError):
            self._closed = True
            raise item
        assert isinstance(item, TokenEvent)
        return item

    def cancel(self) -> None:
        """Stop the request and free its KV blocks; iteration ends. Safe at any time."""
        if self._closed:
            return
        self._closed = True
        self._put(END_OF_STREAM)  # wakes a reader blocked in __anext__
        self._on_cancel()

    def _push(self, item: StreamItem) -> None:
        if not self._closed:
            self._put(item)

    def _put(self, item: StreamItem) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
