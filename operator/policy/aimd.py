"""The AIMD fallback: the step the rule takes until the step fit is trusted, and whenever
the fit's recent prediction error is large (round.py says which, in the reason).

Pure. It reads the *binding* target, the stated target whose observed p99 is nearest to
(or furthest past) it, and, like today's operators of SLO-aware batching (Clipper's
AIMD), moves the knobs by the diagnosis of why that p99 is what it is. A p99 past its
target in a window whose attainment met the objective is the misses the SLO allows: it
counts as inside the band (`Window.pressure`).

1. KV usage at the watermark or any preemption: cut the batch multiplicatively; that
   batch becomes a ceiling for growth (while requests queue, only where the fleet can
   grow: else a queue that breaks a target loses the SLO at any batch under the load's);
2. a target broken:
   - by running alone (TPOT, or a latency whose part outside the queue exceeds its
     target while nothing queues): first the prefill budget where it can help (TPOT:
     cut it to a quarter, where the longest prompts over the shortest answers' decode
     steps exceed the cut, so a long prompt's chunk no longer fills the steps the
     running rows wait for; TTFT: double it while the longest prompts are longer, so
     they take fewer steps to their first token); else back off the batch
     multiplicatively (ceiling), or hold at the minimum; where requests also queue no
     batch size helps: hold; a TPOT broken in batches that fire underfilled is the
     prompts computed beside the decode steps, not the rows (a cut above the rows
     running only caps the capacity): hold, and the fleet grows (*crowded*);
   - by queueing: halve the timeout where it explains the wait and batches fire
     underfilled; else grow the batch multiplicatively up to its limit;
3. with headroom (every p99 under `1 - band` of its target): grow the batch additively
   while requests queue behind full batches; with ample headroom, no TTFT target, no
   queue and underfilled batches, let the timeout grow toward fuller batches;
4. inside the band: grow additively only if queueing is half the p99; else hold.

The pods needed come from the same step. A crowded TPOT: one pod more (the prompts
beside each decode step come with the arrivals a pod takes). A queueing breach:
- with the batch still growing: a batch grown by a factor raises a pod's throughput by
  that factor at most (and by nothing usable where a stated TPOT is already outside its
  band: more rows lengthen every step), so where even that best leaves the demand and
  the backlog (drained within a window) over `SCALE_OUT_UTILISATION` busy at the
  throughput a pod showed (finished per busy second), the pods that carry it are
  needed now, beside the growth; else the pods there are ("knobs first");
- with the batch spent (at its limit, or cut this round): the pods that each run at
  most `SCALE_OUT_UTILISATION` busy for the forecast arrivals.
With headroom and no queue, the pods that would run at most `SCALE_IN_UTILISATION`
busy; where that is not fewer (a continuous pod's steps run whenever a row does, so one
serving a few long answers reads busy at any load), one pod fewer where the decode rows
a step runs, spread over one pod less, stay within `SCALE_IN_UTILISATION` of the batch
(the scale-down stabilization spaces such steps); otherwise the pods there are.
"""

from __future__ import annotations

import math
from dataclasses import replace

from batchpilot_operator.policy.memory import PolicyMemory
from batchpilot_operator.policy.reasons import ms
from batchpilot_operator.policy.replicas import Need
from batchpilot_operator.policy.sizing import Sizing
from batchpilot_operator.policy.types import (
    SCALE_IN_UTILISATION,
    SCALE_OUT_UTILISATION,
    Bounds,
    Goal,
)
from batchpilot_operator.policy.window import Window
from batchpilot_server.batching_config import BatchingConfig


