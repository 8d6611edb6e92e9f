"""Speculative decoding's draft without a draft model: n-gram prompt lookup (vLLM's
`ngram` method). The sequence's own tokens (prompt and output so far) are searched for
the most recent earlier occurrence of their last n tokens, n from `PROMPT_LOOKUP_MAX`
down to `PROMPT_LOOKUP_MIN`; the tokens that followed it are the draft. Answers that
quote their prompt (summaries, code edits, retrieval answers) repeat long runs of it,
and the model then confirms several tokens in one forward.

Torch-free: the scheduler proposes while it plans a step.
"""

from __future__ import annotations

from collections.abc import Callable

# vLLM's defaults when neither bound is given (SpeculativeConfig: both 5): a shorter
# match proposes more often but is right less often, and a wrong draft costs a
# verified position for nothing
PROMPT_LOOKUP_MAX = 5
PROMPT_LOOKUP_MIN = 5

# (the row's tokens, the most it may propose) -> its draft; the scheduler's seam, so that
# the simulator can draft without token contents (tools/simulator.py)
Proposer = Callable[[list[int], int], list[int]]


def propose(
    tokens: list[int],
    k: int,
    lookup_max: int = PROMPT_LOOKUP_MAX,
    lookup_min: int = PROMPT_LOOKUP_MIN,
) -> list[int]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix
    of `tokens` (from `lookup_max` down to `lookup_min` tokens) found among them; []
    when none occurs."""
    if k < 1:
        return []
    total = len(tokens)
    for n in range(min(lookup_max, total - 1), lookup_min - 1, -1):
        start = _latest_occurrence(tokens, tokens[total - n :], total - n)
        if start is not None:
            return tokens[start + n : start + n + k]
    return []


def _latest_occurrence(tokens: list[int], pattern: list[int], before: int) -> int | None:
    """Where `pattern` last starts in `tokens` before index `before` (so it is not the
    suffix itself), or None. A right-to-left scan of the first token, then a slice
    compare: the first token rarely matches, so this is near one pass."""
    first, n = pattern[0], len(pattern)
    for start in range(before - 1, -1, -1):
        if tokens[start] == first and tokens[start : start + n] == pattern:
            return start
    return None
