"""Next-token choice, batched over the rows of a step.

A plain greedy row (temperature below GREEDY_BELOW_TEMPERATURE, no penalty, no
logit_bias, min_tokens reached) takes the argmax of the raw log-probabilities: the
fast path, unchanged by the rest. Every other row goes through, batched with the
step's other such rows (vLLM's order):

1. min_tokens: EOS (unless ignore_eos) and stop_token_ids at -inf until min_tokens
   tokens are out;
2. logit_bias: added to the logits;
3. penalties: repetition (transformers' RepetitionPenaltyLogitsProcessor: a logit of
   a token seen in the prompt or the output is divided by the penalty if positive,
   multiplied if negative), then frequency and presence (OpenAI's: minus count x
   frequency_penalty + presence_penalty over the output tokens so far);
3b. structured output: the tokens each grammar row's matcher forbids at -inf, one
   bitmask for the step's grammar rows (grammar.mask_logits), EOS among
   them until the grammar is complete (the chosen token advances the matcher in
   `StepPlan.advance`);
4. a greedy row takes the argmax; a sampled row divides by its temperature, keeps
   (transformers' order) the top_k most probable tokens, the smallest most-probable
   prefix whose mass reaches top_p and the tokens of at least min_p x the top one's
   probability (ties at a cut-off are kept), and draws one token by inverse CDF with
   one uniform from its own generator: a seeded request is reproducible whatever
   rows share its steps.

Log-probabilities (the chosen token's, the top-k, the prompt's) are the model's raw
distribution: log_softmax of the float32 logits before any of the above, as vLLM's
default and OpenAI's `logprobs` report them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from batchpilot_server.engine.grammar import mask_logits
from batchpilot_server.engine.inference_mode import inference_mode
from batchpilot_server.engine.penalties import PenalizedRows, PenaltyState
from batchpilot_server.engine.sampling_knobs import Cuts, Knobs
from batchpilot_server.engine.sequence import Sequence, TopLogprobs
from batchpilot_server.engine_api import GREEDY_BELOW_TEMPERATURE, PromptLogprob, SamplingParams

# top_k and top_p cut among this many most probable tokens first (torch.topk, far
# cheaper than sorting a 50k-100k vocabulary per row); a row whose top_p mass lies
# deeper widens the search, up to the whole vocabulary, so the result is exact
CANDIDATES = 64


def make_generator(params: SamplingParams, device: str) -> torch.Generator | None:
    """A private generator for a sampled request; None for greedy ones."""
    if params.temperature < GREEDY_BELOW_TEMPERATURE:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


@dataclass(frozen=True)
class Sampled:
    """One step's choices, per row: the token, its raw log-probability, and the
    `SamplingParams.logprobs` most likely (token id, logprob), best first (() if none)."""

    tokens: list[int]
    logprobs: list[float]
    top_logprobs: list[TopLogprobs]


class Sampler:
    """The engine's sampler: `sample` once per forward, on the rows ready to sample."""

    def __init__(self, vocab_size: int, eos_ids: frozenset[int], device: str) -> None:
        self.eos = tuple(sorted(eos_ids))
        self.penalties = PenaltyState(vocab_size, device)
        # the last rows processed and what was built for them: a decoding batch samples
        # the same sequences step after step, so a step builds none of it again
        self._batch: Batch | None = None

    @inference_mode
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """One token per row of `logits` [len(seqs), vocab], which it processes in place
        once the raw log-probabilities are taken (the engine's logits are scratch)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        holds = tuple(seq.holds_stops for seq in seqs)
        if any(holds) or any(seq.always_processed for seq in seqs):
            batch = self._batch_of(seqs, holds, logits)
            self.process(logits, seqs, batch.knobs)
            uniform = next_uniforms(seqs, batch.knobs.sampled, logits.device)
            chosen = self.choose(logits, batch.knobs, logprobs, uniform)
            if batch.penalized is not None:
                self.penalties.record(batch.penalized, chosen)
            picked_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
        else:
            # the value and its index in one op (argmax's index: the first of ties, a
            # NaN first), where argmax then gather took three: at batch 1 a step's
            # sampling is mostly per-op dispatch
            picked_logprobs, chosen = logprobs.max(dim=-1)
        return Sampled(chosen.tolist(), picked_logprobs.tolist(), step_top_logprobs(logprobs, seqs))

    @inference_mode
    def process(self, logits: torch.Tensor, seqs: list[Sequence], knobs: Knobs) -> None:
        """Steps 1-3 of the module docstring on `logits` [len(seqs), vocab], in place."""
        batch = self._batch
        if batch is None or batch.knobs is not knobs:
            batch = self._build(seqs, tuple(seq.holds_stops for seq in seqs), knobs, logits)
        if batch.sparse is not None:
            index, values = batch.sparse
            # a token listed twice gets both (the API refuses duplicates); -inf plus a
            # bias stays -inf
            logits.index_put_(index, values, accumulate=True)
        if batch.penalized is not None:
            self.penalties.apply(logits, batch.penalized)
        if knobs.constrained:
            mask_logits(logits, knobs.constrained, [seqs[row] for row in knobs.constrained])

    @staticmethod
    def choose(
        logits: torch.Tensor, knobs: Knobs, logprobs: torch.Tensor, uniform: torch.Tensor
    ) -> torch.Tensor:
        """Step 4: a token per row [rows]: the argmax of a processed greedy row, a draw
        at `uniform` [sampled rows] for a sampled one, the argmax of the raw `logprobs`
        for the others. The sampled rows' logits are divided by their temperature in
        place (in a copy when other rows lie among them)."""
        rows = logits.shape[0]
        if len(knobs.greedy) == rows:
            return logits.argmax(dim=-1)
        if knobs.sampled_index is None:  # every row samples
            return draw_rows(logits, knobs, uniform)
        chosen = logprobs.argmax(dim=-1)
        if knobs.greedy:
            index = knobs.greedy_index
            chosen.index_copy_(0, index, logits.index_select(0, index).argmax(dim=-1))
        if knobs.sampled:
            index = knobs.sampled_index
            chosen.index_copy_(0, index, draw_rows(logits.index_select(0, index), knobs, uniform))
        return chosen

    def _batch_of(
        self, seqs: list[Sequence], holds: tuple[bool, ...], logits: torch.Tensor
    ) -> Batch:
        """The kept Batch while `seqs` are its rows and hold the same stops back."""
        batch = self._batch
        if batch is None or batch.holds != holds or batch.seqs != tuple(seqs):
            batch = self._build(seqs, holds, Knobs.of(seqs, logits.device), logits)
        return batch

    def _build(
        self, seqs: list[Sequence], holds: tuple[bool, ...], knobs: Knobs, logits: torch.Tensor
    ) -> Batch:
        penalized = [seqs[row] for row in knobs.penalized]
        self._batch = Batch(
            seqs=tuple(seqs),
            holds=holds,
            knobs=knobs,
            sparse=self._sparse(seqs, holds, logits),
            penalized=self.penalties.rows_of(penalized, knobs, logits) if penalized else None,
        )
        return self._batch

    def _sparse(
        self, seqs: list[Sequence], holds: tuple[bool, ...], logits: torch.Tensor
    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """min_tokens (the stops of the rows short of it at -inf) and logit_bias, as the
        index and values of one accumulating index_put_."""
        entries = [
            (row, token, -torch.inf)
            for row, seq in enumerate(seqs)
            if holds[row]
            for token in self._stops(seq.params)
        ]
        entries += [
            (row, token, bias)
            for row, seq in enumerate(seqs)
            for token, bias in seq.params.logit_bias
        ]
        if not entries:
            return None
        rows, tokens, values = zip(*entries, strict=True)
        device = logits.device
        index = (torch.tensor(rows, device=device), torch.tensor(tokens, device=device))
        return index, torch.tensor(values, dtype=logits.dtype, device=device)

    def _stops(self, params: SamplingParams) -> tuple[int, ...]:
        return params.stop_token_ids if params.ignore_eos else params.stop_token_ids + self.eos


@dataclass(frozen=True, eq=False)
class Batch:
    """What a step reads of its rows that changes only with the rows, built once for a
    run of steps over the same sequences holding the same stops back: their knobs, the
    min_tokens and logit_bias entries (`sparse`: index and values) and the penalized
    rows as PenaltyState reads them (None: none)."""

    seqs: tuple[Sequence, ...]
    holds: tuple[bool, ...]  # each row's Sequence.holds_stops
    knobs: Knobs
    sparse: tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None
    penalized: PenalizedRows | None


def next_uniforms(seqs: list[Sequence], rows: list[int], device: torch.device) -> torch.Tensor:
    """This step's uniform of each sampled row (`rows`), float64."""
    return torch.tensor(
        [next_uniform(seqs[row]) for row in rows], dtype=torch.float64, device=device
    )


