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

from collections.abc import Sequence as Rows
from dataclasses import dataclass

import torch
from batchpilot_server.engine_api import GREEDY_BELOW_TEMPERATURE, PromptLogprob, SamplingParams
from batchpilot_server.sequence import Sequence, Status, TopLogprobs
from batchpilot_server.structured_output import mask_logits

# top_k and top_p cut among this many most probable tokens first (torch.topk, far
# cheaper than sorting a 50k-100k vocabulary per row); a row whose top_p mass lies
# deeper widens the search, up to the whole vocabulary, so the result is exact
CANDIDATES = 256


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

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """One token per row of `logits` [len(seqs), vocab]."""
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = logprobs.argmax(dim=-1)
        rows = [row for row, seq in enumerate(seqs) if seq.always_processed or seq.holds_stops]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            subset = [seqs[row] for row in rows]
            chosen.index_copy_(0, index, self._processed(logits.index_select(0, index), subset))
        picked = logprobs.gather(1, chosen[:, None])[:, 0]
        return Sampled(chosen.tolist(), picked.tolist(), step_top_logprobs(logprobs, seqs))

    def _processed(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Tokens of the rows (a copy of their logits) that take more than an argmax."""
        self.process(logits, seqs)
        chosen = self.choose(logits, seqs)
        self.penalties.record(seqs, chosen)
        accept_grammar_tokens(seqs, chosen)
        return chosen

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Steps 1-3 of the module docstring on `logits` [len(seqs), vocab], in place."""
        self._hold_stops(logits, seqs)
        add_logit_bias(logits, [seq.params for seq in seqs])
        penalized = [row for row, seq in enumerate(seqs) if seq.penalized]
        if penalized:
            subset = [seqs[row] for row in penalized]
            self.penalties.apply(logits, penalized, subset)
        constrained = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
        if constrained:
            mask_logits(logits, constrained, [seqs[row] for row in constrained])

    @staticmethod
    def choose(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Step 4: the argmax of a greedy row, a draw for a sampled one."""
        chosen = logits.argmax(dim=-1)
        sampled = [row for row, seq in enumerate(seqs) if seq.sampled]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            probs = sampling_probs(logits.index_select(0, index), [seqs[r].params for r in sampled])
            generators = [seqs[row].generator for row in sampled]
            chosen.index_copy_(0, index, draw(probs, generators))  # type: ignore[arg-type]
        return chosen

    def _hold_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """min_tokens: the stops of the rows that have not reached it at -inf."""
        held = [
            (row, token)
            for row, seq in enumerate(seqs)
            if seq.holds_stops
            for token in self._stops(seq.params)
        ]
        if held:
            rows, tokens = torch.tensor(held, device=logits.device).T
            logits.index_put_((rows, tokens), torch.tensor(-torch.inf, device=logits.device))

    def _stops(self, params: SamplingParams) -> tuple[int, ...]:
        return params.stop_token_ids if params.ignore_eos else params.stop_token_ids + self.eos


def accept_grammar_tokens(seqs: list[Sequence], tokens: torch.Tensor) -> None:
    """Each grammar row's matcher advanced with the token it just chose."""
    if any(seq.grammar is not None for seq in seqs):
        for seq, token in zip(seqs, tokens.tolist(), strict=True):
            if seq.grammar is not None:
                seq.grammar.accept(token)


def add_logit_bias(logits: torch.Tensor, params: Rows[SamplingParams]) -> None:
    """Each row's logit_bias added to its logits, in place."""
    bias = [(row, token, value) for row, p in enumerate(params) for token, value in p.logit_bias]
    if bias:
        rows, tokens, values = zip(*bias, strict=True)
        device = logits.device
        logits.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(tokens, device=device)),
            torch.tensor(values, dtype=logits.dtype, device=device),
            accumulate=True,  # a token listed twice gets both (the API refuses duplicates)
        )


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    seen: torch.Tensor,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """`logits` [rows, vocab] with the penalties applied: `counts` of each token in the
    output, `seen` where it is in the prompt or the output; one weight per row. A
    weight that changes nothing (1, 0, 0) leaves the row's logits bit for bit."""
    rep = repetition[:, None]
    repeated = torch.where(seen, torch.where(logits < 0, logits * rep, logits / rep), logits)
    return repeated - (counts * frequency[:, None] + (counts > 0) * presence[:, None])


def sampling_probs(logits: torch.Tensor, params: Rows[SamplingParams]) -> torch.Tensor:
    """The distribution each sampled row draws from: softmax(logits / temperature) with
    the tokens top_k, top_p and min_p drop set to 0 (not renormalized: the draw scales
    by the row's total)."""
    device = logits.device
    knobs = torch.tensor(
        [(p.temperature, p.top_p, p.min_p) for p in params], dtype=logits.dtype, device=device
    ).T
    temperature, top_p, min_p = knobs
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    threshold = None
    peak = None
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        vocab = probs.shape[-1]
        top_k = torch.tensor([p.top_k or vocab for p in params], device=device)
        # top_p = 1 keeps every token: float rounding must not cut a tail at 1.0
        top_p = torch.where(top_p < 1.0, top_p, torch.inf)
        threshold, peak = nucleus_cutoff(probs, top_k, top_p, max(p.top_k for p in params))
    if any(p.min_p > 0 for p in params):
        peak = probs.amax(dim=-1) if peak is None else peak
        floor = min_p * peak
        threshold = floor if threshold is None else torch.maximum(threshold, floor)
    if threshold is not None:
        probs = probs.masked_fill(probs < threshold[:, None], 0.0)
    return probs


