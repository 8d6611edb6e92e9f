"""The engine thread's working time, for the busy-time metric."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator


class BusyClock:
    """The engine thread's working time: wall time between laps, less its waits for work.

    What a step really costs the pod (scheduling, forwards, sampling, handing tokens
    to the event loop, and waiting for the GIL or the lock meanwhile), where
    `batchpilot_step_duration_seconds` times the forwards alone.
    """

    def __init__(self) -> None:
        self._since = time.perf_counter()
        self._idle = 0.0

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        began = time.perf_counter()
        try:
            yield
        finally:
            self._idle += time.perf_counter() - began

    def lap(self) -> float:
        """Busy seconds since the last lap."""
        now = time.perf_counter()
        busy = now - self._since - self._idle
        self._since, self._idle = now, 0.0
        return max(0.0, busy)
