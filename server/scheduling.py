"""What a scheduler hands the engine for one step."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from batchpilot_server.batching import BatchingConfig
from batchpilot_server.sequence import Sequence


@dataclass
class StepPlan:
    prefill: list[Sequence] = field(default_factory=list)  # compute tokens from num_computed
    decode: list[Sequence] = field(default_factory=list)  # feed the newest token
    preempted: list[Sequence] = field(default_factory=list)  # evicted to make room
    fired: int = 0  # dynamic: size of the batch that fired with this step
    # continuous: how many tokens each prefill row computes this step, a long prompt
    # a chunk at a time so that running sequences keep decoding meanwhile. None: each
    # row computes all it has left. Dynamic leaves it None: its batch runs as one
    # unit, no other sequence decodes meanwhile, and every member's first token waits
    # for the whole batch's prefill anyway, so chunks would only add steps.
    chunks: list[int] | None = None

    @property
    def size(self) -> int:
        return len(self.prefill) + len(self.decode)


def timeout_at(waiting: deque[Sequence], config: BatchingConfig) -> float:
    """When the oldest waiting request has waited `batch_timeout_ms` (both policies fire then)."""
    return waiting[0].arrival + config.batch_timeout_s


class Scheduler(Protocol):
    """The policy half of the engine: `dynamic` or `continuous`.

    Called from the engine thread only, under the engine's lock. `waiting` is
    shared with `Engine.submit`; the scheduler moves sequences out of it.
    """

    @property
    def num_running(self) -> int: ...

    def schedule(self, now: float, config: BatchingConfig, flush: bool) -> StepPlan | None:
        """The next step, or None when nothing may run yet."""
        ...

    def wake_at(self, config: BatchingConfig) -> float | None:
        """Monotonic time at which `schedule` may answer differently without new events."""
        ...

    def finish(self, finished: list[Sequence]) -> list[Sequence]:
        """Take the sequences that just finished; return those whose response completes now."""
        ...

    def cancel(self, seq: Sequence) -> list[Sequence]:
        """Drop a running sequence and free its blocks; return responses that complete now."""
        ...
