"""One request's state inside the engine."""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from batchpilot_server.batching_config import DEFAULT_CLASS
from batchpilot_server.engine.block_pool import BlockHash
from batchpilot_server.engine_api import (
    GREEDY_BELOW_TEMPERATURE,
    FinishReason,
    PromptLogprob,
    SamplingParams,
)

if TYPE_CHECKING:
    import torch
    from batchpilot_server.engine.grammar import GrammarState

# per generated token: the most likely (token id, logprob) it asked for, best first
TopLogprobs = tuple[tuple[int, float], ...]


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: float  # time.monotonic() at submit
    deadline: float | None  # monotonic; only applies until first scheduled
    generator: torch.Generator | None  # None: greedy
    # the request's SLO class and that class's priority (higher is served first, the
    # InferenceObjective's meaning; http/slo_class.py maps vLLM's `priority` to a class)
    slo_class: str = DEFAULT_CLASS
    priority: int = 0
    token_ids: list[int] = field(init=False)
    block_table: list[int] = field(default_factory=list)
    # the prefix cache's names of the full blocks of token_ids, as far as computed
    # (block_pool.extend_block_hashes): tokens only append, so they stay valid
    block_hashes: list[BlockHash] = field(default_factory=list, repr=False)
    # leading blocks of block_table the prefix cache knows: shared from it, or published
    num_cached_blocks: int = 0
    # tokens whose K/V the cache holds: a chunked prefill advances it chunk by chunk,
    # each decode by one; preemption frees the blocks and sets it back to 0.
    # It, `status` and the tokens after the prompt change only through the
    # transitions below (`admit`, `advance`, `preempt`, `finish`).
    num_computed: int = 0
    status: Status = Status.WAITING
    first_scheduled: float | None = None
    finish_reason: FinishReason | None = None
    finished_at: float | None = None
    # the sampler's row of token counts for the penalties (penalties.PenaltyState);
    # kept while the sequence lives, preemption included, so counts stay incremental
    penalty_slot: int | None = None
    # prompt_logprobs: one entry per prompt token after the first, gathered chunk by
    # chunk as prefill computes them; handed out with the first token
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)
    # a sampled sequence's next uniforms from its generator, drawn ahead in a block
    uniforms: list[float] = field(default_factory=list)
    # structured output: the matcher of SamplingParams.grammar, advanced per token
    grammar: GrammarState | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        if self.params.grammar is not None:
            self.grammar = self.params.grammar.start()

    # ---- transitions: the only writers of status, num_computed and the output ----

    def admit(self, num_cached: int) -> None:
        """Scheduled to run, its first `num_cached` tokens' K/V shared from the prefix
        cache: it computes from there."""
        self.status = Status.RUNNING
        self.num_computed = num_cached

    def advance(self, computed: int, sampled: Collection[int] = ()) -> None:
        """A forward computed the K/V of its next `computed` tokens, then `sampled` were
        drawn, each from the logits of the token before it, and fed to the grammar.
        One step: a prefill chunk (a token if it completes the prompt), a decode (one
        and one) or a speculative verification (the newest token and the n accepted
        draft tokens computed, and those n plus the model's own next token drawn, n + 1
        and n + 1); the simulator's fast-forward: n decode steps at once."""
        self.num_computed += computed
        self.token_ids += sampled
        if self.grammar is not None:
            for token in sampled:
                self.grammar.accept(token)

    def gather_prompt_logprobs(self, start: int, entries: list[PromptLogprob]) -> None:
        """Prefill's prompt log-probabilities from prompt position `start` on; a prefill
        that starts over (preempted mid-prompt) gathers anew."""
        if start == 0:
            self.prompt_logprobs = []
        self.prompt_logprobs += entries

    def preempt(self) -> None:
        """Evicted, its blocks given back (released first: publishing them reads
        `num_computed`): recomputed from the first token, or from as far as the prefix
        cache still holds them when admitted again."""
        self.num_computed = 0
        self.status = Status.WAITING

    def finish(self) -> None:
        """Done for good (its response complete, failed or unwanted): the sampler may
        then reuse its penalty row."""
        self.status = Status.FINISHED

    # ---- what it is ------------------------------------------------------------

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V the cache lacks: 1 while decoding, more while prefilling."""
        return len(self.token_ids) - self.num_computed

    @property
    def ready_to_sample(self) -> bool:
        """Every token is computed: the last forward's logits give the next token."""
        return self.num_uncomputed == 0

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt + self.params.max_tokens

    @cached_property
    def sampled(self) -> bool:
        """Drawn from the distribution (else greedy)."""
        return self.params.temperature >= GREEDY_BELOW_TEMPERATURE

    @cached_property
    def penalized(self) -> bool:
        """A repetition, frequency or presence penalty applies."""
        p = self.params
        return p.repetition_penalty != 1.0 or p.frequency_penalty != 0 or p.presence_penalty != 0

    @cached_property
    def always_processed(self) -> bool:
        """The sampler changes this row's logits or draws from them at every step (else
        only while min_tokens holds its stops back: plain greedy, the fast path)."""
        p = self.params
        return self.sampled or self.penalized or bool(p.logit_bias) or p.grammar is not None

    @property
    def holds_stops(self) -> bool:
        """min_tokens is not reached yet: EOS and the stop tokens are masked."""
        return self.num_output < self.params.min_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prefill must hand over the logits of every prompt position (only until the
        first token: a preempted sequence's recompute needs none)."""
        return self.params.prompt_logprobs is not None and self.num_output == 0

    def take_prompt_logprobs(self) -> tuple[PromptLogprob | None, ...] | None:
        """On the first output token: the prompt's log-probabilities, if asked for."""
        if self.params.prompt_logprobs is None or self.num_output != 1:
            return None
        gathered, self.prompt_logprobs = self.prompt_logprobs, []
        return (None, *gathered)

    @property
    def speculable(self) -> bool:
        """A decode row whose draft tokens may be verified in one forward: its every
        logits processor reads only the row's fixed knobs, so the k + 1 positions are
        processed as k + 1 independent rows. Not with penalties or a grammar (their
        state would have to advance through the draft within the step), nor while
        min_tokens holds stops back, nor before the first output token (its event
        carries the prompt's log-probabilities)."""
        return not (
            self.penalized or self.grammar is not None or self.holds_stops or not self.num_output
        )

    def finish_reason_after(self, token_id: int, eos_ids: frozenset[int]) -> FinishReason | None:
        """Why the sequence ends with `token_id` just appended, if it does."""
        return self._finish_reason_at(token_id, self.num_output, eos_ids)

    def tokens_until_finish(self, tokens: list[int], eos_ids: frozenset[int]) -> int:
        """How many of `tokens`, appended in order, it keeps: all, or up to and including
        the one it would finish with (a verification's accepted run may hold a stop)."""
        for index, token in enumerate(tokens):
            if self._finish_reason_at(token, self.num_output + index + 1, eos_ids):
                return index + 1
        return len(tokens)

    def _finish_reason_at(
        self, token_id: int, num_output: int, eos_ids: frozenset[int]
    ) -> FinishReason | None:
        """Why the sequence ends with `token_id` as its `num_output`-th output token."""
        if token_id in self.params.stop_token_ids:
            return "stop"
        if token_id in eos_ids and not self.params.ignore_eos:
            return "stop"
        if num_output >= self.params.max_tokens:
            return "length"
        return None
