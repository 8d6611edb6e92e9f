"""A step's plan: what each row computes, and what it did once computed.

The scheduler plans a step (`StepPlan`); the model runner reads the plan and returns
logits, writing nothing to the sequences; the sampler picks tokens; then
`StepPlan.advance` (called by the scheduler's `postprocess`) records what the step
did through each row's `Sequence.advance`: its computed K/V, its prompt
log-probabilities, the token it sampled and its grammar state. A simulation or a
test drives the same code path without a model.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import PromptLogprob

if TYPE_CHECKING:
    from batchpilot_server.engine.scheduler import Output

# what prefill computed of a prompt's log-probabilities for a row that asked: the row,
# the first prompt position the logits were taken at, and one entry per position
PromptLogprobEntries = tuple[Sequence, int, list[PromptLogprob]]
PromptLogprobs = Iterable[PromptLogprobEntries]


@dataclass
class StepPlan:
    prefill: list[Sequence] = field(default_factory=list)  # compute tokens from num_computed
    decode: list[Sequence] = field(default_factory=list)  # feed the newest token
    preempted: list[Sequence] = field(default_factory=list)  # evicted to make room
    # how many tokens each prefill row computes this step, a long prompt a chunk at a
    # time so that running sequences keep decoding meanwhile (continuous). None: each
    # row computes all it has left (dynamic: its batch runs as one unit, no other
    # sequence decodes meanwhile, and every member's first token waits for the whole
    # batch's prefill anyway, so chunks would only add steps).
    chunks: list[int] | None = None
    # the batch size this step records (the batch-size metric), 0: none. Dynamic: the
    # batch that fires with this step; continuous: every step's rows.
    batch_size: int = 0
    # rows scheduled for the first time with this step (not recomputed ones)
    first_scheduled: list[Sequence] = field(default_factory=list)
    # requests that ended while this step was planned (cancellation of a batch
    # member releasing the rest, a missed deadline, shutdown): deliver at once
    ended: list[Output] = field(default_factory=list)
    # finished members of a static or dynamic batch, held until it ends. Padded
    # execution decodes them again (`pad`, outputs discarded) to keep the batch
    # rectangular; ragged execution computes nothing for them (`held` counts them)
    pad: list[Sequence] = field(default_factory=list)
    held: int = 0
    # prefix caching, over the sequences admitted with this step: tokens looked up in
    # the cache, and how many of them it held (computed no more)
    cache_queried: int = 0
    cache_hit: int = 0
    # speculative decoding (continuous): decode rows that feed their newest token and
    # a draft (`drafts`, one list per row) as a short chunk, to verify the draft in
    # this step's one forward; not among `decode`. `accepted`: how many draft tokens
    # each kept, set by `accept`
    verify: list[Sequence] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        return len(self.prefill) + len(self.decode) + len(self.verify)

    def chunk_sizes(self) -> list[int]:
        """The tokens each prefill row computes this step; read before `advance`."""
        return self.chunks or [seq.num_uncomputed for seq in self.prefill]

    def sampling(self) -> list[Sequence]:
        """The rows that sample a token after this step, in the order of the runner's
        logits: the prefill rows whose chunk is the rest of their tokens (a chunk that
        leaves part of its prompt for later samples nothing), then every decode row
        (padding rows' outputs are discarded). Read before `advance`."""
        completed = [
            seq
            for seq, size in zip(self.prefill, self.chunk_sizes(), strict=True)
            if size == seq.num_uncomputed
        ]
        return completed + self.decode

    def sampler_rows(self) -> list[Sequence]:
        """The sampler's rows, in the order of the runner's logits: the completed
        prefill rows, each verify row once per position it computes (its draft and
        one more: the k + 1 positions are drawn as independent rows), then the decode
        rows. Read before `advance`."""
        rows = self.sampling()
        completed = rows[: len(rows) - len(self.decode)]
        verified = [
            seq for seq, draft in zip(self.verify, self.drafts, strict=True) for _ in (0, *draft)
        ]
        return completed + verified + self.decode

    def advance(self, tokens: list[int], prompt_logprobs: PromptLogprobs = ()) -> list[Sequence]:
        """Record what this step did to its rows: what its forward computed and each
        sampling row's token (`tokens`, in `sampling` order). Returns the sampling rows."""
        return [seq for seq, _, _ in self.accept(tokens, frozenset(), prompt_logprobs)]

    def accept(
        self, tokens: list[int], eos_ids: frozenset[int], prompt_logprobs: PromptLogprobs = ()
    ) -> list[tuple[Sequence, int, int]]:
        """Record what this step did to its rows, `tokens` one per `sampler_rows` row.
        A verify row keeps the longest run of its draft that its own positions drew
        (each position's token was drawn from the logits after the draft before it, so
        a draft token is kept with exactly the probability the model gives it: the
        rejection sampling of a one-hot proposal, greedy's argmax match at
        temperature 0), then the token drawn at the first mismatch, or after the whole
        draft (the bonus token); up to a token it finishes with. Returns, per sampling
        row, (row, index of its first token in `tokens`, tokens it keeps): its tokens
        are `tokens[index : index + kept]`."""
        rows = self.sampling()
        if len(tokens) != len(rows) + sum(len(draft) + 1 for draft in self.drafts):
            raise ValueError("a step's tokens are one per row of `sampler_rows`")
        completed = rows[: len(rows) - len(self.decode)]
        spans = [(seq, index, 1) for index, seq in enumerate(completed)]
        index = len(completed)
        self.accepted = []
        for seq, draft in zip(self.verify, self.drafts, strict=True):
            drawn = tokens[index : index + len(draft) + 1]
            matched = next(
                (i for i, (d, t) in enumerate(zip(draft, drawn, strict=False)) if d != t),
                len(draft),
            )
            kept = seq.tokens_until_finish(drawn[: matched + 1], eos_ids)
            self.accepted.append(kept - 1)
            spans.append((seq, index, kept))
            index += len(draft) + 1
        spans += [(seq, index + row, 1) for row, seq in enumerate(self.decode)]
        sampled = {seq: tokens[first : first + kept] for seq, first, kept in spans}
        self._advance_rows(sampled, prompt_logprobs)
        return spans

    def record_computed(self, prompt_logprobs: PromptLogprobs = ()) -> None:
        """What this step's forward computed, no token sampled: tests that drive the
        model runner alone call it after each forward."""
        self._advance_rows({}, prompt_logprobs)

    def _advance_rows(
        self, sampled: dict[Sequence, list[int]], prompt_logprobs: PromptLogprobs
    ) -> None:
        """Each row through `Sequence.advance`: a prefill row's K/V by its chunk, a
        decode or padding row's up to its newest token, then its sampled token; a
        verify row's newest token and its accepted draft tokens (as many as it keeps
        tokens: the K/V of the positions after them drew from a rejected context);
        and the prompt log-probabilities prefill gathered."""
        for seq, size in zip(self.prefill, self.chunk_sizes(), strict=True):
            seq.advance(size, sampled.get(seq, ()))
        for seq in (*self.decode, *self.pad):
            seq.advance(seq.num_uncomputed, sampled.get(seq, ()))
        for seq in self.verify:
            kept = sampled.get(seq, [])
            seq.advance(len(kept), kept)
        for seq, start, entries in prompt_logprobs:
            seq.gather_prompt_logprobs(start, entries)

    def slot_steps(self) -> SlotSteps:
        """The token positions this step's batch holds, by what they are for; read
        before `advance`."""
        # the prefill rows, and the verify rows apart, each compute one rectangle as wide
        # as its longest row: torch's attention takes no ragged batch, so shorter rows
        # compute padding positions
        rectangles = (self.chunk_sizes(), [len(draft) + 1 for draft in self.drafts])
        active = sum(sum(rows) for rows in rectangles)
        computed = sum(len(rows) * max(rows, default=0) for rows in rectangles)
        return SlotSteps(
            active=active + len(self.decode),
            finished=self.held,
            padding=computed - active + len(self.pad),
        )

    def work(self) -> StepWork:
        """What this step computes, for a step-time model; read before `advance`."""
        prefill = self.chunk_sizes()
        decode = self.decode + self.pad  # padding rows are computed too
        contexts = [
            seq.num_computed + size for seq, size in zip(self.prefill, prefill, strict=True)
        ]
        # a verify row is a decode row (its newest token) whose draft tokens are computed
        # as prompt tokens are: the step model then learns a verified token's cost as a
        # prompt token's, and its rows stay the batch's rows whatever k is
        drafted = [len(draft) for draft in self.drafts]
        rows = zip(self.verify, self.drafts, strict=True)
        contexts += [seq.num_tokens + len(draft) for seq, draft in rows]
        return StepWork(
            decode_rows=len(decode) + len(self.verify),
            prefill_tokens=sum(prefill) + sum(drafted),
            kv_tokens=sum(contexts) + sum(seq.num_tokens for seq in decode),
        )


@dataclass(frozen=True)
class StepWork:
    """One step's compute: rows of its decode forward, prompt tokens its prefill forward
    computes (a cached prefix is not), and KV tokens attended (each row's context length
    once the step computed it, summed)."""

    decode_rows: int
    prefill_tokens: int
    kv_tokens: int


@dataclass(frozen=True)
class SlotSteps:
    """Token positions of one step's batch (a decode row is one, a prefill row as many
    as the forward's width): `active` ones compute a token a request needs, `finished`
    ones are held by a finished member of a static or dynamic batch without compute
    (ragged), `padding` ones are computed only to keep the batch rectangular."""

    active: int
    finished: int
    padding: int