def step(window: Window, current: BatchingConfig, goal: Goal, memory: PolicyMemory) -> Sizing:
    """The AIMD step for this window; see the module docstring."""
    s, b, p, slo = window.signals, goal.bounds, goal.params, goal.slo
    batch, timeout = current.max_batch_size, current.batch_timeout_ms
    budget = current.prefill_token_budget
    # The ceiling keeps growth out of a batch that ran too slow where another pod can take
    # the load instead; where none can, a queue that breaks a target loses the SLO at any
    # batch under the load's, so growth goes past it.
    ceiling = memory.ceiling if window.fleet_can_grow or not window.queueing() else None
    limit = _limit(b.min_batch, b.max_batch, ceiling)

    def change(
        action: str,
        why: str,
        spent: bool,
        ceiling: int | None = None,
        new_batch: int | None = None,
        new_timeout: float | None = None,
        new_budget: int | None = None,
        crowded: bool = False,
    ) -> Sizing:
        config = replace(
            current,
            max_batch_size=batch if new_batch is None else new_batch,
            batch_timeout_ms=timeout if new_timeout is None else new_timeout,
            prefill_token_budget=budget if new_budget is None else new_budget,
        )
        growth = config.max_batch_size / batch
        need = _need(window, why, spent, goal, growth, crowded, config.max_batch_size)
        return Sizing(config, action, why, need, ceiling)

    kv = s.kv_usage
    if (kv is not None and kv >= slo.kv_high_watermark) or s.preemption_rate > 0:
        cause = (
            f"KV usage {kv:.2f} >= watermark {slo.kv_high_watermark:.2f}"
            if kv is not None and kv >= slo.kv_high_watermark
            else f"{s.preemption_rate:.2f} preemptions/s"
        )
        if batch <= b.min_batch:
            return change("hold", f"{cause} at the minimum batch {batch}", True)
        cut = _cut(batch, p.kv_cut_factor, b.min_batch)
        return change("kv_guard", f"{cause}: batch {batch} -> {cut}", True, batch, cut)
    pressure = window.pressure()
    if pressure is None:
        return Sizing(current, "hold", "no p99 of a stated target in the window", None)
    name, ratio = pressure
    seen, target = window.observed()[name], slo.stated[name]
    queue_wait = min(seen, s.queue_wait_p99_s or 0.0) if name != "tpot" else 0.0
    head = f"{name} p99 {ms(seen)}"
    if ratio > 1:
        head += f" > target {ms(target)}"
        queueing = window.queueing()
        slow = name == "tpot" or (not queueing and seen - queue_wait > target)
        if slow and queueing:
            return change(
                "hold", f"{head}: overloaded, running and queueing both exceed what the "
                "target allows; no batch size fixes it", True,
            )  # fmt: skip
        if slow:
            moved = _budget_step(name, budget, window, b)
            if moved is not None:
                return change(
                    "set_budget", f"{head} while running: prefill budget {budget} -> {moved} "
                    f"({_BUDGET_WHY[name]})", False, new_budget=moved,
                )  # fmt: skip
            rows = window.mean_rows()
            if name == "tpot" and rows is not None and rows < p.full_batch_share * batch:
                return change(
                    "hold", f"{head} while running, in batches underfilled (mean "
                    f"{rows:.1f} decode rows of {batch}): the prompts computed beside the "
                    "decode steps slow them, not the rows, so a smaller batch changes nothing "
                    "but the capacity; fewer arrivals a pod do", True, crowded=True,
                )  # fmt: skip
            if batch <= b.min_batch:
                return change("hold", f"{head} while running, at the minimum batch {batch}", True)
            cut = _cut(batch, p.backoff_factor, b.min_batch)
            return change(
                "backoff_batch", f"{head} while running: batch {batch} -> {cut}", True, batch, cut
            )
        head += f" from queueing (queue wait p99 {ms(queue_wait)})"
        if (
            timeout > b.min_timeout_ms
            and queue_wait <= p.timeout_explains * timeout / 1000
            and (_underfilled(window, batch, p.full_batch_share))
        ):
            cut_to = _cut_timeout(timeout, p.timeout_cut_factor, b.min_timeout_ms)
            return change(
                "shrink_timeout", f"{head}: the timeout explains it: timeout {timeout:g} -> "
                f"{cut_to:g} ms", False, new_timeout=cut_to,
            )  # fmt: skip
        if batch < limit:
            grown = min(limit, max(batch + p.additive_step, round(batch * p.capacity_factor)))
            return change(
                "grow_batch", f"{head}: batch {batch} -> {grown}", grown >= limit, new_batch=grown
            )
        return change("hold", f"{head}; batch {batch} is at its limit {limit}", True)
    queued = queue_wait >= p.queueing_share * target or window.queue_grows
    if ratio < 1 - p.band:
        head += f" < {ms((1 - p.band) * target)}"
        full = s.mean_batch_size is None or s.mean_batch_size >= p.full_batch_share * batch
        if queued and full and batch < limit:
            grown = min(limit, batch + p.additive_step)
            return change(
                "grow_batch", f"{head}, requests queue behind full batches: batch {batch} -> "
                f"{grown}", False, new_batch=grown,
            )  # fmt: skip
        grown_timeout = _grown_timeout(timeout, target, b.max_timeout_ms)
        if (
            "ttft" not in slo.stated and ratio < 0.5 and not queued
            and _underfilled(window, batch, p.full_batch_share) and grown_timeout > timeout
        ):  # fmt: skip
            return change(
                "grow_timeout", f"{head} and batches fire underfilled: timeout {timeout:g} -> "
                f"{grown_timeout:g} ms for fuller batches", False, new_timeout=grown_timeout,
            )  # fmt: skip
        why = "no queueing: a larger batch would not be used"
        if queued and batch >= limit:
            why = f"batch {batch} is at its limit {limit}"
        return change("hold", f"{head}; {why}", batch >= limit)
    if queue_wait >= 0.5 * seen and batch < limit:
        grown = min(limit, batch + p.additive_step)
        return change(
            "grow_batch", f"{head} nears the target from queueing (queue wait p99 "
            f"{ms(queue_wait)}): batch {batch} -> {grown}", False, new_batch=grown,
        )  # fmt: skip
    if seen > target:  # the window's attainment met the objective (Window.pressure)
        return change(
            "hold", f"{head} over its target {ms(target)}, but attainment "
            f"{s.attainment:.3f} >= {slo.attainment:g}: the SLO holds", batch >= limit,
        )  # fmt: skip
    return change(
        "hold", f"{head} within the band [{ms((1 - p.band) * target)}, {ms(target)}]",
        batch >= limit,
    )  # fmt: skip


