"""The batched sampler against a per-row reference written here the plain way (one row,
one token at a time, as transformers' logits processors and OpenAI's penalty formula
read), over mixed batches: plain greedy rows beside rows with every processor.

Logits are drawn from a continuous distribution (no ties but underflowed zeros); a
token whose place in a top_p or min_p cut is within float32 rounding of the cut's
edge may land on either side, and is left out of the comparison.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from unittest import mock

import pytest
import torch
from batchpilot_server.engine import sampling
from batchpilot_server.engine.sampling import Knobs, Sampler, candidates, make_generator
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import SamplingParams
from hypothesis import given, settings
from hypothesis import strategies as st

VOCAB = 48
EOS = 3
# bounded so that the module runs in seconds on the shared 2-core machine
EXAMPLES = settings(max_examples=30, deadline=None)
FEW = settings(max_examples=12, deadline=None)  # each example runs several steps
# how near a token's mass above it may lie to top_p (or its probability to min_p's floor)
# for the two sides to disagree on it: float32 sums of a few dozen probabilities
EDGE = 1e-5


def sequence(
    params: SamplingParams, prompt: list[int], output: list[int] | None = None
) -> Sequence:
    seq = Sequence("r", list(prompt), params, 0.0, None, make_generator(params, "cpu"))
    seq.token_ids += output or []
    return seq


# ---- strategies ---------------------------------------------------------------------

tokens = st.integers(0, VOCAB - 1)


@st.composite
def row_params(draw: st.DrawFn) -> SamplingParams:
    """A plain greedy row, or one with a random mix of every processor."""
    if draw(st.booleans()):
        return SamplingParams(max_tokens=16)

    def maybe(default: object, strategy: st.SearchStrategy) -> object:
        return draw(st.one_of(st.just(default), strategy))

    sampled = draw(st.booleans())
    return SamplingParams(
        max_tokens=16,
        temperature=draw(st.floats(0.2, 2.0)) if sampled else 0.0,
        seed=draw(st.integers(0, 2**32)),
        top_k=maybe(0, st.integers(1, VOCAB)),
        top_p=maybe(1.0, st.floats(0.0, 1.0)),
        min_p=maybe(0.0, st.floats(0.0, 1.0)),
        repetition_penalty=maybe(1.0, st.floats(0.1, 3.0)),
        frequency_penalty=maybe(0.0, st.floats(-2.0, 2.0)),
        presence_penalty=maybe(0.0, st.floats(-2.0, 2.0)),
        logit_bias=tuple(draw(st.dictionaries(tokens, st.floats(-100, 100), max_size=4)).items()),
        min_tokens=maybe(0, st.integers(1, 6)),
        stop_token_ids=tuple(draw(st.sets(tokens, max_size=3))),
        ignore_eos=draw(st.booleans()),
    )


@st.composite
def rows(draw: st.DrawFn) -> list[Sequence]:
    count = draw(st.integers(1, 8))
    return [
        sequence(
            draw(row_params()),
            draw(st.lists(tokens, min_size=1, max_size=12)),
            draw(st.lists(tokens, max_size=8)),
        )
        for _ in range(count)
    ]


def random_logits(seed: int, rows: int, scale: float = 4.0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


# ---- the per-row reference ----------------------------------------------------------


def reference_logits(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """min_tokens, logit_bias, repetition, frequency and presence on one row."""
    p, x = seq.params, logits.clone()
    output = seq.token_ids[seq.num_prompt :]
    if len(output) < p.min_tokens:
        for token in (*p.stop_token_ids, *(() if p.ignore_eos else (EOS,))):
            x[token] = -torch.inf
    for token, bias in p.logit_bias:
        x[token] += bias
    for token in set(seq.token_ids):
        x[token] = (
            x[token] * p.repetition_penalty if x[token] < 0 else x[token] / p.repetition_penalty
        )
    for token, count in Counter(output).items():
        x[token] -= count * p.frequency_penalty + p.presence_penalty
    return x


def reference_keep(logits: torch.Tensor, p: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """The tokens temperature, top_k, top_p and min_p keep on one row (transformers'
    order: each on the distribution the one before left), and those at a cut's edge."""
    probs = torch.softmax(logits / p.temperature, dim=-1)
    keep = torch.ones(VOCAB, dtype=torch.bool)
    edge = torch.zeros(VOCAB, dtype=torch.bool)
    if p.top_k:
        keep &= probs >= probs.topk(p.top_k).values[-1]
    if p.top_p < 1.0:
        renormalized = torch.where(keep, probs, 0.0) / torch.where(keep, probs, 0.0).sum()
        ordered, order = renormalized.sort(descending=True)
        above = torch.zeros(VOCAB)
        above[order] = ordered.cumsum(0) - ordered  # mass of the tokens more probable
        inside = above < p.top_p
        inside[order[0]] = True
        edge |= keep & ((above - p.top_p).abs() < EDGE)
        keep &= inside
    if p.min_p > 0:
        floor = p.min_p * probs.max()
        edge |= (probs - floor).abs() < EDGE * probs.max()
        keep &= probs >= floor
    return keep, edge


