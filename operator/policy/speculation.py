"""Speculative decoding's arithmetic: what a draft of k tokens is worth at an acceptance.

Pure. Each draft token is accepted with chance `a` until the first rejection, and the
verify row then draws the model's own token too (the bonus, or the one in place of the
rejected draft token), so a row gains 1..k+1 tokens a step, on average
`(1 - a^(k+1)) / (1 - a)`. The pods count draft tokens and accepted ones
(`Signals.spec_acceptance` is their ratio); at k tokens a draft that ratio is
`a (1 - a^k) / ((1 - a) k)`, which `per_token_acceptance` inverts: `a` carries to
other k, the ratio does not (a longer draft's later tokens are accepted less often).
"""

from __future__ import annotations

from batchpilot_operator.signals import Signals

BISECTIONS = 40


def tokens_per_step(acceptance: float, k: int) -> float:
    """Expected tokens a row gains in a step that verifies a draft of `k` tokens."""
    if k <= 0:
        return 1.0
    a = min(max(acceptance, 0.0), 1.0)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def accepted_share(acceptance: float, k: int) -> float:
    """The share of `k` draft tokens accepted on average: what the pods' ratio shows."""
    return (tokens_per_step(acceptance, k) - 1.0) / k if k > 0 else 0.0


def per_token_acceptance(share: float, k: int) -> float:
    """The per-token acceptance `a` whose drafts of `k` tokens are accepted at `share`
    (by bisection: the share grows with `a`)."""
    share = min(max(share, 0.0), 1.0)
    if k <= 1:
        return share
    low, high = 0.0, 1.0
    for _ in range(BISECTIONS):
        mid = (low + high) / 2
        low, high = (mid, high) if accepted_share(mid, k) < share else (low, mid)
    return (low + high) / 2


def measured_acceptance(signals: Signals, k: int) -> float | None:
    """The window's per-token acceptance under a draft of `k` tokens; None where the
    pods verified no drafts (k = 0, or no row had one)."""
    share = signals.spec_acceptance
    if share is None or k <= 0:
        return None
    return per_token_acceptance(share, k)
