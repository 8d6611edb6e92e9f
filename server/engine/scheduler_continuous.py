"""Continuous (iteration-level) scheduling: every step decodes one token for
each running sequence, and finished sequences leave at once. Prompts are
prefilled within a per-step token budget (the config's `prefill_token_budget`, live
like `max_batch_size`; chunked prefill): sequences part-way through their prompt
continue first, oldest first, then waiting sequences are admitted while running <
`max_batch_size` and the free KV blocks hold their whole prompt. With SLO classes
the budget goes by class rank first (`scheduler.class_rank`), so a waiting higher
class comes before a lower one's remaining chunks. A prompt longer than what is
left of the budget computes a chunk of it now and the rest in later steps, so one
long prompt never stalls the running sequences for longer than a budget's worth of
tokens; only its last chunk yields a token. When blocks run out mid-decode the
newest running sequence of the lowest class is preempted: its blocks are freed
and it is recomputed later from its tokens so far, its prefill starting again from
the first token (or, with prefix caching, from the end of its blocks the cache still
holds). With prefix caching, a waiting sequence starts past the prefix the cache
holds, and one whose next blocks a running sequence is computing (two requests with
one system prompt arriving together) waits until they are published and shares them.
`batch_timeout_ms` is how long an idle engine waits for more arrivals before its
first step. A finished sequence leaves, and its response completes, at once.
"""

from __future__ import annotations

import math

from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.ngram_proposer import Proposer, propose
from batchpilot_server.engine.scheduler import Output, QueueScheduler, class_rank, timeout_at
from batchpilot_server.engine.sequence import Sequence, Status
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import CLASS_MAX_WAIT_S, LOWER_CLASS_PREFILL_TOKENS, TokenEvent


