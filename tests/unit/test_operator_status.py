"""What a tuning round writes about the SLO: status.slo, the error budget and SLOMet."""

from __future__ import annotations

from typing import Any

import pytest
from batchpilot_operator.signals import ClassSignals, Signals
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_operator.slo_status import (
    error_budget_remaining,
    slo_condition,
    slo_fields,
    target_fields,
)

from tests.support.crd import refusals
from tests.support.policies import policy_object

LLM = Slo(ttft_s=0.2, tpot_s=0.05, attainment=0.95, budget_window_s=6 * 3600)


def judged(**fields: Any) -> Signals:
    return Signals(status="ok", window_s=60, requests=200, **fields)


def both_parts(signals: Signals, slo: Slo) -> dict[str, Any]:
    """status.slo as its two writers leave it: reconcile's targets, the round's measures."""
    return {**target_fields(slo), **slo_fields(signals, slo)}


def merged(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields as a merge patch leaves them in the status: a null removes the key."""
    return {k: merged(v) if isinstance(v, dict) else v for k, v in fields.items() if v is not None}


def test_status_slo_shows_targets_observed_p99s_attainment_and_budget() -> None:
    signals = judged(
        ttft_p99_s=0.31, tpot_p99_s=0.04, p99_latency_s=4.2,
        slo_judged=200, slo_met=192, slo_missed={"all": 8, "ttft": 6, "tpot": 3},
        budget_attainment=0.97,
    )  # fmt: skip
    fields = both_parts(signals, LLM)
    assert fields == {
        "objective": "ttft<=200ms tpot<=50ms @95%",
        "ttftMs": 200.0, "tpotMs": 50.0, "e2eMs": None,
        "attainmentTarget": 0.95,
        "budgetWindow": "6h",
        "judged": 200,
        "attainment": 0.96,
        "missed": {"all": 8, "ttft": 6, "tpot": 3},
        "p99TtftMs": 310.0, "p99TpotMs": 40.0, "p99E2eMs": 4200.0,
        "budgetAttainment": 0.97,
        "errorBudgetRemaining": 0.4,  # 3% of the allowed 5% spent
        "classes": None, "bindingClass": None,  # no classes: nothing per class
    }  # fmt: skip
    status = {"slo": merged(fields)}
    assert refusals({**policy_object("p", "ml", {"slo": {"ttftMs": 200, "tpotMs": 50}}),
                     "status": status}) == []  # fmt: skip


def test_a_window_without_slo_series_writes_nulls_not_stale_values() -> None:
    fields = both_parts(judged(p99_latency_s=0.3), Slo(e2e_s=0.5))
    assert fields["objective"] == "e2e<=500ms @99%" and fields["e2eMs"] == 500.0
    for key in ("attainment", "judged", "budgetAttainment", "errorBudgetRemaining", "missed"):
        assert fields[key] is None, key


@pytest.mark.parametrize(
    ("budget_attainment", "remaining"),
    [(1.0, 1.0), (0.99, 0.8), (0.95, 0.0), (0.90, -1.0), (0.0, -1.0)],
)
def test_the_error_budget_left_is_the_share_of_allowed_misses_not_spent(
    budget_attainment: float, remaining: float
) -> None:
    assert error_budget_remaining(budget_attainment, LLM) == pytest.approx(remaining)


def test_slo_met_follows_attainment_and_names_the_targets_missed() -> None:
    below = slo_condition(judged(slo_judged=100, slo_met=90, slo_missed={"all": 10, "tpot": 10}),
                          LLM)  # fmt: skip
    assert (below["status"], below["reason"]) == ("False", "BelowAttainment")
    assert below["message"] == (
        "90.00% of 100 requests met ttft<=200ms tpot<=50ms @95%; missed: tpot 10"
    )
    # a p99 far above the e2e target does not decide when the pods judged requests
    met = slo_condition(judged(slo_judged=100, slo_met=99, p99_latency_s=9.0),
                        Slo(e2e_s=1.0))  # fmt: skip
    assert (met["status"], met["reason"]) == ("True", "WithinSLO")


def test_slo_met_falls_back_to_the_p99_for_a_server_without_slo_counters() -> None:
    above = slo_condition(judged(p99_latency_s=0.8), Slo(e2e_s=0.5))
    assert (above["status"], above["reason"]) == ("False", "AboveSLO")
    assert "p99 800 ms, SLO 500 ms" in above["message"]
    # a TTFT/TPOT policy on such a server cannot be judged
    unknown = slo_condition(judged(p99_latency_s=0.8), LLM)
    assert (unknown["status"], unknown["reason"]) == ("Unknown", "NotJudged")
    thin = slo_condition(Signals(status="no_traffic", detail="no request finished"), LLM)
    assert (thin["status"], thin["reason"]) == ("Unknown", "NoTraffic")


def test_the_round_writes_only_the_measured_part() -> None:
    # the targets are reconcile's (status_owners.py): the round's patch leaves them be
    measured = slo_fields(judged(slo_judged=10, slo_met=10), LLM)
    assert not set(measured) & set(target_fields(LLM))


def test_the_stated_part_is_what_reconcile_writes_before_any_round() -> None:
    assert target_fields(Slo(e2e_s=0.5)) == {
        "objective": "e2e<=500ms @99%", "ttftMs": None, "tpotMs": None, "e2eMs": 500.0,
        "attainmentTarget": 0.99, "budgetWindow": "1h",
    }  # fmt: skip
    assert target_fields(Slo(tpot_s=0.08, budget_window_s=90))["budgetWindow"] == "90s"


TWO_CLASSES = Slo(
    ttft_s=2.0,
    attainment=0.95,
    classes=(
        SloClass("interactive", priority=10, ttft_s=0.5, tpot_s=0.05, attainment=0.99),
        SloClass("batch", priority=0, e2e_s=300.0, attainment=0.9),
    ),
)


def test_the_single_slo_status_has_no_class_fields() -> None:
    fields = slo_fields(judged(slo_judged=10, slo_met=10), LLM)
    # nulls: absent from the status, and removed where a spec dropped its classes
    assert fields["classes"] is None and fields["bindingClass"] is None
    assert "classes" not in merged(fields) and "bindingClass" not in merged(fields)


def test_each_class_shows_its_attainment_p99s_and_error_budget() -> None:
    signals = judged(
        slo_judged=300, slo_met=285,
        classes={
            "interactive": ClassSignals("interactive", slo_judged=200, slo_met=196,
                                        ttft_p99_s=0.45, tpot_p99_s=0.03, p99_latency_s=2.5,
                                        budget_attainment=0.995),
            "batch": ClassSignals("batch", slo_judged=100, slo_met=89, p99_latency_s=250.0,
                                  budget_attainment=0.95),
        },
    )  # fmt: skip
    fields = both_parts(signals, TWO_CLASSES)
    assert fields["classes"] == [
        {"name": "default", "priority": 0, "objective": "ttft<=2000ms @95%",
         "attainmentTarget": 0.95},
        {"name": "interactive", "priority": 10, "objective": "ttft<=500ms tpot<=50ms @99%",
         "attainmentTarget": 0.99, "judged": 200, "attainment": 0.98,
         "p99TtftMs": 450.0, "p99TpotMs": 30.0, "p99E2eMs": 2500.0,
         "budgetAttainment": 0.995, "errorBudgetRemaining": 0.5},
        {"name": "batch", "priority": 0, "objective": "e2e<=300000ms @90%",
         "attainmentTarget": 0.9, "judged": 100, "attainment": 0.89, "p99E2eMs": 250000.0,
         "budgetAttainment": 0.95, "errorBudgetRemaining": 0.5},
    ]  # fmt: skip
    # interactive misses 2% of its allowed 1% (headroom -1); batch 11% of 10% (-0.1)
    assert fields["bindingClass"] == "interactive"
    # the single SLO's fields are as before, over all the classes' requests
    assert fields["attainment"] == 0.95 and fields["objective"] == "ttft<=2000ms @95%"
    status = {"slo": merged(fields)}
    spec = {"slo": {"ttftMs": 2000, "attainment": 0.95,
                    "classes": [{"name": "interactive", "priority": 10, "ttftMs": 500,
                                 "tpotMs": 50}, {"name": "batch", "e2eMs": 300000,
                                                 "attainment": 0.9}]}}  # fmt: skip
    assert refusals({**policy_object("p", "ml", spec), "status": status}) == []


@pytest.mark.parametrize(
    ("interactive", "batch", "binding"),
    [
        ((100, 100), (100, 80), "batch"),  # interactive at 100%: batch binds
        ((100, 99), (100, 90), "interactive"),  # both exactly at target: the higher priority
        ((100, 98), None, "interactive"),  # batch judged nothing: it cannot bind
        (None, None, None),  # nothing judged: none binds
    ],
)
def test_the_binding_class_has_the_least_headroom_against_its_allowed_misses(
    interactive: tuple[int, int] | None, batch: tuple[int, int] | None, binding: str | None
) -> None:
    classes = {
        name: ClassSignals(name, slo_judged=seen[0], slo_met=seen[1])
        for name, seen in (("interactive", interactive), ("batch", batch))
        if seen is not None
    }
    assert slo_fields(judged(classes=classes), TWO_CLASSES)["bindingClass"] == binding
