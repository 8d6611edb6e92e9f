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
   bitmask for the step's grammar rows (structured_output.mask_logits), EOS among
   them until the grammar is complete; the chosen token then advances the matcher;
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
from batchpilot_server.engine_api import GREEDY_BELOW_TEMPERATURE, PromptLogprob, SamplingParams
from batchpilot_server.sequence import Sequence, Status, TopLogprobs
from batchpilot_server.structured_output import mask_logits

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

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """One token per row of `logits` [len(seqs), vocab], which it processes in place
        once the raw log-probabilities are taken (the engine's logits are scratch)."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.argmax(dim=-1)
        if any(seq.always_processed or seq.holds_stops for seq in seqs):
            knobs = Knobs.of(seqs, logits.device)
            self.process(logits, seqs, knobs)
            self.choose(logits, knobs, chosen)
            self.penalties.record(seqs, chosen)
            accept_grammar_tokens(seqs, chosen)
        picked_logprobs = logprobs.gather(1, chosen[:, None])[:, 0]
        return Sampled(chosen.tolist(), picked_logprobs.tolist(), step_top_logprobs(logprobs, seqs))

    @torch.inference_mode()
    def process(self, logits: torch.Tensor, seqs: list[Sequence], knobs: Knobs) -> None:
        """Steps 1-3 of the module docstring on `logits` [len(seqs), vocab], in place."""
        self._add_sparse(logits, seqs)
        if knobs.penalized:
            penalized = [seqs[row] for row in knobs.penalized]
            weights = knobs.rows(knobs.penalized)[:, REPETITION:].T
            self.penalties.apply(logits, knobs.penalized, penalized, weights)
        constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        if constrained:
            mask_logits(logits, constrained, [seqs[row] for row in constrained])

    @staticmethod
    @torch.inference_mode()
    def choose(logits: torch.Tensor, knobs: Knobs, chosen: torch.Tensor) -> None:
        """Step 4 into `chosen` [rows]: the argmax of a processed greedy row, a draw for
        a sampled one (other rows keep theirs); the sampled rows' logits are divided
        by their temperature in place."""
        device, rows = logits.device, logits.shape[0]
        if len(knobs.greedy) == rows:
            chosen.copy_(logits.argmax(dim=-1))
        elif knobs.greedy:
            index = torch.tensor(knobs.greedy, device=device)
            chosen.index_copy_(0, index, logits.index_select(0, index).argmax(dim=-1))
        if knobs.sampled:
            everyone = len(knobs.sampled) == rows
            index = torch.tensor(knobs.sampled, device=device)
            scaled = logits if everyone else logits.index_select(0, index)
            table = knobs.rows(knobs.sampled)
            scaled.div_(table[:, TEMPERATURE, None])
            uniform = knobs.uniform if everyone else knobs.uniform.index_select(0, index)
            chosen.index_copy_(0, index, draw(candidates(scaled, table, knobs), uniform))

    def _add_sparse(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """min_tokens (the stops of the rows short of it at -inf) and logit_bias, in one
        scatter: -inf plus a bias stays -inf."""
        entries = [
            (row, token, -torch.inf)
            for row, seq in enumerate(seqs)
            if seq.holds_stops
            for token in self._stops(seq.params)
        ]
        entries += [
            (row, token, bias)
            for row, seq in enumerate(seqs)
            for token, bias in seq.params.logit_bias
        ]
        if entries:
            rows, tokens, values = zip(*entries, strict=True)
            device = logits.device
            logits.index_put_(
                (torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
                torch.tensor(values, dtype=logits.dtype, device=device),
                accumulate=True,  # a token listed twice gets both (the API refuses duplicates)
            )

    def _stops(self, params: SamplingParams) -> tuple[int, ...]:
        return params.stop_token_ids if params.ignore_eos else params.stop_token_ids + self.eos


def accept_grammar_tokens(seqs: list[Sequence], tokens: torch.Tensor) -> None:
    """Each grammar row's matcher advanced with the token it just chose."""
    if any(seq.grammar is not None for seq in seqs):
        for seq, token in zip(seqs, tokens.tolist(), strict=True):
            if seq.grammar is not None:
                seq.grammar.accept(token)


# the columns of Knobs.table
TEMPERATURE, TOP_P, MIN_P, TOP_K, REPETITION = 0, 1, 2, 3, 4
# uniforms a sampled sequence's generator draws at a time (one a token)
UNIFORMS_AHEAD = 64