class ContinuousScheduler(QueueScheduler):
    def __init__(
        self,
        pool: BlockPool,
        config: BatchingConfig,
        eos_ids: frozenset[int],
        class_max_wait_s: float = CLASS_MAX_WAIT_S,
        lower_class_prefill_tokens: int = LOWER_CLASS_PREFILL_TOKENS,
        proposer: Proposer = propose,
    ) -> None:
        super().__init__(pool, config, eos_ids, class_max_wait_s)
        self.proposer = proposer
        if lower_class_prefill_tokens < 1:  # none would stall a lower class's prompt
            raise ValueError(
                f"lower_class_prefill_tokens must be >= 1, got {lower_class_prefill_tokens}"
            )
        self.lower_class_prefill_tokens = lower_class_prefill_tokens
        self.running: list[Sequence] = []  # oldest first

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _plan(self, now: float, flush: bool) -> StepPlan:
        if not self.running and self.waiting and not flush and not self._due(now):
            return StepPlan()
        preempted = self._make_room_for_decode(now)
        # one uncomputed token is the newest one: a decode computes it, also when it
        # is the last of a prompt whose chunks left exactly that
        decode = [seq for seq in self.running if seq.num_uncomputed == 1]
        chunks = self._spend_prefill_budget(now, decode)
        # after the prompts: a draft takes only the blocks admission left
        verify, drafts = self._draft(decode)
        plan = StepPlan(
            prefill=[seq for seq, _ in chunks],
            decode=[seq for seq in decode if seq not in verify],
            preempted=preempted,
            chunks=[size for _, size in chunks],
            verify=verify,
            drafts=drafts,
        )
        plan.batch_size = plan.size
        return plan

    def _spend_prefill_budget(
        self, now: float, decode: list[Sequence]
    ) -> list[tuple[Sequence, int]]:
        """The prompt chunks this step computes: the budget goes by class rank to running
        sequences part-way through their prompt and to waiting ones, admitted while
        running < `max_batch_size`; within a rank running ones first, so that a chunked
        lower-class prompt never holds the budget ahead of a higher class that arrives.
        Prompts ranking below the highest class among `decode` share at most
        `lower_class_prefill_tokens`: a step's time grows with its prompt tokens, and
        that class's every decode row waits for the step (its TPOT), whereas a lower
        class's long prompt has minutes. An aged request ranks above every class (the
        age bound) and is not held to it; with one class nothing is."""
        budget = self.config.prefill_token_budget  # live: a PUT applies from this step
        prefilling = [seq for seq in self.running if seq.num_uncomputed > 1]
        if len(self.running) < self.config.max_batch_size:
            prefilling += self.waiting  # after the running ones: ahead within a rank
        prefilling = self._by_rank(prefilling, now)
        top = max((seq.priority for seq in decode), default=-math.inf)
        lower = self.lower_class_prefill_tokens  # what lower classes may still compute
        chunks: list[tuple[Sequence, int]] = []
        admitting = True  # until a waiting sequence cannot be: none behind it may pass
        for seq in prefilling:
            if not budget:
                break
            held = class_rank(seq, now, self.class_max_wait_s) < top
            if held and not lower:
                continue  # no tokens for it this step: not admitted for none
            if seq.status is Status.WAITING:
                admitting = admitting and self._admit_for_prefill(seq)
                if not admitting:
                    continue
            size = min(seq.num_uncomputed, budget, lower if held else budget)
            chunks.append((seq, size))
            budget -= size
            lower -= size if held else 0
        return chunks

    def _draft(self, decode: list[Sequence]) -> tuple[list[Sequence], list[list[int]]]:
        """Speculative decoding: the decode rows that verify a draft this step, and their
        drafts (n-gram prompt lookup, up to `num_speculative_tokens`, none past
        max_tokens). A row's draft takes blocks for its tokens only where the pool has
        them free: a guess never preempts a sequence."""
        k = self.config.num_speculative_tokens  # live: a PUT applies from this step
        verify: list[Sequence] = []
        drafts: list[list[int]] = []
        if not k:
            return verify, drafts
        for seq in decode:
            if not seq.speculable:
                continue
            room = min(k, seq.params.max_tokens - seq.num_output - 1)
            draft = self.proposer(seq.token_ids, room)
            if draft and self.pool.grow(seq.block_table, seq.num_tokens + len(draft)):
                verify.append(seq)
                drafts.append(draft)
        return verify, drafts

    def _admit_for_prefill(self, seq: Sequence) -> bool:
        """Admit waiting `seq` into the running batch if it may start now."""
        if len(self.running) >= self.config.max_batch_size:
            return False
        if self._prefix_in_flight(seq):
            return False  # its next blocks are being computed: shared a step or a chunk later
        # blocks for the whole prompt (and its first token) now: later chunks
        # never wait for blocks, and the usage ratio counts the prompt at once;
        # a cached prefix is shared, and its tokens are not computed again
        if not self._admit(seq, seq.num_tokens + 1):
            return False
        self.waiting.remove(seq)
        self.running.append(seq)
        return True

    def _prefix_in_flight(self, seq: Sequence) -> bool:
        """Whether a running sequence is computing the next block `seq` could share (both
        arrived with the same prompt start, as siblings or a shared system prompt do).
        Waiting for it to be published costs `seq` a step; computing it again costs the
        step the whole prefix."""
        if not self.pool.prefix_caching:
            return False
        cached = len(self._cached_prefix(seq))
        wanted = seq.block_hashes[: (seq.num_tokens - 1) // self.pool.block_size]
        if cached == len(wanted):
            return False
        name = wanted[cached]
        return any(name in other.block_hashes[other.num_cached_blocks :] for other in self.running)

    def _due(self, now: float) -> bool:
        return (
            len(self.waiting) >= self.config.max_batch_size
            or now >= timeout_at(self.waiting, self.config)
            # a preempted sequence (in front) waited for its first step already
            or self.waiting[0].first_scheduled is not None
        )

    def _make_room_for_decode(self, now: float) -> list[Sequence]:
        """Grow each running sequence by the token it decodes next, highest class first
        (oldest first within one), preempting the lowest class's newest while the pool
        is short. A preempted request that has aged goes back to the front of the queue
        (`class_rank`): its blocks the prefix cache kept spare it most of the recompute."""
        keep = self._by_rank(self.running, now, aged_first=False)  # victims come off its end
        preempted: list[Sequence] = []
        index = 0
        while index < len(keep):
            seq = keep[index]
            while not self.pool.grow(seq.block_table, seq.num_tokens):
                victim = keep.pop()
                self.running.remove(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
            index += 1
        return preempted

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.preempt()
        # victims go lowest class and newest first: the one to resume first ends up in front
        self.waiting.appendleft(seq)

    def _policy_wake_at(self) -> float | None:
        """When an idle engine stops waiting for more arrivals (None: nothing waits)."""
        if self.running or not self.waiting:
            return None
        return timeout_at(self.waiting, self.config)

    def _finish(self, finished: list[tuple[Sequence, TokenEvent]], now: float) -> list[Output]:
        """Finished sequences leave at once and their blocks return to the pool."""
        for seq, _ in finished:
            self._leave(seq)
        return [Output(seq, event) for seq, event in finished]

    def _drop(self, seq: Sequence, now: float) -> list[Output]:
        self._leave(seq)
        return []

    def _release_running(self) -> list[Sequence]:
        released = list(self.running)
        for seq in released:
            self._leave(seq)
        return released

    def _holding(self) -> list[Sequence]:
        return self.running

    def _leave(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.finish()