# uniforms a sampled sequence's generator draws at a time (one a token)
UNIFORMS_AHEAD = 64


def next_uniform(seq: Sequence) -> float:
    """The next uniform of a sampled sequence's own generator (drawn ahead in blocks:
    one generator call per row and step would cost more than the rest of the draw)."""
    if not seq.uniforms:
        generator = seq.generator
        assert generator is not None, "a sampled sequence has a generator"
        ahead = torch.rand(
            UNIFORMS_AHEAD, generator=generator, dtype=torch.float64, device=generator.device
        )
        seq.uniforms = ahead.tolist()[::-1]  # popped from the end, in the order drawn
    return seq.uniforms.pop()


def draw_rows(logits: torch.Tensor, knobs: Knobs, uniform: torch.Tensor) -> torch.Tensor:
    """A token for each of the sampled rows' `logits` (divided by their temperature in
    place) at their `uniform`."""
    cuts = knobs.cuts
    return draw(candidates(logits.div_(cuts.temperature), cuts.table, knobs), uniform)


@dataclass(frozen=True)
class Candidates:
    """Sampled rows' most probable tokens, best first: `ids` [rows, width] and their
    `probs`, and which of them the row's top_k, top_p and min_p keep (`keep`). A row
    with a cut keeps only candidates; an uncut row (`cut` False) keeps the whole
    vocabulary, the candidates and the rest: `every` [rows, vocab], its probabilities."""

    ids: torch.Tensor
    probs: torch.Tensor
    keep: torch.Tensor
    cut: torch.Tensor
    every: torch.Tensor


