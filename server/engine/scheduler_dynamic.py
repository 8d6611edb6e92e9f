"""Dynamic scheduling: a batch fires when `max_batch_size` requests wait or the
oldest has waited `batch_timeout_ms`, then runs as one unit until its longest
sequence ends. Members are taken from the waiting queue by class rank
(`scheduler.class_rank`), FIFO within one. KV for prompt + max_tokens of every
member is reserved when the batch fires (so none is ever preempted); a batch that
would not fit is cut, and the requests cut off fire as the next batch without
waiting again. A member that finishes early keeps its
final event (and its blocks) until the batch ends: the hostage effect, reported
as each event's `held_s`. Ragged execution computes nothing more for it; padded
execution decodes it again each step, its outputs discarded, as a classic
batcher running a padded batch does.

Static scheduling (`StaticScheduler`) is the same with another firing rule: a
batch fires only when `max_batch_size` requests wait (or, with a `max_wait_s`
safety valve, when the oldest has waited that long); `batch_timeout_ms` has no
effect.
"""

from __future__ import annotations

from dataclasses import replace

from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.scheduler import Output, QueueScheduler, timeout_at
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import CLASS_MAX_WAIT_S, TokenEvent


class DynamicScheduler(QueueScheduler):
    def __init__(
        self,
        pool: BlockPool,
        config: BatchingConfig,
        eos_ids: frozenset[int],
        padded: bool = False,
        class_max_wait_s: float = CLASS_MAX_WAIT_S,
    ) -> None:
        super().__init__(pool, config, eos_ids, class_max_wait_s)
        self.padded = padded
        self.batch: list[Sequence] = []  # the batch in flight, finished members included
        self.held: dict[Sequence, TokenEvent] = {}  # finished members' final events
        self.cut_off = 0  # requests left out of the last batch for lack of KV: due at once

    @property
    def num_running(self) -> int:
        return len(self.batch)

    def _plan(self, now: float, flush: bool) -> StepPlan:
        if self.batch:
            running = [s for s in self.batch if s.finish_reason is None]
            finished = [s for s in self.batch if s.finish_reason is not None]
            if self.padded:
                return StepPlan(decode=running, pad=finished)
            return StepPlan(decode=running, held=len(finished))
        if not self.waiting or not (flush or self._due(now)):
            return StepPlan()
        batch: list[Sequence] = []
        # the higher class first; a lower one that cannot fit is not passed by a later one
        for seq in self._by_rank(self.waiting, now)[: self.config.max_batch_size]:
            if not self._admit(seq, seq.max_total_tokens):
                break  # cut: the rest waits for the next batch
            self.waiting.remove(seq)
            batch.append(seq)
        if not batch:
            raise RuntimeError("the KV pool cannot hold a request that passed the size check")
        self.cut_off = min(len(self.waiting), self.config.max_batch_size - len(batch))
        self.batch = batch
        return StepPlan(prefill=batch, batch_size=len(batch))

    def _due(self, now: float) -> bool:
        fire_at = self._fire_at()
        return (
            self.cut_off > 0
            or len(self.waiting) >= self.config.max_batch_size
            or (fire_at is not None and now >= fire_at)
        )

    def _fire_at(self) -> float | None:
        """When a partial batch fires (something waits): at the oldest request's timeout."""
        return timeout_at(self.waiting, self.config)

    def _policy_wake_at(self) -> float | None:
        """When a partial batch fires (None: nothing waits, or only a full batch fires)."""
        if self.batch or not self.waiting:
            return None
        if self.cut_off:
            return 0.0
        return self._fire_at()

    def _finish(self, finished: list[tuple[Sequence, TokenEvent]], now: float) -> list[Output]:
        """Held until the whole batch is done; then every member completes."""
        self.held.update(finished)
        return self._end_if_done(now)

    def _drop(self, seq: Sequence, now: float) -> list[Output]:
        """A cancelled member's blocks return at once; it may end the batch."""
        self.batch.remove(seq)
        self.held.pop(seq, None)
        self._release(seq)
        return self._end_if_done(now)

    def _end_if_done(self, now: float) -> list[Output]:
        if any(s.finish_reason is None for s in self.batch):
            return []
        released, self.batch = self.batch, []
        outputs = []
        for seq in released:
            self._release(seq)
            seq.finish()
            # every final event of a batch carries the step that ended it
            event = replace(self.held.pop(seq), step=self.steps)
            outputs.append(Output(seq, event, held_s=now - (seq.finished_at or now)))
        return outputs

    def _release_running(self) -> list[Sequence]:
        released, self.batch, self.held = self.batch, [], {}
        for seq in released:
            self._release(seq)
        return released

    def _holding(self) -> list[Sequence]:
        return self.batch


class StaticScheduler(DynamicScheduler):
    """A batch fires only when full: the baseline dynamic batching improves on. With
    one request waiting the device idles until `max_batch_size` arrive, unless the
    `max_wait_s` safety valve (None: off) fires a partial batch."""

    def __init__(
        self,
        pool: BlockPool,
        config: BatchingConfig,
        eos_ids: frozenset[int],
        padded: bool = False,
        max_wait_s: float | None = None,
        class_max_wait_s: float = CLASS_MAX_WAIT_S,
    ) -> None:
        if max_wait_s is not None and max_wait_s < 0:
            raise ValueError(f"the static batch's max wait must be >= 0, got {max_wait_s}")
        super().__init__(pool, config, eos_ids, padded, class_max_wait_s)
        self.max_wait_s = max_wait_s

    def _fire_at(self) -> float | None:
        if self.max_wait_s is None:
            return None
        return self.waiting[0].arrival + self.max_wait_s
