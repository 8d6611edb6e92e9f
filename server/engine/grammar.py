"""Grammar-constrained decoding, the engine's side: the compiled grammar a request
carries (`SamplingParams.grammar`), each sequence's matcher, and the sampler's mask.

The HTTP layer compiles a request's JSON schema (grammar_compiler.py) with xgrammar, the
grammar engine vLLM and SGLang use by default; here:

- each engine sequence gets its own matcher (`Grammar.start`), advanced with every
  token it samples;
- the sampler masks the step's grammar rows in one [rows, vocab] bitmask
  (`mask_logits`) before it chooses, and EOS stays masked until the grammar is
  complete, so a sequence that ends on EOS always holds a whole, valid document.

Small models may never close a document (a random-weights model writes digits
forever). Once a grammar row has `closing_reserve` tokens left of its max_tokens, it
is steered to an end: of the tokens its grammar allows, it takes the first of EOS,
`"`, `}`, `]`, `,`, `0` that is allowed (the model chooses only where none is), which
closes strings, numbers, arrays and objects in a few tokens each. A sequence that still
runs out of `max_tokens` ends with finish_reason "length" and a cut document, as
OpenAI and vLLM answer it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import xgrammar as xgr

if TYPE_CHECKING:
    from batchpilot_server.engine.sequence import Sequence

# the tokens a grammar row keeps for closing its document (module docstring)
# (a string's `"` first: inside one, `}` is text)
CLOSERS = (b'"', b"}", b"]", b",", b"0")
MIN_CLOSING_RESERVE = 24
MAX_CLOSING_RESERVE = 128

Observe = Callable[[float], None]


def closing_reserve(max_tokens: int) -> int:
    """Tokens left at which a grammar row is steered to close its document."""
    return min(MAX_CLOSING_RESERVE, max(MIN_CLOSING_RESERVE, max_tokens // 4))


@dataclass(frozen=True)
class Vocabulary:
    size: int  # the tokenizer's: logits may be padded wider
    closers: tuple[int, ...]  # EOS, then CLOSERS' single-token ids, in that order
    # never in a grammar's output: tokens holding a control byte (< 0x20; valid JSON
    # holds none raw, with no free whitespace, yet xgrammar's bounded strings let them
    # through) and tokens that are not whole UTF-8 on their own (xgrammar takes bytes
    # of a character one by one, so lone or stray bytes would make the text invalid
    # UTF-8 and miscount maxLength): a character is written by a token holding it whole
    forbidden: torch.Tensor


class GrammarState:
    """One sequence's matcher: where its output stands in the grammar."""

    def __init__(self, matcher: xgr.GrammarMatcher, vocab: Vocabulary, observe: Observe) -> None:
        self.matcher = matcher
        self.vocab = vocab
        self.observe = observe  # batchpilot_structured_output_seconds{phase="mask"}

    def accept(self, token_id: int) -> None:
        # the token came out of this matcher's own mask: it is always accepted
        self.matcher.accept_token(token_id)


class Grammar:
    """A compiled grammar: SamplingParams.grammar; each sequence `start`s its own state."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab: Vocabulary, observe: Observe):
        self._compiled = compiled
        self._vocab = vocab
        self._observe = observe

    def start(self) -> GrammarState:
        return GrammarState(xgr.GrammarMatcher(self._compiled), self._vocab, self._observe)


_BATCH = xgr.BatchGrammarMatcher(max_threads=1)


def mask_logits(logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> None:
    """Rows `rows` of `logits` [batch, vocab] (of `seqs`) with every token their grammar
    forbids at -inf, in place: one bitmask for all of them, filled by xgrammar and
    applied at once; the rows near their max_tokens keep only their first allowed
    closer (module docstring)."""
    began = time.perf_counter()
    states = [seq.grammar for seq in seqs]
    assert all(state is not None for state in states)
    vocab = states[0].vocab  # type: ignore[union-attr]
    bitmask = xgr.allocate_token_bitmask(len(rows), vocab.size)
    _BATCH.batch_fill_next_token_bitmask([s.matcher for s in states], bitmask)  # type: ignore[union-attr]
    device = logits.device
    every = len(rows) == logits.shape[0]  # the common case: no copy in and out
    index = torch.tensor(rows, device=device)
    part = logits if every else logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(part, bitmask.to(device), vocab_size=vocab.size)
    part[:, vocab.size :] = -torch.inf  # ids past the tokenizer's vocabulary (padding)
    part[:, vocab.forbidden.to(device)] = -torch.inf
    closing = torch.tensor(
        [
            seq.params.max_tokens - seq.num_output <= closing_reserve(seq.params.max_tokens)
            for seq in seqs
        ],
        device=device,
    )
    if vocab.closers and bool(closing.any()):
        _close(part, bitmask.to(device), torch.tensor(vocab.closers, device=device), closing)
    if not every:
        logits.index_copy_(0, index, part)
    states[0].observe(time.perf_counter() - began)  # type: ignore[union-attr]


def _close(
    logits: torch.Tensor, bitmask: torch.Tensor, closers: torch.Tensor, closing: torch.Tensor
) -> None:
    """In the `closing` rows that allow one of `closers`, only the first allowed."""
    words = bitmask[:, closers // 32]
    allowed = ((words >> (closers % 32)) & 1).bool()  # [rows, closers]
    steer = closing & allowed.any(dim=-1)
    if not bool(steer.any()):
        return
    first = closers[allowed.int().argmax(dim=-1)]  # argmax: the first allowed
    kept = logits.gather(1, first[:, None])
    steered = torch.full_like(logits, -torch.inf).scatter_(1, first[:, None], kept)
    logits.copy_(torch.where(steer[:, None], steered, logits))
