"""Dynamic (static-batch) scheduling: a batch fires when `max_batch_size`
requests wait or the oldest has waited `batch_timeout_ms`, then runs as one
unit until its longest sequence ends. KV for prompt + max_tokens of every
member is reserved when the batch fires; a batch that would not fit is cut,
and the requests cut off fire as the next batch without waiting again.
"""

from __future__ import annotations

from collections import deque

from batchpilot_server.batching import BatchingConfig
from batchpilot_server.kv_cache import BlockPool
from batchpilot_server.scheduling import StepPlan, timeout_at
from batchpilot_server.sequence import Sequence, Status


class DynamicScheduler:
    def __init__(self, pool: BlockPool, waiting: deque[Sequence]) -> None:
        self.pool = pool
        self.waiting = waiting
        self.batch: list[Sequence] = []  # the batch in flight, finished members included
        self.cut_off = 0  # requests left out of the last batch for lack of KV: due at once

    @property
    def num_running(self) -> int:
        return len(self.batch)

    def schedule(self, now: float, config: BatchingConfig, flush: bool) -> StepPlan | None:
        """The next step; None when nothing may run yet. `flush` fires without waiting."""
        if self.batch:
            return StepPlan(decode=[s for s in self.batch if s.finish_reason is None])
        if not self.waiting or not (flush or self._due(now, config)):
            return None
        batch: list[Sequence] = []
        while self.waiting and len(batch) < config.max_batch_size:
            head = self.waiting[0]
            if not self.pool.grow(head.block_table, head.max_total_tokens):
                break  # cut: the rest waits for the next batch
            batch.append(self.waiting.popleft())
            head.status = Status.RUNNING
        if not batch:
            raise RuntimeError("the KV pool cannot hold a request that passed the size check")
        self.cut_off = min(len(self.waiting), config.max_batch_size - len(batch))
        self.batch = batch
        return StepPlan(prefill=batch, fired=len(batch))

    def _due(self, now: float, config: BatchingConfig) -> bool:
        return (
            self.cut_off > 0
            or len(self.waiting) >= config.max_batch_size
            or now >= timeout_at(self.waiting, config)
        )

    def wake_at(self, config: BatchingConfig) -> float | None:
        """When the oldest waiting request's timeout fires (None: nothing waits)."""
        if self.batch or not self.waiting:
            return None
        if self.cut_off:
            return 0.0
        return timeout_at(self.waiting, config)

    def finish(self, finished: list[Sequence]) -> list[Sequence]:
        """Members whose responses may complete now: all of them once the batch is done."""
        return self._end_if_done()

    def cancel(self, seq: Sequence) -> list[Sequence]:
        """Drop a cancelled member (its blocks return at once); may end the batch."""
        if seq not in self.batch:
            return []
        self.batch.remove(seq)
        self.pool.release(seq.block_table)
        return self._end_if_done()

    def _end_if_done(self) -> list[Sequence]:
        if any(s.finish_reason is None for s in self.batch):
            return []
        released, self.batch = self.batch, []
        for seq in released:
            self.pool.release(seq.block_table)
        return released