def sampled_rows(seqs: list[Sequence]) -> list[Sequence]:
    return [seq for seq in seqs if seq.sampled]


# ---- properties ---------------------------------------------------------------------


@EXAMPLES
@given(rows(), st.integers(0, 2**32))
def test_batched_processors_equal_the_per_row_reference(seqs: list[Sequence], seed: int) -> None:
    logits = random_logits(seed, len(seqs))
    batched = logits.clone()
    Sampler(VOCAB, frozenset({EOS}), "cpu").process(batched, seqs, Knobs.of(seqs, "cpu"))
    for row, seq in enumerate(seqs):
        expected = reference_logits(logits[row], seq)
        torch.testing.assert_close(batched[row], expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("width", [4, sampling.CANDIDATES])
@EXAMPLES
@given(rows(), st.integers(0, 2**32))
def test_top_k_top_p_min_p_keep_what_the_reference_keeps(
    width: int, seqs: list[Sequence], seed: int
) -> None:
    """Also with a first search of 4 candidates, which every deep cut widens."""
    seqs = sampled_rows(seqs)
    if not seqs:
        return
    logits = random_logits(seed, len(seqs))
    scaled = logits / torch.tensor([[seq.params.temperature] for seq in seqs])
    knobs = Knobs.of(seqs, "cpu")
    with mock.patch.object(sampling, "CANDIDATES", width):
        found = candidates(scaled, knobs.table, knobs)
    for row, seq in enumerate(seqs):
        keep, edge = reference_keep(logits[row], seq.params)
        full = torch.softmax(scaled[row], dim=-1)
        ids = found.ids[row]
        torch.testing.assert_close(found.probs[row], full[ids], rtol=1e-5, atol=1e-7)
        if found.cut[row]:
            ours = torch.zeros(VOCAB, dtype=torch.bool)
            ours[ids[found.keep[row]]] = True
        else:
            ours = torch.ones(VOCAB, dtype=torch.bool)
        assert ((ours == keep) | edge).all(), f"row {row}: {seq.params}"


@EXAMPLES
@given(rows(), st.integers(0, 2**32))
def test_a_step_picks_the_greedy_argmax_and_draws_inside_the_kept_set(
    seqs: list[Sequence], seed: int
) -> None:
    logits = random_logits(seed, len(seqs))
    sampled = Sampler(VOCAB, frozenset({EOS}), "cpu").sample(logits.clone(), seqs)
    raw = torch.log_softmax(logits, dim=-1)
    for row, seq in enumerate(seqs):
        token = sampled.tokens[row]
        assert sampled.logprobs[row] == raw[row, token].item()
        processed = reference_logits(logits[row], seq)
        if not seq.sampled:
            assert token == int(processed.argmax())
        else:
            keep, edge = reference_keep(processed, seq.params)
            assert keep[token] or edge[token]


@EXAMPLES
@given(st.integers(0, 2**32), st.integers(1, 6))
def test_plain_greedy_rows_are_the_argmax_of_the_raw_logprobs(seed: int, count: int) -> None:
    """The fast path, bit for bit, beside rows that sample."""
    seqs = [
        sequence(SamplingParams(max_tokens=4, temperature=0.9 * (row % 2), seed=row), [1, 2])
        for row in range(count)
    ]
    logits = random_logits(seed, count)
    sampled = Sampler(VOCAB, frozenset({EOS}), "cpu").sample(logits.clone(), seqs)
    raw = torch.log_softmax(logits, dim=-1)
    for row in range(0, count, 2):
        assert sampled.tokens[row] == int(raw[row].argmax())
        assert sampled.logprobs[row] == raw[row].max().item()


@FEW
@given(st.lists(row_params(), min_size=1, max_size=6), st.integers(0, 2**32), st.integers(0, 5))
def test_a_seeded_row_draws_the_same_tokens_whatever_shares_its_steps(
    neighbours: list[SamplingParams], seed: int, place: int
) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, top_k=30, seed=seed)
    place = min(place, len(neighbours))

    def tokens_of_seeded_row(others: list[SamplingParams], at: int) -> list[int]:
        batch = [sequence(p, [1, 2, 3]) for p in others]
        batch.insert(at, sequence(params, [1, 2, 3]))
        sampler = Sampler(VOCAB, frozenset({EOS}), "cpu")
        drawn = []
        for step in range(6):
            logits = random_logits(step, len(batch), scale=1.0)
            logits[at] = random_logits(100 + step, 1, scale=1.0)[0]  # its own, wherever it sits
            out = sampler.sample(logits, batch)
            drawn.append(out.tokens[at])
        return drawn

    alone = tokens_of_seeded_row([], 0)
    assert tokens_of_seeded_row(neighbours, place) == alone
    assert len(set(alone)) > 1  # it did sample