def candidates(scaled: torch.Tensor, table: torch.Tensor, knobs: Knobs) -> Candidates:
    """The candidates of `scaled` [rows, vocab] (logits over temperature), `table` the
    rows' knobs: the CANDIDATES most probable tokens, more where a cut lies deeper."""
    cuts = knobs.cuts_of(table)
    vocab = scaled.shape[-1]
    every = torch.softmax(scaled, dim=-1)
    # one past the largest top_k: a row cut there settles at once
    width = min(vocab, max(CANDIDATES, knobs.widest_k + 1))
    while True:
        probs, ids = every.topk(width, dim=-1)
        threshold = cut_threshold(probs, cuts, knobs)
        if threshold is None:  # no row cuts: every token stays
            keep = torch.ones_like(probs, dtype=torch.bool)
            return Candidates(ids, probs, keep, torch.zeros_like(keep[:, 0]), every)
        keep = probs >= threshold[:, None]
        cut = threshold > 0
        # settled where the kept tokens of a row with a cut end inside the candidates
        # (ties included)
        if width == vocab or not bool((cut & keep[:, -1]).any()):
            return Candidates(ids, probs, keep, cut, every)
        width = min(vocab, width * 8)


def cut_threshold(probs: torch.Tensor, cuts: Cuts, knobs: Knobs) -> torch.Tensor | None:
    """Per row, the least probability its cuts keep (0: no cut; None: no row cuts),
    from its most probable tokens `probs` [rows, width], best first. top_p's mass is
    the top_k tokens' (renormalized), as transformers applies it; min_p is a share of
    the top token's probability."""
    threshold = None
    if knobs.top_k or knobs.top_p:
        # None where no row sets top_k: every candidate lies within it
        within = cuts.within_k(probs.shape[-1]) if knobs.top_k else None
        inside = None if within is None else within[0]
        if knobs.top_p:
            kept = probs if within is None else probs * within[1]
            before = kept.cumsum(dim=-1) - kept  # mass above each token
            if knobs.top_k:  # renormalized to the top_k tokens' mass (where set)
                mass = kept.sum(dim=-1, keepdim=True)
                before /= (
                    mass if cuts.renormalized is None else torch.where(cuts.renormalized, mass, 1.0)
                )
            below = before < cuts.top_p
            inside = below if inside is None else inside & below
            inside[:, 0] = True  # the top token always: a top_p that rounds to 0 keeps one
        assert inside is not None, "top_k or top_p cuts"
        last = inside.sum(dim=-1, keepdim=True) - 1
        least = probs.gather(1, last)
        threshold = (least if cuts.cutting is None else torch.where(cuts.cutting, least, 0.0))[:, 0]
    if knobs.min_p:
        floor = cuts.min_p[:, 0] * probs[:, 0]
        threshold = floor if threshold is None else torch.maximum(threshold, floor)
    return threshold