def nucleus_cutoff(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, widest_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the least probability top_k and top_p keep (0: no cut), and the top
    probability. `top_k`: the vocabulary's size where unset; `top_p`: inf where unset.
    top_p's mass is the top_k tokens' (renormalized), as transformers applies it."""
    vocab = probs.shape[-1]
    cuts = (top_k < vocab) | (top_p <= 1.0)
    width = min(vocab, max(CANDIDATES, widest_k))
    while True:
        top = probs.topk(width, dim=-1).values  # most probable first
        in_k = torch.arange(width, device=probs.device) < top_k[:, None]
        kept = top * in_k
        mass = torch.where(top_k < vocab, kept.sum(dim=-1), 1.0)
        before = (kept.cumsum(dim=-1) - kept) / mass[:, None]  # mass above each token
        keep = in_k & (before < top_p[:, None])
        keep[:, 0] = True  # the top token always: a top_p that rounds to 0 keeps one
        # exact where the kept prefix ends inside the candidates
        settled = ~cuts | (top_k <= width) | ~keep[:, -1]
        if width == vocab or bool(settled.all()):
            break
        width = min(vocab, width * 8)
    last = keep.sum(dim=-1, keepdim=True) - 1
    cutoff = torch.where(cuts, top.gather(1, last)[:, 0], 0.0)
    return cutoff, top[:, 0]


def draw(probs: torch.Tensor, generators: Rows[torch.Generator]) -> torch.Tensor:
    """One token per row of `probs` [rows, vocab] (unnormalized, >= 0), by inverse CDF
    with one uniform from each row's generator."""
    device = probs.device
    uniform = torch.stack([torch.rand((), generator=g, device=device) for g in generators])
    # float64: float32 sums of a large vocabulary lose the rare tokens' shares
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    # strictly below the total, so the first cdf above it is a token of non-zero mass
    target = torch.minimum(uniform[:, None] * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True)[:, 0]


class PenaltyState:
    """Token counts of the penalized sequences, one row each (`Sequence.penalty_slot`)
    of two pooled tensors: `counts` of each token in the output (frequency and
    presence) and `seen` (prompt or output: repetition). A row is filled once, when
    its sequence first samples; each step then adds the sampled tokens in one batched
    scatter. A finished sequence's row is reused; the pool doubles when full."""

    def __init__(self, vocab_size: int, device: str) -> None:
        self.counts = torch.zeros(0, vocab_size, device=device)
        self.seen = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self.owners: list[Sequence | None] = []

    def slots(self, seqs: list[Sequence]) -> torch.Tensor:
        """The rows of `seqs`, each assigned and filled on first sight."""
        for seq in seqs:
            if seq.penalty_slot is None:
                self._assign(seq)
        return torch.tensor([seq.penalty_slot for seq in seqs], device=self.counts.device)

    def apply(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
        """The penalties of `seqs`, rows `rows` of `logits`, in place."""
        device = logits.device
        weights = torch.tensor(
            [
                (s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty)
                for s in seqs
            ],
            dtype=logits.dtype,
            device=device,
        ).T
        slots = self.slots(seqs)
        counts, seen = self.counts.index_select(0, slots), self.seen.index_select(0, slots)
        if len(rows) == logits.shape[0]:
            logits.copy_(apply_penalties(logits, counts, seen, *weights))
        else:
            index = torch.tensor(rows, device=device)
            part = logits.index_select(0, index)
            logits.index_copy_(0, index, apply_penalties(part, counts, seen, *weights))

    def record(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """The tokens just sampled for `seqs` (one per row) counted, for the penalized ones."""
        rows = [row for row, seq in enumerate(seqs) if seq.penalized]
        if not rows:
            return
        slots = self.slots([seqs[row] for row in rows])
        tokens = tokens[rows]
        self.counts.index_put_(
            (slots, tokens), torch.ones_like(tokens, dtype=self.counts.dtype), accumulate=True
        )
        self.seen[slots, tokens] = True

    def _assign(self, seq: Sequence) -> None:
        slot = self._free_slot()
        seq.penalty_slot, self.owners[slot] = slot, seq
        device = self.counts.device
        self.counts[slot] = 0.0
        self.seen[slot] = False
        self.seen[slot, torch.tensor(seq.token_ids, device=device)] = True
        # the output so far (none when a sequence first samples in the engine)
        output = torch.tensor(seq.token_ids[seq.num_prompt :], dtype=torch.int64, device=device)
        self.counts[slot].index_add_(0, output, torch.ones_like(output, dtype=self.counts.dtype))

    def _free_slot(self) -> int:
        for slot, owner in enumerate(self.owners):
            if owner is None or owner.status is Status.FINISHED:
                if owner is not None:
                    owner.penalty_slot = None
                return slot
        slot = len(self.owners)
        grown = max(8, 2 * slot)
        self.counts = torch.cat(
            [self.counts, self.counts.new_zeros(grown - slot, self.counts.shape[1])]
        )
        self.seen = torch.cat([self.seen, self.seen.new_zeros(grown - slot, self.seen.shape[1])])
        self.owners += [None] * (grown - slot)
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
