"""The scheduler: owner of every admitted request until its response completes.

A scheduler holds the waiting queue and the running sequences, admits requests
(refusing them when the queue is full), applies cancellations, fails requests
that waited past their deadline, refuses or ends requests on shutdown, plans
each engine step (`StepPlan`), takes the step's sampled tokens back and
decides when each response completes. The engine around it only runs the
model and carries `Output`s to the request streams:

    plan = scheduler.schedule(now)              # also ends requests (plan.ended)
    logits = run the model on the plan; tokens = sample plan.sampling()
    outputs = scheduler.postprocess(plan, tokens, logprobs, now)  # advances the rows

Three policies implement it: `scheduler_dynamic.DynamicScheduler`, its firing
rule changed by `scheduler_dynamic.StaticScheduler`, and
`scheduler_continuous.ContinuousScheduler` (`scheduler_policies.new_scheduler`
builds the one a mode names). Torch-free and thread-free: time is
the `now` each call is given, so a simulation drives the same code under a
virtual clock. Not thread-safe: the engine calls it under its lock.
"""

from __future__ import annotations

import heapq
import itertools
import math
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.block_pool import BlockPool, extend_block_hashes
from batchpilot_server.engine.sequence import Sequence, Status, TopLogprobs
from batchpilot_server.engine.step_plan import PromptLogprobs, StepPlan
from batchpilot_server.engine_api import (
    CLASS_MAX_WAIT_S,
    DeadlineExceededError,
    EngineError,
    EngineStoppedError,
    QueueFullError,
    TokenEvent,
)


@dataclass(frozen=True)
class Output:
    """What one request's stream receives: a token event, or the error it ends with.
    A response completes with an event whose finish_reason is set, or an error."""

    seq: Sequence
    item: TokenEvent | EngineError
    # a final event held back until its batch ended: for how long (the hostage time)
    held_s: float | None = None

    @property
    def final(self) -> bool:
        return isinstance(self.item, EngineError) or self.item.finish_reason is not None


class Scheduler(Protocol):
    """What the engine (and a simulation) drives; see the module docstring."""

    @property
    def config(self) -> BatchingConfig: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    def waiting_by_class(self) -> dict[str, int]:
        """The waiting requests per SLO class (the classes with none waiting left out)."""
        ...

    @property
    def steps(self) -> int:
        """Steps planned so far; a token event carries the step that made it."""
        ...

    @property
    def preemptions(self) -> int: ...
    @property
    def idle(self) -> bool:
        """Nothing waits or runs."""
        ...

    def reconfigure(self, config: BatchingConfig) -> None:
        """Takes effect at the next `schedule`; no admitted request fails."""
        ...

    def add(self, seq: Sequence) -> None:
        """Admit a request; raises QueueFullError when `max_queue_size` requests wait."""
        ...

    def cancel(self, seq: Sequence) -> None:
        """Drop a request (its stream is gone); applied, and its blocks freed, at the
        next `schedule`, since the model may be computing it now."""
        ...

    def stop(self, drain: bool) -> None:
        """Shutdown: from now on steps fire without waiting for more arrivals, and
        unless `drain`, requests never scheduled end with EngineStoppedError."""
        ...

    def abort(self, error: EngineError) -> list[Output]:
        """End every admitted request with `error` now and free its blocks."""
        ...

    def schedule(self, now: float) -> StepPlan:
        """The next step (`size` 0: nothing may run yet) and the requests that ended."""
        ...

    def postprocess(
        self,
        plan: StepPlan,
        tokens: list[int],
        logprobs: list[float],
        now: float,
        top_logprobs: list[TopLogprobs] | None = None,
        prompt_logprobs: PromptLogprobs = (),
    ) -> list[Output]:
        """The step `plan` ran: its rows advanced (`StepPlan.advance`), each sampled
        token (one per `plan.sampling()` row) judged; the events to hand out now.
        `top_logprobs`: per row, the most likely (token id, logprob) it asked for."""
        ...

    def wake_at(self) -> float | None:
        """When `schedule` may answer differently without new events (None: never)."""
        ...