def draw(found: Candidates, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF over its kept tokens, the candidates first, at
    `uniform` [rows] (float64, in [0, 1))."""
    # the kept ones come first: up to the last of them, the cdf of every candidate is
    # theirs (float64: float32 sums lose the rare tokens' shares)
    last_kept = found.keep.sum(dim=-1, keepdim=True) - 1
    cdf = found.probs.cumsum(dim=-1, dtype=torch.float64)
    inside = cdf.gather(1, last_kept)  # the kept mass
    every_cut = bool(found.cut.all())
    uncut = ~found.cut[:, None]
    # a row with a cut: u x its kept mass, which lies strictly below that mass; an
    # uncut row: u x the whole vocabulary's, past the candidates' for some draws
    target = uniform[:, None] * (inside if every_cut else torch.where(uncut, 1.0, inside))
    # at most the last kept candidate: u x mass may round up to the mass itself, and
    # an uncut row's draw past them is taken below
    position = torch.minimum(torch.searchsorted(cdf, target, right=True), last_kept)
    chosen = found.ids.gather(1, position)[:, 0]
    if every_cut:
        return chosen
    beyond = (target >= inside)[:, 0] & uncut[:, 0]
    if bool(beyond.any()):
        rows = beyond.nonzero()[:, 0]
        tail = _draw_tail(found.every[rows], found.ids[rows], target[rows] - inside[rows])
        # no mass left past the candidates (all of the vocabulary, or underflow): the
        # last candidate with any
        last = (found.probs[rows] > 0).sum(dim=-1) - 1
        fallback = found.ids[rows].gather(1, last[:, None])[:, 0]
        chosen[rows] = torch.where(tail >= 0, tail, fallback)
    return chosen


def _draw_tail(probs: torch.Tensor, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Uncut rows whose draw lies past their candidates `ids`: the token at `target`
    [rows, 1] of the mass of the others (`probs` [rows, vocab], a copy), in vocabulary
    order (-1 where they have none)."""
    cdf = probs.scatter_(1, ids, 0.0).double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the tail's mass, so the first cdf above it is a token with some
    below = total.nextafter(torch.zeros_like(total))
    position = torch.searchsorted(cdf, torch.minimum(target, below), right=True)
    return torch.where(total[:, 0] > 0, position[:, 0], -1)


def step_top_logprobs(logprobs: torch.Tensor, seqs: list[Sequence]) -> list[TopLogprobs]:
    """Per row, its `logprobs` most likely (token id, logprob) of the raw distribution."""
    wanted = [seq.params.logprobs or 0 for seq in seqs]
    widest = max(wanted, default=0)
    out: list[TopLogprobs] = [()] * len(seqs)
    if not widest:
        return out
    rows = [row for row, k in enumerate(wanted) if k]
    index = torch.tensor(rows, device=logprobs.device)
    for row, top in zip(rows, top_logprobs(logprobs.index_select(0, index), widest), strict=True):
        out[row] = top[: wanted[row]]
    return out


def top_logprobs(logprobs: torch.Tensor, k: int) -> list[TopLogprobs]:
    """The k most likely (token id, logprob) of each row of `logprobs`, best first."""
    values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return [
        tuple(zip(i, v, strict=True)) for i, v in zip(ids.tolist(), values.tolist(), strict=True)
    ]


def gather_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> list[PromptLogprob]:
    """For a sequence that asked for its prompt's log-probabilities: `logits` [n, vocab]
    at prompt positions start .. start + n - 1, each predicting the prompt token after
    it, as one entry per position (`StepPlan.advance` adds them to the sequence)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    following = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    targets = torch.tensor(following, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k = seq.params.prompt_logprobs or 0
    tops = top_logprobs(logprobs, k) if k else [()] * len(following)
    return [
        PromptLogprob(token, logprob, top)
        for token, logprob, top in zip(following, chosen, tops, strict=True)
    ]
