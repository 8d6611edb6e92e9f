"""What status.slo and the SLOMet condition say about a policy's SLO.

Pure. One writer per key (status_owners.py): reconcile writes the stated targets
(`target_fields`) as soon as a policy is valid, so that `kubectl get bp` shows the
objective before the first round; the tuning round (autotune.py) writes what each
window measured (`slo_fields`). A merge patch merges `slo` key by key, so each keeps
the other's part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from batchpilot_operator.signals import ClassSignals, Signals
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_server.batching_config import DEFAULT_CLASS
from batchpilot_server.metric_names import SLO_STATED

ERROR_BUDGET_FLOOR = -1.0


def slo_condition(signals: Signals, slo: Slo) -> dict[str, str]:
    """SLOMet: the window's attainment against the target where the pods judged requests;
    for a server that exports no SLO counters (an older one), its p99 against an e2e target."""
    attainment = signals.attainment
    if attainment is not None:
        met = attainment >= slo.attainment
        return {
            "status": "True" if met else "False",
            "reason": "WithinSLO" if met else "BelowAttainment",
            "message": f"{attainment:.2%} of {signals.slo_judged:.0f} requests met "
            f"{objective(slo)}{missed_words(signals.slo_missed)}",
        }
    p99 = signals.p99_latency_s
    if p99 is not None and slo.e2e_s is not None:
        met = p99 <= slo.e2e_s
        return {
            "status": "True" if met else "False",
            "reason": "WithinSLO" if met else "AboveSLO",
            "message": f"p99 {p99 * 1000:.0f} ms, SLO {slo.e2e_s * 1000:.0f} ms "
            "(the pods count no SLO attainment: an older server)",
        }
    if signals.ok:
        return {
            "status": "Unknown",
            "reason": "NotJudged",
            "message": "the pods count no SLO attainment (an older server?) and the SLO "
            "states no e2e target to compare the p99 with",
        }
    reason = {"no_data": "NoData", "no_traffic": "NoTraffic"}.get(
        signals.status, "TooLittleTraffic"
    )
    return {
        "status": "Unknown",
        "reason": reason,
        "message": signals.detail or "no request judged against the SLO in the window",
    }


def objective(slo: Slo | SloClass) -> str:
    """The stated targets and attainment in one line: 'ttft<=200ms tpot<=50ms @99%'."""
    targets = " ".join(f"{name}<={value * 1000:g}ms" for name, value in slo.stated.items())
    return f"{targets} @{slo.attainment * 100:g}%"


def missed_words(missed: Mapping[str, float]) -> str:
    by_target = [f"{name} {missed[name]:.0f}" for name in SLO_STATED if missed.get(name)]
    return f"; missed: {', '.join(by_target)}" if by_target else ""


def error_budget_remaining(budget_attainment: float, slo: Slo) -> float:
    """The share of the allowed misses not yet spent: 1 untouched, 0 spent, negative
    overspent, floored at -1 (spent twice over; budgetAttainment tells the rest)."""
    return budget_left(budget_attainment, slo.attainment)


def budget_left(attainment: float, target: float) -> float:
    """1 - (1 - attainment) / (1 - target), floored at -1: the share of the allowed misses
    (1 - target) that `attainment` leaves unspent."""
    spent = (1.0 - attainment) / (1.0 - target)
    return max(ERROR_BUDGET_FLOOR, 1.0 - spent)


def target_fields(slo: Slo) -> dict[str, Any]:
    """status.slo's stated part, which reconcile writes before any round has measured:
    a target the spec does not state is null (a merge patch removes it)."""
    return {
        "objective": objective(slo),
        **{f"{name}Ms": _ms(slo.stated.get(name)) for name in SLO_STATED},
        "attainmentTarget": slo.attainment,
        "budgetWindow": duration_text(slo.budget_window_s),
    }


def slo_fields(signals: Signals, slo: Slo) -> dict[str, Any]:
    """status.slo's measured part: what the window measured, the error budget left (the
    stated targets are `target_fields`, reconcile's). A value the window could not
    measure is null, so the status never shows a stale one."""

    def share(value: float | None) -> float | None:
        return None if value is None else round(value, 5)

    ms = _ms
    budget = signals.budget_attainment
    return {
        "judged": signals.slo_judged,
        "attainment": share(signals.attainment),
        "missed": dict(signals.slo_missed) or None,
        "p99TtftMs": ms(signals.ttft_p99_s),
        "p99TpotMs": ms(signals.tpot_p99_s),
        "p99E2eMs": ms(signals.p99_latency_s),
        "budgetAttainment": share(budget),
        "errorBudgetRemaining": (
            None if budget is None else share(error_budget_remaining(budget, slo))
        ),
        **class_fields(signals, slo),
    }


def class_fields(signals: Signals, slo: Slo) -> dict[str, Any]:
    """status.slo's per-class part where the spec states classes: each class (the
    top-level targets as `default`, then spec.slo.classes in order) as the window saw
    it, and the binding class (`binding_class`). A value the window could not measure is
    left out of its class's entry. Without classes both are null: the single SLO's status
    is as it was, and a spec that dropped its classes drops theirs (a merge patch)."""
    if not slo.classes:
        return {"classes": None, "bindingClass": None}
    stated = [SloClass(DEFAULT_CLASS, 0, slo.ttft_s, slo.tpot_s, slo.e2e_s, slo.attainment),
              *slo.classes]  # fmt: skip
    entries = [_class_entry(c, signals.classes.get(c.name)) for c in stated]
    return {"classes": entries, "bindingClass": binding_class(stated, signals)}


def binding_class(stated: list[SloClass], signals: Signals) -> str | None:
    """The class with the least headroom in the window: the lowest
    (attainment - target) / (1 - target), its window's attainment against its own allowed
    misses (0: exactly at target, below 0: below it, -1: missing twice what it may).
    Ties go to the higher priority, then to the earlier class. Classes without a judged
    request in the window do not bind; None when no class has one."""
    scored = []
    for order, slo_class in enumerate(stated):
        seen = signals.classes.get(slo_class.name)
        attainment = None if seen is None else seen.attainment
        if attainment is not None:
            headroom = (attainment - slo_class.attainment) / (1.0 - slo_class.attainment)
            scored.append((headroom, -slo_class.priority, order, slo_class.name))
    return min(scored)[-1] if scored else None


def _class_entry(slo_class: SloClass, seen: ClassSignals | None) -> dict[str, Any]:
    seen = seen or ClassSignals(slo_class.name)
    attainment, budget = seen.attainment, seen.budget_attainment
    values = {
        "name": slo_class.name,
        "priority": slo_class.priority,
        "objective": objective(slo_class),
        "attainmentTarget": slo_class.attainment,
        "judged": seen.slo_judged,
        "attainment": None if attainment is None else round(attainment, 5),
        "p99TtftMs": _ms(seen.ttft_p99_s),
        "p99TpotMs": _ms(seen.tpot_p99_s),
        "p99E2eMs": _ms(seen.p99_latency_s),
        "budgetAttainment": None if budget is None else round(budget, 5),
        "errorBudgetRemaining": (
            None if budget is None else round(budget_left(budget, slo_class.attainment), 5)
        ),
    }
    return {key: value for key, value in values.items() if value is not None}


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value * 1000.0, 3)


def duration_text(seconds: float) -> str:
    """Seconds as the CRD writes a budget window: the largest whole unit (3600 -> 1h)."""
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