@dataclass(frozen=True)
class Knobs:
    """The sampling values of a step's rows, in one tensor built at once:
    `table` [rows, 7] of temperature, top_p (inf where 1: no cut, so that rounding
    never cuts a tail), min_p, top_k (the vocabulary where unset), repetition,
    frequency and presence penalties; `uniform` [rows]: this step's uniform draw of
    each sampled row (float64); which rows sample and which are penalized; and which
    cuts any row makes, so that a step skips the stages nobody uses."""

    table: torch.Tensor
    uniform: torch.Tensor
    sampled: list[int]
    greedy: list[int]  # greedy rows whose logits the processors change
    penalized: list[int]
    top_k: bool
    top_p: bool
    min_p: bool
    widest_k: int  # the largest top_k set

    @classmethod
    def of(cls, seqs: list[Sequence], device: torch.device | str) -> Knobs:
        params = [seq.params for seq in seqs]
        table = torch.tensor(
            [
                (
                    p.temperature,
                    p.top_p if p.top_p < 1.0 else torch.inf,
                    p.min_p,
                    p.top_k or torch.inf,
                    p.repetition_penalty,
                    p.frequency_penalty,
                    p.presence_penalty,
                )
                for p in params
            ],
            device=device,
        )
        sampled = [row for row, seq in enumerate(seqs) if seq.sampled]
        greedy = [
            row
            for row, seq in enumerate(seqs)
            if not seq.sampled and (seq.always_processed or seq.holds_stops)
        ]
        cutting = [params[row] for row in sampled]
        return cls(
            table=table,
            uniform=torch.tensor(
                [next_uniform(seq) if seq.sampled else 0.0 for seq in seqs],
                dtype=torch.float64,
                device=device,
            ),
            sampled=sampled,
            greedy=greedy,
            penalized=[row for row, seq in enumerate(seqs) if seq.penalized],
            top_k=any(p.top_k for p in cutting),
            top_p=any(p.top_p < 1.0 for p in cutting),
            min_p=any(p.min_p > 0 for p in cutting),
            widest_k=max((p.top_k for p in cutting), default=0),
        )

    def rows(self, rows: list[int]) -> torch.Tensor:
        """The table's `rows` (itself when they are all of it)."""
        if len(rows) == self.table.shape[0]:
            return self.table
        return self.table.index_select(0, torch.tensor(rows, device=self.table.device))


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


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """`logits` of tokens seen in the prompt or the output, with the penalties applied:
    `counts` of each in the output; one weight per row. A weight that changes nothing
    (1, 0, 0) leaves a logit bit for bit."""
    rep = repetition[:, None]
    repeated = torch.where(logits < 0, logits * rep, logits / rep)
    return repeated - (counts * frequency[:, None] + (counts > 0) * presence[:, None])


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
    vocab = scaled.shape[-1]
    every = torch.softmax(scaled, dim=-1)
    # one past the largest top_k: a row cut there settles at once
    width = min(vocab, max(CANDIDATES, knobs.widest_k + 1))
    while True:
        probs, ids = every.topk(width, dim=-1)
        threshold = cut_threshold(probs, table, knobs)
        if threshold is None:  # no row cuts: every token stays
            keep = torch.ones_like(probs, dtype=torch.bool)
            return Candidates(ids, probs, keep, torch.zeros_like(keep[:, 0]), every)
        keep = probs >= threshold[:, None]
        # settled where the kept tokens end inside the candidates (ties included)
        if width == vocab or bool(((threshold == 0) | ~keep[:, -1]).all()):
            return Candidates(ids, probs, keep, threshold > 0, every)
        width = min(vocab, width * 8)


def cut_threshold(probs: torch.Tensor, table: torch.Tensor, knobs: Knobs) -> torch.Tensor | None:
    """Per row, the least probability its cuts keep (0: no cut; None: no row cuts),
    from its most probable tokens `probs` [rows, width], best first. top_p's mass is
    the top_k tokens' (renormalized), as transformers applies it; min_p is a share of
    the top token's probability."""
    threshold = None
    if knobs.top_k or knobs.top_p:
        top_k, top_p = table[:, TOP_K, None], table[:, TOP_P, None]
        in_k = torch.arange(probs.shape[-1], device=probs.device) < top_k
        inside = in_k
        if knobs.top_p:
            kept = probs * in_k if knobs.top_k else probs
            before = kept.cumsum(dim=-1) - kept  # mass above each token
            if knobs.top_k:  # renormalized to the top_k tokens' mass (where set)
                before /= torch.where(top_k < torch.inf, kept.sum(dim=-1, keepdim=True), 1.0)
            inside = in_k & (before < top_p)
            inside[:, 0] = True  # the top token always: a top_p that rounds to 0 keeps one
        last = inside.sum(dim=-1, keepdim=True) - 1
        cutting = (top_k < torch.inf) | (top_p < torch.inf)
        threshold = torch.where(cutting, probs.gather(1, last), 0.0)[:, 0]
    if knobs.min_p:
        floor = table[:, MIN_P] * probs[:, 0]
        threshold = floor if threshold is None else torch.maximum(threshold, floor)
    return threshold


