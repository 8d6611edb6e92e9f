"""The choice: the cheapest candidate config predicted to meet the SLO with a margin.

Pure. Candidates span the bounds: batch sizes at the powers of two between the bounds
(with the bounds and the batch in force) up to `REACH` times the batch in force (or the
most decode rows the fit's windows held, if more; no further than those where the fit
priced neither a row nor its KV), the timeout's lower bound and the one in
force, prefill budgets at the powers of two between the bounds (with both bounds and
the one in force), speculative draft lengths k at both bounds and the one in force (the
predictor weighs a draft's verified tokens against the tokens it gains), on every pod
count the goal allows (only the pods there are where the rule does not own the count).
For each, the predictor gives the attainment at the window's demand; a candidate is *eligible* when

- its predicted misses are at most `margin_share` of the misses the attainment allows
  (the stated margin: at 0.99 and a half, predicted attainment >= 0.995); where the
  predictor judges SLO classes apart (predictor.py `class_loads`), every class's
  predicted misses against its own attainment, so that one class's long requests do
  not spend another's margin; the reason names the binding class (the least room),
- its predicted peak KV use stays under the watermark (where the window tells the
  pool's size), and
- it does not preempt: where the window saw preemptions, no batch at or above the one in
  force is eligible.

Fewest pods first; among those, the highest goodput per pod (at one pod count that is
the highest attainment, over the classes weighted by their requests where they are
judged apart, rounded to 0.001 so that noise moves nothing); then the fewest
knobs moved from the config in force; then the smaller batch, budget and k. Where no
candidate on any pod count is eligible, the one with the highest attainment on the
most pods is taken (then the lowest predicted utilisation: where every candidate is
predicted to miss everything, the one that carries the most), among those within the
KV watermark and not preempting where there are any (the constraints hold even then),
and the reason says that none meets the SLO.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batchpilot_operator.policy.predictor import (
    Candidate,
    Judgement,
    kv_use,
    predict,
    scores_of,
)
from batchpilot_operator.policy.reasons import action_of, knob_change, targets
from batchpilot_operator.policy.replicas import Need
from batchpilot_operator.policy.sizing import Sizing
from batchpilot_operator.policy.step_model import StepModel
from batchpilot_operator.policy.types import Bounds, Goal
from batchpilot_operator.policy.window import Window
from batchpilot_server.batching_config import BatchingConfig

# The fit is a plane through the operating points seen: a batch past this many times the
# batch in force (or the most decode rows a step held) is beyond what it describes (a
# flat fit would call batch 64 as cheap as batch 8), so the choice reaches that far a
# round at most, as the fallback grows the batch by a factor. Where the fit priced
# neither a row nor the KV its rows attend (both came out free), it says nothing of
# what more rows cost, and the choice reaches no further than the batch in force.
REACH = 2.0


@dataclass(frozen=True)
class _Scored:
    candidate: Candidate
    attainment: float
    utilisation: float  # predicted rho: arrivals over what a pod carries
    feasible: bool  # within the KV watermark and not preempting
    eligible: bool  # feasible and meets the attainment with the margin (every class's)
    moved: int  # knobs moved from the config in force
    binding: Judgement  # the SLO with the least room: a class's, or the totals'

    def key(self) -> tuple[float, ...]:
        c = self.candidate
        return (-round(self.attainment, 3), self.moved, c.max_batch_size,
                c.prefill_token_budget, c.batch_timeout_ms, c.num_speculative_tokens)  # fmt: skip

    def best_there_is(self) -> tuple[float, ...]:
        """Where nothing meets the SLO: the highest attainment, then the most capacity (a
        queue that drains sooner; where every candidate is predicted to miss all, this
        still moves toward one that can carry the load), then as `key`."""
        return (-round(self.attainment, 3), round(self.utilisation, 2), *self.key()[1:])


def knob_candidates(
    bounds: Bounds, current: BatchingConfig, model: StepModel
) -> list[tuple[int, float, int, int]]:
    """(batch, timeout, budget, k) within the bounds and the fit's reach (see the module
    docstring)."""
    priced = "rows" in model.used or "kv" in model.used
    seen = max(current.max_batch_size, model.max_rows)
    reach = math.ceil(REACH * seen) if priced else seen
    batches = [
        b for b in _powers(bounds.min_batch, bounds.max_batch, current.max_batch_size)
        if b <= reach
    ]  # fmt: skip
    timeouts = sorted({bounds.min_timeout_ms, current.batch_timeout_ms})
    budgets = _powers(
        bounds.min_prefill_budget, bounds.max_prefill_budget, current.prefill_token_budget
    )
    low_k, high_k = bounds.min_speculative_tokens, bounds.max_speculative_tokens
    drafts = sorted({low_k, high_k, min(max(current.num_speculative_tokens, low_k), high_k)})
    return [(b, t, g, k) for b in batches for t in timeouts for g in budgets for k in drafts]


def _powers(low: int, high: int, current: int) -> list[int]:
    values = {low, high, min(max(current, low), high)}
    power = 1
    while power < high:
        if power > low:
            values.add(power)
        power *= 2
    return sorted(values)


def pod_counts(window: Window) -> list[int]:
    if window.replicas is None or window.fleet is None:
        return [window.pods]
    return list(range(window.replicas.min_replicas, window.replicas.max_replicas + 1))


def choose(window: Window, model: StepModel, current: BatchingConfig, goal: Goal) -> Sizing:
    """The chosen candidate's knobs and pods; see the module docstring."""
    slo, margin = goal.slo, goal.params.margin_share
    preempting = window.signals.preemption_rate > 0
    knobs = knob_candidates(goal.bounds, current, model)
    best: _Scored | None = None
    for pods in pod_counts(window):
        tier: list[_Scored] = []
        for batch, timeout, budget, k in knobs:
            candidate = Candidate(batch, timeout, budget, pods, k)
            scores = scores_of(window, model, candidate)
            assert scores is not None  # the round's gate: the window has lengths
            kv = kv_use(window, candidate, scores.rows)
            feasible = (kv is None or kv <= slo.kv_high_watermark) and not (
                preempting and batch >= current.max_batch_size
            )
            moved = sum((batch != current.max_batch_size, timeout != current.batch_timeout_ms,
                         budget != current.prefill_token_budget,
                         k != current.num_speculative_tokens))  # fmt: skip
            judged = scores.judgements
            meets = feasible and all(j.attainment >= j.needed(margin) for j in judged)
            binding = min(judged, key=lambda j: j.room(margin))
            tier.append(
                _Scored(candidate, scores.attainment, scores.rho, feasible, meets, moved, binding)
            )
        eligible = [s for s in tier if s.eligible]
        if eligible:
            best = min(eligible, key=_Scored.key)
            break
        best = min([s for s in tier if s.feasible] or tier, key=_Scored.best_there_is)
    assert best is not None  # pod_counts is never empty
    chosen = best.candidate
    prediction = predict(window, model, chosen)
    config = chosen.config(current)
    verdict = _verdict(best, margin)
    seen = prediction.describe(slo) if prediction is not None else ""
    reason = (
        f"{knob_change(current, config)} on {chosen.replicas} pod(s): predicted {seen}; {verdict}"
    )
    owns_pods = window.fleet is not None and window.replicas is not None
    need = Need(chosen.replicas, reason) if owns_pods else None
    return Sizing(config, action_of(current, config), reason, need, prediction=prediction)


def _verdict(best: _Scored, margin: float) -> str:
    """Whether the chosen candidate meets the SLO with the margin, naming the binding
    class where classes are judged apart."""
    b, pods = best.binding, best.candidate.replicas
    needed = b.needed(margin)
    if b.name is None:
        if best.eligible:
            return f"meets attainment {b.objective:g} with the margin (>= {needed:.4f})"
        return (
            f"the best there is: no candidate on up to {pods} pod(s) meets attainment "
            f"{b.objective:g} ({targets(b.targets)})"
        )
    binds = (
        f"class {b.name} binds: predicted attainment {b.attainment:.3f} against "
        f"{b.objective:g} ({targets(b.targets)})"
    )
    if best.eligible:
        return f"every class meets its attainment with the margin; {binds}, >= {needed:.4f}"
    return (
        f"the best there is: no candidate on up to {pods} pod(s) meets every class's "
        f"attainment; {binds}"
    )