class QueueScheduler(ABC):
    """The part both policies share: the waiting queue and what happens to requests in
    it (admission, cancellation, deadlines, shutdown), the order of service by SLO
    class (`_by_rank`), counters, turning sampled tokens into events, and the blocks
    a sequence takes and gives back (with the prefix cache: `_admit`, `_release`).
    A policy plans steps (`_plan`), and decides when finished sequences' responses
    complete (`_finish`) and what a cancelled running sequence leaves (`_drop`)."""

    def __init__(
        self,
        pool: BlockPool,
        config: BatchingConfig,
        eos_ids: frozenset[int],
        class_max_wait_s: float = CLASS_MAX_WAIT_S,
    ) -> None:
        if not class_max_wait_s >= 0:  # NaN too
            raise ValueError(f"the classes' max wait must be >= 0, got {class_max_wait_s}")
        self.pool = pool
        self._config = config
        self.eos_ids = eos_ids
        self.class_max_wait_s = class_max_wait_s
        self.waiting: deque[Sequence] = deque()
        # Waiting requests' deadlines, earliest first, so that a step need not scan the
        # whole queue. Entries whose request was scheduled or ended since stay until
        # they reach the top (`_next_deadline` drops them there).
        self._deadlines: list[tuple[float, int, Sequence]] = []
        self._deadline_order = itertools.count()
        self._cancelled: list[Sequence] = []
        self._stopping = False
        self._drain = False
        self.steps = 0
        self.preemptions = 0
        self.cache_queried = 0  # tokens of admitted sequences looked up in the prefix cache
        self.cache_hit = 0  # of them, found computed there

    @property
    def config(self) -> BatchingConfig:
        return self._config

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def waiting_by_class(self) -> dict[str, int]:
        return dict(Counter(seq.slo_class for seq in self.waiting))

    @property
    @abstractmethod
    def num_running(self) -> int: ...

    @property
    def idle(self) -> bool:
        return not self.waiting and self.num_running == 0

    def reconfigure(self, config: BatchingConfig) -> None:
        self._config = config

    def add(self, seq: Sequence) -> None:
        limit = self._config.max_queue_size
        if len(self.waiting) >= limit:
            raise QueueFullError(
                f"waiting queue is full ({len(self.waiting)} requests, "
                f"max_queue_size {limit}); retry later"
            )
        self.waiting.append(seq)
        if seq.deadline is not None:
            heapq.heappush(self._deadlines, (seq.deadline, next(self._deadline_order), seq))

    def cancel(self, seq: Sequence) -> None:
        self._cancelled.append(seq)

    def stop(self, drain: bool) -> None:
        self._stopping, self._drain = True, drain

    def abort(self, error: EngineError) -> list[Output]:
        waiting, self._cancelled = list(self.waiting), []
        self.waiting.clear()
        return [self._end(seq, error) for seq in [*waiting, *self._release_running()]]

    def schedule(self, now: float) -> StepPlan:
        ended = self._apply_cancellations(now)
        ended += self._expire_deadlines(now)
        if self._stopping and not self._drain:
            ended += self._refuse_unscheduled()
        # the last step's K/V are in the cache now: its full blocks may be hits already
        for seq in self._holding():
            self._publish(seq)
        queried, hit = self.cache_queried, self.cache_hit
        plan = self._plan(now, flush=self._stopping)
        plan.ended = ended
        plan.cache_queried, plan.cache_hit = self.cache_queried - queried, self.cache_hit - hit
        if plan.size:
            self.steps += 1
            self.preemptions += len(plan.preempted)
            plan.first_scheduled = [s for s in plan.prefill if s.first_scheduled is None]
            for seq in plan.first_scheduled:
                seq.first_scheduled = now
        return plan

    def postprocess(
        self,
        plan: StepPlan,
        tokens: list[int],
        logprobs: list[float],
        now: float,
        top_logprobs: list[TopLogprobs] | None = None,
        prompt_logprobs: PromptLogprobs = (),
    ) -> list[Output]:
        spans = plan.accept(tokens, self.eos_ids, prompt_logprobs)
        for seq in plan.verify:
            self.pool.shrink(seq.block_table, seq.num_tokens)  # the rejected drafts' K/V
        outputs: list[Output] = []
        finished: list[tuple[Sequence, TokenEvent]] = []
        tops = top_logprobs or [()] * len(tokens)
        for seq, first, kept in spans:
            prompt = seq.take_prompt_logprobs()
            for index in range(first, first + kept):
                token = tokens[index]
                # only a row's last kept token may finish it (`StepPlan.accept`)
                last = index == first + kept - 1
                reason = seq.finish_reason_after(token, self.eos_ids) if last else None
                seq.finish_reason = reason
                event = TokenEvent(
                    token,
                    seq.num_output - (first + kept - index),
                    reason,
                    logprobs[index],
                    self.steps,
                    top_logprobs=tops[index],
                    prompt_logprobs=prompt if index == first else None,
                )
                if reason is None:
                    outputs.append(Output(seq, event))
                else:
                    seq.finished_at = now
                    finished.append((seq, event))
        return outputs + self._finish(finished, now)

    def wake_at(self) -> float | None:
        wakes = [t for t in (self._policy_wake_at(), self._next_deadline()) if t is not None]
        return min(wakes, default=None)

    # ---- what happens to waiting requests ------------------------------------

    def _apply_cancellations(self, now: float) -> list[Output]:
        released: list[Output] = []
        cancelled, self._cancelled = self._cancelled, []
        for seq in cancelled:
            if seq.status is Status.FINISHED:
                continue
            if seq.status is Status.WAITING:
                self.waiting.remove(seq)
            else:
                released += self._drop(seq, now)
            seq.finish()
        return released

    def _expire_deadlines(self, now: float) -> list[Output]:
        expired: list[Sequence] = []
        while (deadline := self._next_deadline()) is not None and now >= deadline:
            expired.append(heapq.heappop(self._deadlines)[2])
        for seq in expired:
            self.waiting.remove(seq)
        return [self._end(seq, _deadline_error(seq, now)) for seq in expired]

    def _next_deadline(self) -> float | None:
        """The earliest deadline still in force. A deadline applies while its request
        waits to be first scheduled: entries of requests scheduled or ended since are
        dropped here."""
        while self._deadlines:
            deadline, _, seq = self._deadlines[0]
            if seq.status is Status.WAITING and seq.first_scheduled is None:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def _refuse_unscheduled(self) -> list[Output]:
        """Shutdown without drain: requests never scheduled end now (preempted ones,
        already started, are served)."""
        refused = [seq for seq in self.waiting if seq.first_scheduled is None]
        for seq in refused:
            self.waiting.remove(seq)
        error = EngineStoppedError("engine is shutting down; request not started")
        return [self._end(seq, error) for seq in refused]

    @staticmethod
    def _end(seq: Sequence, error: EngineError) -> Output:
        seq.finish()
        return Output(seq, error)

    # ---- the order of service by class ---------------------------------------

    def _by_rank(
        self, seqs: Iterable[Sequence], now: float, *, aged_first: bool = True
    ) -> list[Sequence]:
        """`seqs` highest `class_rank` first (`aged_first` False: by class priority alone,
        as preemption ranks them). The sort is stable: within a rank they keep the order
        given (the queue's, the running list's). With one class among them nothing
        moves (its age only lifts it over other classes), so a server without classes
        schedules exactly as it did before them, and pays no sort."""
        seqs = list(seqs)
        if len({seq.priority for seq in seqs}) <= 1:
            return seqs
        wait = self.class_max_wait_s if aged_first else math.inf
        return sorted(seqs, key=lambda seq: -class_rank(seq, now, wait))

    def first_in_line(self, now: float) -> Sequence | None:
        """The waiting request a plan at `now` tries to start first: the queue's highest
        `class_rank`, in queue order within a rank (none behind it starts before it);
        None when none waits. The simulator's fast-forward asks it."""
        if not self.waiting:
            return None
        return self._by_rank(self.waiting, now)[0]

    def may_admit(self, now: float) -> bool:
        """Whether a plan at `now` admits the request it tries first: a slot is free and
        the pool holds that request's blocks (the simulator's and the twin's
        fast-forward ask it before skipping decode-only steps)."""
        if not self.waiting or self.num_running >= self.config.max_batch_size:
            return False
        first = self.first_in_line(now)
        return first is not None and self.pool.can_hold(first.block_table, first.num_tokens + 1)

    def rank_changes_at(self, now: float) -> float | None:
        """When the waiting queue's order of service may next change without a new event:
        a waiting request reaching the classes' max wait while more than one class waits
        (None: not before an event)."""
        if len({seq.priority for seq in self.waiting}) <= 1:
            return None
        ages = [seq.arrival + self.class_max_wait_s for seq in self.waiting]
        return min((at for at in ages if at > now), default=None)

    # ---- blocks and the prefix cache -------------------------------------------

    def _admit(self, seq: Sequence, num_tokens: int) -> bool:
        """Admit waiting `seq`, which holds no blocks, with blocks for `num_tokens`: the
        longest cached prefix of its tokens shared, fresh blocks for the rest; it runs
        and computes from there (the plans after this one advance it, `StepPlan.advance`).
        False, nothing taken, when the pool cannot hold it."""
        cached = self._cached_prefix(seq)
        if not self.pool.grow_sharing(seq.block_table, cached, num_tokens):
            return False
        seq.admit(len(cached) * self.pool.block_size)
        seq.num_cached_blocks = len(cached)
        if self._looks_up(seq):
            self.cache_queried += seq.num_tokens
            self.cache_hit += seq.num_computed
        return True

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks `seq` may share. Whole blocks short of its last token: that
        one is always computed, for the logits its next token is sampled from, and
        into a block of its own (a shared block is never written)."""
        if not self._looks_up(seq):
            return []
        size = self.pool.block_size
        usable = (seq.num_tokens - 1) // size
        extend_block_hashes(seq.block_hashes, seq.token_ids, size, usable * size)
        return self.pool.cached_prefix(seq.block_hashes[:usable])

    def _looks_up(self, seq: Sequence) -> bool:
        """Whether `seq` may start past a cached prefix: not when it asks for its prompt's
        log-probabilities, which need every prompt position computed (it still
        publishes what it computes)."""
        return self.pool.prefix_caching and seq.params.prompt_logprobs is None

    def _publish(self, seq: Sequence) -> None:
        """Name the full blocks whose K/V `seq` computed: later sequences may share them."""
        if not self.pool.prefix_caching:
            return
        size = self.pool.block_size
        full = min(seq.num_computed // size, len(seq.block_table))
        if full <= seq.num_cached_blocks:
            # nothing new (a decoding row fills a block every `size` steps): its hashes
            # already reach that far, and this runs for every running row every step
            return
        extend_block_hashes(seq.block_hashes, seq.token_ids, size, full * size)
        for index in range(seq.num_cached_blocks, full):
            self.pool.publish(seq.block_table[index], seq.block_hashes[index])
        seq.num_cached_blocks = full

    def _release(self, seq: Sequence) -> None:
        """Give `seq`'s blocks back; what it computed stays cached for later sequences
        (and for itself, should it be recomputed after a preemption)."""
        self._publish(seq)
        self.pool.release(seq.block_table)
        seq.num_cached_blocks = 0

    # ---- the policy's part ---------------------------------------------------

    @abstractmethod
    def _holding(self) -> list[Sequence]:
        """The sequences that hold blocks now."""

    @abstractmethod
    def _plan(self, now: float, flush: bool) -> StepPlan:
        """The step to run now; `flush`: fire without waiting for more arrivals."""

    @abstractmethod
    def _policy_wake_at(self) -> float | None:
        """When `_plan` may fire without new events (None: not before one)."""

    @abstractmethod
    def _finish(self, finished: list[tuple[Sequence, TokenEvent]], now: float) -> list[Output]:
        """Sequences that just sampled their last token, with that final event."""

    @abstractmethod
    def _drop(self, seq: Sequence, now: float) -> list[Output]:
        """A running sequence was cancelled: free it; responses that complete now."""

    @abstractmethod
    def _release_running(self) -> list[Sequence]:
        """Abort: free every running sequence (finished members of a batch too) and
        forget it; returns them."""


def class_rank(seq: Sequence, now: float, max_wait_s: float) -> float:
    """How early `seq` is served: its class's priority (higher first), or above every
    class once it arrived `max_wait_s` ago. The age is what bounds a low class's wait:
    no request that arrived more than `max_wait_s` after it is first scheduled before
    it (docs/server.md). Preemption ranks by priority alone (`max_wait_s` infinite):
    the higher class keeps its KV blocks however old the lower class's requests are,
    which in a class with end-to-end targets of minutes most running ones would be."""
    return math.inf if now - seq.arrival >= max_wait_s else seq.priority


def timeout_at(waiting: deque[Sequence], config: BatchingConfig) -> float:
    """When the oldest waiting request has waited `batch_timeout_ms` (dynamic and
    continuous fire then)."""
    return waiting[0].arrival + config.batch_timeout_s


def _deadline_error(seq: Sequence, now: float) -> DeadlineExceededError:
    allowed = (seq.deadline or now) - seq.arrival
    return DeadlineExceededError(
        f"request waited {now - seq.arrival:.3f}s in the queue without being scheduled "
        f"(deadline {allowed:.3f}s)"
    )