def draw(found: Candidates, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row by inverse CDF over its kept tokens, the candidates first, at
    `uniform` [rows] (float64, in [0, 1))."""
    # float64: float32 sums lose the rare tokens' shares
    cdf = torch.where(found.keep, found.probs, 0.0).double().cumsum(dim=-1)
    inside = cdf[:, -1:]
    uncut = ~found.cut
    # a row with a cut: u x its kept mass, which lies strictly below that mass; an
    # uncut row: u x the whole vocabulary's, past the candidates' for some draws
    target = uniform[:, None] * torch.where(uncut[:, None], 1.0, inside)
    # at most the last kept candidate (the kept ones come first): u x mass may round
    # up to the mass itself, and an uncut row's draw past them is taken below
    last_kept = found.keep.sum(dim=-1, keepdim=True) - 1
    position = torch.minimum(torch.searchsorted(cdf, target, right=True), last_kept)
    chosen = found.ids.gather(1, position)[:, 0]
    beyond = (target[:, 0] >= inside[:, 0]) & uncut
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


class PenaltyState:
    """What the penalties read of each penalized sequence, one row of pooled tensors
    per sequence (`Sequence.penalty_slot`): its `tokens` (prompt and output, in order;
    the places past its length repeat its first token, so that reading a batch's
    widest row is harmless for the others) and `counts` [slot, vocab] of each token
    in its output. A row is filled once, when its sequence first samples. A step
    reads the counts only at the rows' tokens (a gather and a scatter of the logits
    there, never a pass over the vocabulary) and adds the sampled tokens with two
    batched scatters. A finished sequence's row is reused; the pool doubles when full."""

    def __init__(self, vocab_size: int, device: str) -> None:
        self.tokens = torch.zeros(0, 0, dtype=torch.int64, device=device)
        self.counts = torch.zeros(0, vocab_size, device=device)
        self.owners: list[Sequence | None] = []

    def slots(self, seqs: list[Sequence]) -> torch.Tensor:
        """The rows of `seqs`, each assigned and filled on first sight."""
        for seq in seqs:
            if seq.penalty_slot is None:
                self._assign(seq)
        return torch.tensor([seq.penalty_slot for seq in seqs], device=self.counts.device)

    def apply(
        self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence], weights: torch.Tensor
    ) -> None:
        """The penalties of `seqs`, rows `rows` of `logits`, in place; `weights` [3,
        len(rows)]: repetition, frequency and presence. A token seen twice is read and
        written twice, with the same value."""
        slots = self.slots(seqs)
        width = max(seq.num_tokens for seq in seqs)
        tokens = self.tokens.index_select(0, slots)[:, :width]
        counts = self.counts[slots[:, None], tokens]
        at = (torch.tensor(rows, device=logits.device)[:, None], tokens)
        logits.index_put_(at, apply_penalties(logits[at], counts, *weights))

    def record(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """The tokens just sampled for `seqs` (one per row, not appended yet), for the
        penalized ones."""
        rows = [row for row, seq in enumerate(seqs) if seq.penalized]
        if not rows:
            return
        penalized = [seqs[row] for row in rows]
        slots, tokens = self.slots(penalized), tokens[rows]
        places = torch.tensor([seq.num_tokens for seq in penalized], device=slots.device)
        self.tokens.index_put_((slots, places), tokens)
        self.counts.index_put_(
            (slots, tokens), torch.ones_like(tokens, dtype=self.counts.dtype), accumulate=True
        )

    def _assign(self, seq: Sequence) -> None:
        slot = self._free_slot()
        seq.penalty_slot, self.owners[slot] = slot, seq
        self._widen(seq.num_prompt + seq.params.max_tokens)  # the most it will hold
        device = self.counts.device
        held = torch.tensor(seq.token_ids, device=device)
        self.tokens[slot] = held[0]
        self.tokens[slot, : len(held)] = held
        self.counts[slot] = 0.0
        # the output so far (none when a sequence first samples in the engine)
        output = held[seq.num_prompt :]
        self.counts[slot].index_put_(
            (output,), torch.ones_like(output, dtype=self.counts.dtype), accumulate=True
        )

    def _widen(self, width: int) -> None:
        """Room for `width` tokens per row."""
        have, rows = self.tokens.shape[1], self.tokens.shape[0]
        if width > have:
            # the new places repeat each row's first token, as unused places do
            first = self.tokens[:, :1] if have else self.tokens.new_zeros(rows, 1)
            self.tokens = torch.cat([self.tokens, first.expand(rows, width - have)], 1)

    def _free_slot(self) -> int:
        for slot, owner in enumerate(self.owners):
            if owner is None or owner.status is Status.FINISHED:
                if owner is not None:
                    owner.penalty_slot = None
                return slot
        slot = len(self.owners)
        extra = max(8, slot)  # the pool doubles
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(extra, self.tokens.shape[1])])
        self.counts = torch.cat([self.counts, self.counts.new_zeros(extra, self.counts.shape[1])])
        self.owners += [None] * extra
        return slot


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


def gather_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
    """ModelRunner.prefill's hook for a sequence that asked for its prompt's
    log-probabilities: `logits` [n, vocab] at prompt positions start .. start + n - 1,
    each predicting the prompt token after it, appended to `seq.prompt_logprobs`."""
    if start == 0:  # a prefill that starts over (preempted mid-prompt) gathers anew
        seq.prompt_logprobs = []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    following = seq.prompt_ids[start + 1 : start + 1 + logits.shape[0]]
    targets = torch.tensor(following, device=logits.device)
    chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    k = seq.params.prompt_logprobs or 0
    tops = top_logprobs(logprobs, k) if k else [()] * len(following)
    seq.prompt_logprobs += [
        PromptLogprob(token, logprob, top)
        for token, logprob, top in zip(following, chosen, tops, strict=True)
    ]
