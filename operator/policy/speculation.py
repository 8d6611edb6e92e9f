"""Speculative decoding's arithmetic: what a draft of k tokens is worth at an acceptance.

Pure. Each draft token is accepted with chance `a` until the first rejection, and the
verify row then draws the model's own token too (the bonus, or the one in place of the
rejected draft token), so a row gains 1..k+1 tokens a step, on average
`(1 - a^(k+1)) / (1 - a)`. The pods count draft tokens and accepted ones
(`Signals.spec_acceptance` is their ratio); at k tokens a draft that ratio is
`a (1 - a^k) / ((1 - a) k)`, which `per_token_acceptance` inverts: `a` carries to
other k, the ratio does not (a longer draft's later tokens are accepted less often).

`draft_length` is the fallback's k (fallback.py): a row gains `tokens_per_step(a, k)`
tokens a step, and the step computes each row's k draft tokens as prompt tokens, so from
the window's measured step (its mean decode rows a step), each k's step is the measured
one with k - (the k in force) draft tokens a row more at the step fit's price of a token,
and a row's tokens per second at k are the tokens it gains over that step. Where a queue
grows the rows a step holds are all the pod runs, so a row's rate times them is the pod's
throughput: the same arithmetic picks the k that carries the most.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot_operator.policy.step_model import StepModel, StepPoint
from batchpilot_operator.signals import Signals

BISECTIONS = 40
# A longer draft must give this much more a row than a shorter one to be taken: its
# tokens come at random (accepted runs), its cost at every step, and the fitted price of a
# token is a plane's through a curve; within this the shorter draft costs less capacity.
MIN_GAIN = 0.05


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


@dataclass(frozen=True)
class Draft:
    """The draft length a round runs, and why (empty where nothing was measured)."""

    k: int
    why: str = ""


def draft_length(
    acceptance: float | None,
    model: StepModel | None,
    point: StepPoint | None,
    k_in_force: int,
    low: int,
    high: int,
) -> Draft:
    """The shortest k in `low..high` within `MIN_GAIN` of the most tokens per second a
    row at the window's operating point `point` (see the module docstring). The k in
    force (clamped into the bounds) where the pods never measured an acceptance, or there
    is no step fit, operating point or token price (`draft_token_s`): what a draft gives
    or costs is unknown then."""
    kept = min(max(k_in_force, low), high)
    price = draft_token_s(model, k_in_force) if model is not None else None
    if acceptance is None or model is None or point is None or price is None:
        return Draft(kept)
    rows, floor = point.rows, max(model.fixed_s, 1e-9)

    def rate(k: int) -> float:
        """Tokens a second a row gains at draft length k: the step measured, with each
        row's draft lengthened or shortened by k - k_in_force tokens at the token price
        (a step is never shorter than the fit's fixed cost)."""
        step = max(floor, point.step_s + rows * (k - k_in_force) * price)
        return tokens_per_step(acceptance, k) / step

    rates = {k: rate(k) for k in range(low, high + 1)}
    # the shortest draft within MIN_GAIN of the best (see MIN_GAIN)
    top = max(rates.values())
    chosen = min(k for k, r in rates.items() if r * (1 + MIN_GAIN) >= top)
    why = (
        f"k {chosen}: {tokens_per_step(acceptance, chosen):.2f} tokens a step at acceptance "
        f"{acceptance:.2f}, {rates[chosen]:.0f} tokens/s a row at {rows:.1f} rows a step, "
        f"a draft token {price * 1e6:.0f} us; k {k_in_force} in force: {rates[kept]:.0f}; "
        f"the shortest within {MIN_GAIN:.0%} of the most of k {low}..{high}"
    )
    return Draft(chosen, why)


def draft_token_s(model: StepModel, k_in_force: int) -> float | None:
    """What a draft token adds to a step: the fit's prompt-token price (the engine computes
    a draft as prompt tokens) plus a KV token's (a verify row attends to its draft). Where
    the prompt tokens a step did not vary, a decode row's price over the 1 + k tokens it
    computed (its newest and its draft: one token through the same weights each, as
    step_model.py prices rows and prompt tokens that moved together); None where neither
    varied."""
    if "prefill" not in model.flat:
        return model.per_prefill_s + model.per_kv_s
    if "rows" not in model.flat:
        return model.per_row_s / (1 + max(0, k_in_force)) + model.per_kv_s
    return None