def _need(
    window: Window,
    why: str,
    spent: bool,
    goal: Goal,
    growth: float,
    crowded: bool,
    batch: int,
) -> Need | None:
    """The pods this step needs (see the module docstring); None without a fleet to size.
    `growth`: the step's batch over the one in force; `crowded`: a TPOT broken by the
    prompts computed beside the decode steps, which fewer arrivals a pod fix; `batch`:
    the step's batch."""
    fleet = window.fleet
    if fleet is None or goal.replicas is None:
        return None
    desired, per_pod = fleet.desired, window.measured_per_pod_rps()
    rate = window.forecast.describe()
    pressure = window.pressure()
    breach = pressure is not None and pressure[1] > 1 and window.queueing()
    if crowded:
        return Need(desired + 1, f"{why}: one pod more")
    if per_pod is None or per_pod <= 0:
        return Need(desired, f"{why}; no pod throughput known yet to size the fleet")
    if breach and not spent:
        # A batch grown by a factor raises a pod's throughput by that factor at most: the
        # pods that carry the demand and drain the backlog even at that best, now, rather
        # than a round and a start-up later.
        demand = window.demand_with_backlog_rps
        usable = _usable_growth(window, growth, goal)
        best = SCALE_OUT_UTILISATION * per_pod * usable
        wanted = math.ceil(demand / best - 1e-9)
        if wanted <= desired:
            return Need(desired, f"{why}, and the grown batch can carry it: knobs first")
        grown = (
            f"even a batch grown {growth:.2g}x"
            if usable > 1 or growth <= 1
            else "with the TPOT outside its band, a grown batch adds nothing usable: a pod"
        )
        return Need(
            wanted,
            f"{why}, but {grown} carries at most {best:.2f} req/s per pod at "
            f"{SCALE_OUT_UTILISATION:.0%} busy: {demand:.2f} req/s with the backlog needs "
            f"{wanted}",
        )
    if breach:
        wanted = math.ceil(window.forecast_rps / (SCALE_OUT_UTILISATION * per_pod) - 1e-9)
        return Need(
            max(desired + 1, wanted),
            f"{why}, and the batch is spent: {rate} over {per_pod:.2f} req/s per pod "
            f"(measured: finished per busy second) needs {wanted} at "
            f"{SCALE_OUT_UTILISATION:.0%} busy",
        )
    wanted = math.ceil(window.forecast_rps / (SCALE_IN_UTILISATION * per_pod) - 1e-9)
    quiet = pressure is not None and pressure[1] < 1 - goal.params.band and not window.queue_grows
    if quiet and wanted < desired:
        return Need(
            wanted,
            f"{pressure[0]} p99 with headroom: {rate} over {per_pod:.2f} req/s per pod "
            f"(measured: finished per busy second) needs {wanted} at "
            f"{SCALE_IN_UTILISATION:.0%} busy",
        )
    rows = window.mean_rows()
    fewer = desired - 1
    if quiet and fewer >= 1 and rows is not None:
        merged = rows * window.pods / fewer
        if merged <= SCALE_IN_UTILISATION * batch:
            return Need(
                fewer,
                f"{pressure[0]} p99 with headroom and steps of {rows:.1f} decode rows in "
                f"batch {batch}: {fewer} pod(s) would run about {merged:.1f}, within "
                f"{SCALE_IN_UTILISATION:.0%} of it (a pod whose steps run a few rows reads "
                "busy at any load): one pod fewer",
            )
    return Need(desired, f"{desired} pod(s) needed for {rate}")