@pytest.mark.parametrize("top_k", [0, 3])
def test_draws_follow_the_distribution(top_k: int) -> None:
    """20,000 seeded draws from a fixed distribution land within 1.5 points of it (of
    its top 3, renormalized, with top_k 3): through the two candidates searched first
    and, for the draws past them, the rest of the vocabulary."""
    probs = torch.tensor([0.3, 0.05, 0.0, 0.25, 0.1, 0.15, 0.0, 0.1, 0.05])
    draws = 20_000
    scaled = probs.log().repeat(draws, 1)
    knobs = Knobs.of(
        [sequence(SamplingParams(max_tokens=1, temperature=1.0, top_k=top_k), [1])] * draws, "cpu"
    )
    uniform = torch.rand(draws, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with mock.patch.object(sampling, "CANDIDATES", 2):
        drawn = sampling.draw(candidates(scaled, knobs.table, knobs), uniform)
    shares = torch.bincount(drawn, minlength=len(probs)) / draws
    expected = probs if not top_k else torch.where(probs >= 0.15, probs, 0.0) / 0.7
    assert shares[expected == 0].sum() == 0
    torch.testing.assert_close(shares, expected, rtol=0, atol=0.015)


@EXAMPLES
@given(st.integers(1, 8), st.booleans(), st.integers(0, 2**32), st.sets(tokens, max_size=3))
def test_min_tokens_never_ends_early(
    min_tokens: int, sampled: bool, seed: int, stops: set[int]
) -> None:
    """EOS and every stop token the most likely by far, yet none comes before min_tokens."""
    params = SamplingParams(
        max_tokens=16,
        min_tokens=min_tokens,
        temperature=1.0 if sampled else 0.0,
        seed=seed,
        stop_token_ids=tuple(stops),
    )
    seq = sequence(params, [1, 2])
    sampler = Sampler(VOCAB, frozenset({EOS}), "cpu")
    ended = {EOS, *stops}
    for step in range(min_tokens + 1):
        logits = random_logits(seed + step, 1)
        logits[0, list(ended)] = 30.0
        token = sampler.sample(logits, [seq]).tokens[0]
        if step < min_tokens:
            assert token not in ended, f"token {step} is {token}, min_tokens {min_tokens}"
        else:
            assert token in ended  # held back no longer
        seq.token_ids.append(token)


@EXAMPLES
@given(rows(), st.integers(0, 2**32), st.data())
def test_a_bias_of_100_forces_its_token(
    seqs: list[Sequence], seed: int, data: st.DataObject
) -> None:
    forced = [data.draw(tokens) for _ in seqs]
    seqs = [
        sequence(
            SamplingParams(
                max_tokens=4,
                temperature=min(seq.params.temperature, 1.0),
                seed=seq.params.seed,
                top_k=seq.params.top_k,
                top_p=seq.params.top_p,
                min_p=seq.params.min_p,
                logit_bias=((token, 100.0),),
            ),
            seq.prompt_ids,
        )
        for seq, token in zip(seqs, forced, strict=True)
    ]
    sampled = Sampler(VOCAB, frozenset({EOS}), "cpu").sample(random_logits(seed, len(seqs)), seqs)
    assert sampled.tokens == forced


@FEW
@given(st.lists(row_params(), min_size=12, max_size=12), st.integers(0, 2**32))
def test_penalty_counts_stay_right_as_sequences_come_and_go(
    arrivals: list[SamplingParams], seed: int
) -> None:
    """Eight steps of three penalized sequences, one finishing and one arriving at
    each: the incremental counts always give the reference's logits, and the
    finished sequences' pooled rows are reused (eleven sequences, eight rows)."""
    sampler = Sampler(VOCAB, frozenset({EOS}), "cpu")
    pending = [sequence(replace(p, repetition_penalty=1.5), [seed % VOCAB, 5]) for p in arrivals]
    running = pending[:3]
    del pending[:3]
    for step in range(8):
        logits = random_logits(seed + step, len(running))
        processed = logits.clone()
        sampler.process(processed, running, Knobs.of(running, "cpu"))
        for row, seq in enumerate(running):
            expected = reference_logits(logits[row], seq)
            torch.testing.assert_close(processed[row], expected, rtol=1e-6, atol=1e-6)
        for seq, token in zip(running, sampler.sample(logits.clone(), running).tokens, strict=True):
            seq.token_ids.append(token)
        running[0].finish()
        running = [*running[1:], pending.pop(0)]
    assert len(sampler.penalties.owners) == 8


def test_top_logprobs_are_the_raw_distributions_best() -> None:
    seqs = [
        sequence(SamplingParams(max_tokens=4, logprobs=k, temperature=0.7, seed=k), [1])
        for k in (None, 0, 1, 5)
    ]
    logits = random_logits(7, len(seqs))
    sampled = Sampler(VOCAB, frozenset({EOS}), "cpu").sample(logits.clone(), seqs)
    raw = torch.log_softmax(logits, dim=-1)
    assert sampled.top_logprobs[:2] == [(), ()]
    for row, k in ((2, 1), (3, 5)):
        values, ids = raw[row].topk(k)
        assert sampled.top_logprobs[row] == tuple(zip(ids.tolist(), values.tolist(), strict=True))