def _usable_growth(window: Window, growth: float, goal: Goal) -> float:
    """The throughput a grown batch can add: its factor, unless a stated TPOT is already
    outside its band (more rows a step lengthen every step, so the capacity a larger
    batch adds cannot be used within that target)."""
    tpot, target = window.signals.tpot_p99_s, goal.slo.stated.get("tpot")
    if tpot is not None and target is not None and tpot > (1 - goal.params.band) * target:
        return 1.0
    return max(1.0, growth)


# Why the budget moves for a target broken while running: each step carries up to the
# budget's prompt tokens beside its decode rows, so a long prompt's chunk lengthens the
# step every running row waits for (TPOT); and a prompt takes ceil(P / budget) steps to
# its first token (TTFT).
_BUDGET_WHY = {
    "tpot": "smaller chunks of the long prompts in each decode step",
    "ttft": "the long prompts in fewer steps",
}
BUDGET_CUT = 0.25  # multiplicative: a long prompt's chunk is most of a step
BUDGET_GROWTH = 2


def _budget_step(name: str, budget: int, window: Window, bounds: Bounds) -> int | None:
    """The prefill budget's step for a target broken while running (see `_BUDGET_WHY`);
    None where the budget cannot help: at its bound, or (TTFT) no prompt is longer than
    the budget it would move to (a chunk that splits nothing changes nothing), or (TPOT)
    the longest prompt spread over the shortest answers' decode steps (p99 prompt over
    p10 answer) comes to no more than the cut budget a step, or the window does not tell:
    a prompt arriving during a decode of n steps adds `min(P, budget x n)` tokens to
    them, so a cut changes only what exceeds `P / n`."""
    s = window.signals
    longest = s.prompt_tokens_p99
    if name == "tpot" and budget > bounds.min_prefill_budget:
        cut = max(bounds.min_prefill_budget, math.floor(budget * BUDGET_CUT))
        if longest is None or s.output_tokens_p10 is None:
            return None
        return cut if longest / max(1.0, s.output_tokens_p10 - 1) > cut else None
    if name == "ttft" and budget < bounds.max_prefill_budget and (longest or 0) > budget:
        return min(bounds.max_prefill_budget, budget * BUDGET_GROWTH)
    return None


def _limit(low: int, high: int, ceiling: int | None) -> int:
    return high if ceiling is None else max(low, min(high, ceiling - 1))


def _cut(batch: int, factor: float, low: int) -> int:
    # At least one smaller, so a factor that rounds back to the batch still moves.
    return max(low, min(batch - 1, math.floor(batch * factor)))


def _cut_timeout(timeout: float, factor: float, low: float) -> float:
    cut = timeout * factor
    # Below a millisecond a timeout only costs a wake-up: go straight to the floor.
    return low if cut < 1.0 else max(low, round(cut, 3))


def _grown_timeout(timeout: float, target_s: float, high: float) -> float:
    cap = min(high, 0.1 * target_s * 1000)  # never above a tenth of the target
    step = max(1.0, 0.02 * target_s * 1000)
    return max(timeout, round(min(cap, timeout + step), 3))


def _underfilled(window: Window, batch: int, share: float) -> bool:
    mean = window.signals.mean_batch_size
    return mean is not None and mean < share * batch
