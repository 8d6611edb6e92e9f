"""The round: the predictive choice (fewest pods, KV as a constraint, within the bounds) and
when it falls back to the table, with the reason saying why."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from batchpilot_operator.policy.choice import choose, knob_candidates
from batchpilot_operator.policy.memory import FitErrors, PolicyMemory
from batchpilot_operator.policy.predictor import Candidate, _queue
from batchpilot_operator.policy.replicas import observe
from batchpilot_operator.policy.round import decide
from batchpilot_operator.policy.step_model import StepModel, StepPoint, fit, point_of
from batchpilot_operator.policy.types import Bounds, Fleet, Goal, ReplicaBounds, ReplicaState
from batchpilot_operator.policy.window import Window, arrivals_now, forecast
from batchpilot_operator.signals import ClassSignals
from batchpilot_operator.slo import Slo, SloClass
from batchpilot_server.batching_config import BatchingConfig
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.policy import as_predicted, points, trusted, window

SLO = Slo(ttft_s=0.5, tpot_s=0.05)
BOUNDS = Bounds(1, 64, 0.0, 50.0, 256, 4096)
GOAL = Goal(SLO, BOUNDS, replicas=ReplicaBounds(1, 6, scale_down_stabilization_s=0.0))
CURRENT = BatchingConfig(max_batch_size=16, batch_timeout_ms=0.0, prefill_token_budget=1024)


def seen(rate: float, pods: int = 1, **changes: object):
    """A window the fit predicts well for the config in force."""
    return as_predicted(window(rate, pods=pods, **changes), CURRENT, SLO)


def test_one_pod_is_chosen_where_one_suffices() -> None:
    decision = decide(seen(2.0, pods=3), CURRENT, GOAL, trusted(3), fleet=Fleet(3, 3), now=1e4)
    assert decision.prediction is not None
    assert decision.prediction.candidate.replicas == 1
    assert decision.reason.startswith("predicted (step fit")
    assert decision.scale is not None and decision.scale.replicas == 1
    assert decision.scale.action == "scale_in" and "on 1 pod(s): predicted" in decision.scale.reason


def test_more_pods_are_chosen_where_one_cannot_carry_the_load() -> None:
    # arrivals past what one pod finishes, and a queue growing: the fit says it never drains
    growing = seen(25.0, requests=1200.0, waiting=5.0)
    decision = decide(growing, CURRENT, GOAL, trusted(), fleet=Fleet(1, 1), now=1e4)
    assert decision.prediction is not None and decision.prediction.candidate.replicas > 1
    assert decision.prediction.attainment >= 1 - 0.5 * SLO.allowed_miss_share
    assert decision.scale is not None and decision.scale.action == "scale_out"
    assert "on 4 pod(s): predicted" in decision.scale.reason


def test_the_kv_watermark_excludes_candidates() -> None:
    roomy = decide(seen(3.0, kv_usage=None), CURRENT, GOAL, trusted(), fleet=Fleet(1, 1))
    # A pool that 3000 tokens fill to 0.8: a handful of chat rows passes the watermark.
    tight = decide(seen(3.0, kv_usage=0.8), CURRENT, GOAL, trusted(), fleet=Fleet(1, 1))
    assert roomy.prediction is not None and tight.prediction is not None
    assert roomy.prediction.kv_use is None
    assert tight.prediction.kv_use is not None and tight.prediction.kv_use <= 0.9
    assert tight.prediction.candidate.replicas > roomy.prediction.candidate.replicas


def test_the_kv_watermark_holds_even_where_no_candidate_meets_the_slo() -> None:
    # Far more than six pods carry, and a pool that a few chat rows fill: no candidate
    # meets the SLO, and the best there is stays under the watermark all the same.
    over = seen(200.0, kv_usage=0.8, requests=6000.0, waiting=500.0)
    decision = decide(over, CURRENT, GOAL, trusted(), fleet=Fleet(1, 1), now=1e4)
    assert decision.prediction is not None and "the best there is" in decision.reason
    assert decision.prediction.kv_use is not None and decision.prediction.kv_use <= 0.9


def test_where_every_candidate_misses_everything_the_choice_moves_to_the_most_capacity() -> None:
    # One pod that cannot grow, far past what any batch carries: every candidate predicts
    # attainment 0, and the config in force is no better than the rest; the choice takes
    # the one that carries the most rather than holding.
    fixed = replace(GOAL, replicas=None)
    small = BatchingConfig(max_batch_size=8, batch_timeout_ms=0.0, prefill_token_budget=1024)
    over = seen(200.0, requests=3000.0, waiting=400.0, kv_usage=None)
    decision = decide(over, small, fixed, trusted())
    assert decision.prediction is not None and decision.prediction.attainment == 0.0
    assert "the best there is" in decision.reason
    assert decision.config.max_batch_size > small.max_batch_size


def test_a_fit_whose_rows_look_free_reaches_no_further_than_the_rows_it_saw() -> None:
    # A fit whose points held up to 16 decode rows (tests/support/policy.py's) describes
    # steps up to there, and where the rows look free, no further: from batch 8, no
    # candidate past 16 (a priced fit would reach twice the rows seen, 32).
    busy = seen(25.0, requests=1500.0, waiting=5.0, kv_usage=None)  # no KV bound either
    same = point_of(busy)
    assert same is not None
    flat = tuple(replace(p, step_s=same.step_s) for p in points())  # every step the same
    memory = PolicyMemory(points=flat)
    small = BatchingConfig(max_batch_size=8, batch_timeout_ms=0.0, prefill_token_budget=1024)
    decision = decide(busy, small, GOAL, memory, fleet=Fleet(1, 1), now=1e4)
    assert decision.reason.startswith("predicted")
    assert "rows, prefill, kv cost nothing" in decision.reason
    assert decision.config.max_batch_size == 16  # past the rows seen, "free" is a guess
    assert decision.prediction is not None and decision.prediction.candidate.replicas >= 2


def test_preemptions_exclude_the_batch_in_force_and_above() -> None:
    decision = decide(seen(2.0, preemption_rate=0.5), CURRENT, GOAL, trusted())
    assert decision.config.max_batch_size < CURRENT.max_batch_size


def test_the_fallback_steps_until_the_fit_is_trusted_and_says_so() -> None:
    queueing = window(25.0, p99_latency_s=9.0, queue_wait_p99_s=8.0, ttft_p99_s=8.0,
                      waiting=200.0, requests=600.0)  # fmt: skip
    young = PolicyMemory(points=points()[:2])
    decision = decide(queueing, CURRENT, GOAL, young)
    assert decision.reason.startswith("fallback (step fit not trusted yet")
    assert decision.action == "grow_batch" and decision.prediction is None
    none_yet = decide(replace(queueing, steps=None), CURRENT, GOAL, PolicyMemory())
    assert none_yet.reason.startswith("fallback (no step fit yet")


def test_the_fallback_takes_over_after_a_large_prediction_error_and_says_so() -> None:
    # The pods measure a TTFT twenty times what the fit predicts for the config in force.
    wrong = window(2.0, ttft_p99_s=2.0, tpot_p99_s=0.2)
    memory = trusted()
    for _ in range(2):
        decision = decide(wrong, CURRENT, GOAL, memory)
        memory = decision.memory
    assert decision.reason.startswith("fallback (the step fit's recent error")
    assert len(memory.errors.values) == 2 and min(memory.errors.values) > GOAL.params.max_error
    # A fit that predicts the window well is used.
    good = decide(seen(2.0), CURRENT, GOAL, trusted())
    assert good.reason.startswith("predicted")


def test_a_fit_of_another_form_starts_its_own_errors() -> None:
    errors = FitErrors().of(("", "rows"), 0.1).of(("", "rows"), 0.2)
    assert errors.values == (0.1, 0.2) and errors.of(("", "rows"), None) == errors
    # a refit through other terms is another model: its error is not hidden behind the
    # median of the one it replaced
    refit = errors.of(("", "prefill"), 1.4)
    assert refit.values == (1.4,) and refit.median() == 1.4
    # until a window judges the refit, the errors of the fit it replaced are the evidence
    assert errors.of(("", "prefill"), None) == errors
    assert FitErrors().median() is None


def test_the_memory_has_one_writer_and_since_change_restarts_on_any_move() -> None:
    first = decide(seen(2.0, pods=3), CURRENT, GOAL, trusted(3), fleet=Fleet(3, 3), now=1e4)
    assert first.scale is not None and first.scale.replicas == 1
    assert first.config == CURRENT and first.memory.since_change == 0  # the fleet moved
    held = decide(seen(2.0), CURRENT, GOAL, first.memory, fleet=Fleet(1, 1), now=1e4 + 30)
    assert held.action == "hold" and held.scale is not None and held.scale.action == "hold"
    assert held.memory.since_change == 1


@settings(max_examples=40, deadline=None)
@given(
    rate=st.floats(0.1, 60.0),
    low=st.integers(1, 32),
    span=st.integers(0, 32),
    budget_low=st.integers(64, 2048),
    budget_span=st.integers(0, 4096),
    batch=st.integers(1, 128),
    budget=st.integers(1, 10000),
    trusting=st.booleans(),
)
def test_the_chosen_config_is_always_within_the_bounds(
    rate: float, low: int, span: int, budget_low: int, budget_span: int, batch: int,
    budget: int, trusting: bool,
) -> None:  # fmt: skip
    bounds = Bounds(low, low + span, 0.0, 20.0, budget_low, budget_low + budget_span)
    goal = replace(GOAL, bounds=bounds)
    current = BatchingConfig(max_batch_size=batch, prefill_token_budget=budget)
    memory = trusted() if trusting else PolicyMemory()
    config = current
    for _ in range(2):  # a clamp first where the config in force is outside
        decision = decide(window(rate), config, goal, memory, fleet=Fleet(1, 1), now=1e4)
        config, memory = decision.config, decision.memory
    assert bounds.contains(config)
    assert decision.scale is not None
    assert 1 <= decision.scale.replicas <= 6


def test_the_reach_counts_from_the_batch_in_force_where_steps_held_fewer_rows() -> None:
    # A slow model's steps hold few decode rows (prefill steps hold none): from batch 8
    # the choice may still double it.
    few_rows = tuple(replace(p, rows=min(p.rows, 3.0)) for p in points())
    model = fit(few_rows)
    assert model is not None and model.max_rows == 3.0
    batches = {b for b, *_ in knob_candidates(BOUNDS, CURRENT, model)}
    assert max(batches) == 2 * CURRENT.max_batch_size


def test_a_fit_that_found_rows_free_reaches_no_further_than_the_batch_in_force() -> None:
    # Few decode rows a step on a slow model (SmolLM2 on 2 cores, rows 1-3): their cost
    # hides in the noise of a 30 ms step. Where the prompt tokens are priced, a row takes
    # their price (test_step_model.py); where nothing is, batch 16 would be "free"
    # capacity, twice batch 8's: the demo's chooser called one pod 47% busy under a
    # surge one pod could not carry.
    # (the noise reads as a step a little shorter with more rows: the fit prices them 0)
    flat = [StepPoint(r, p, 600 * r, 0.032 - 0.0002 * r, 1)
            for r, p in ((1, 10), (2, 80), (3, 160), (1.5, 30))]  # fmt: skip
    model = fit(flat)
    assert model is not None and model.used == () and model.trusted
    batches = {b for b, *_ in knob_candidates(BOUNDS, CURRENT, model)}
    assert max(batches) == CURRENT.max_batch_size


def test_the_fit_is_judged_at_the_arrivals_the_window_saw_not_the_forecast() -> None:
    # Arrivals rose 2 -> 8 req/s over the last rounds: the forecast is far above the
    # window's own 8 req/s. The window's p99s are what the fit predicts at 8 req/s.
    now = 1e4
    rising = ReplicaState(arrivals=((now - 90, 2.0), (now - 60, 4.0), (now - 30, 6.0)))
    memory = replace(trusted(), replicas=rising)
    assert forecast(8.0, observe(rising, seen(8.0), Fleet(1, 1), now)).rps >= 12.0
    decision = decide(seen(8.0), CURRENT, GOAL, memory, fleet=Fleet(1, 1), now=now)
    assert decision.memory.errors.values and decision.memory.errors.values[-1] < 0.01
    assert decision.reason.startswith("predicted")


@dataclass(frozen=True)
class Arrivals:
    name: str
    before: float  # req/s the last three rounds measured, 15 s apart
    older: float  # req/s over the window's newer half but its newest 15 s
    newest: float  # req/s over its newest 15 s
    now_rps: float  # the demand the round sizes for
    pods: int  # from a fleet of two, the stabilization spent


# The demo's cadence: a round every 15 s over a 90 s window, whose arrival rate spans
# its newer 45 s. On this fit one pod carries 2 req/s (and 6), two 8 to 14.
ARRIVALS = [
    Arrivals("quiet throughout: one pod carries it", 2.0, 2.0, 2.0, 2.0, 1),
    # The half's mean is (30 x 2 + 15 x 10) / 45 = 4.67 req/s, which one pod carries; the
    # newest interval's 10 do not fit it, and the median rise of the rounds is none.
    Arrivals("the newest interval surged: no scale-in", 2.0, 2.0, 10.0, 10.0, 2),
    # (30 x 12 + 15 x 2) / 45 = 8.67 req/s: the fall counts once the window shows it.
    Arrivals("the newest interval fell: the window's arrivals stand", 12.0, 12.0, 2.0, 8.67, 2),
]


@pytest.mark.parametrize("case", ARRIVALS, ids=[c.name for c in ARRIVALS])
def test_a_decision_sizes_for_the_newest_intervals_arrivals_where_higher(case: Arrivals) -> None:
    now, interval, span = 1e4, 15.0, 45.0
    half = (case.older * (span - interval) + case.newest * interval) / span
    signals = seen(half, pods=2, window_s=2 * span)
    history = tuple((now - k * interval, case.before) for k in (3, 2, 1))
    memory = replace(trusted(2), replicas=ReplicaState(arrivals=history, since=now - 1000))
    decision = decide(signals, CURRENT, GOAL, memory, fleet=Fleet(2, 2), now=now)
    assert decision.reason.startswith("predicted")
    assert decision.scale is not None and decision.scale.replicas == case.pods, decision.reason
    window = Window.of(signals, SLO, Fleet(2, 2), GOAL.replicas, decision.memory.replicas)
    assert window.forecast.now_rps == pytest.approx(case.now_rps, abs=0.01)


def test_a_window_of_two_intervals_sizes_for_its_newer_half_alone() -> None:
    # The newer half is the newest interval (the CRD's default 60 s window at 30 s): no
    # part of it is shared with the round before, so its rate is the demand as it is.
    history = ReplicaState(arrivals=((1e4 - 30, 2.0), (1e4, 10.0)))
    assert arrivals_now(window(10.0, window_s=60.0), history) == 10.0


# SLO classes on shared pods (bench/slo_classes.py): chat at TTFT 1 s beside a few percent
# of long-prompt batch requests with a 300-s end-to-end target, on the shared pool's fit
# (rows and prompt tokens priced as one token) at 8 req/s over 3 pods.
INTERACTIVE = SloClass("interactive", priority=10, ttft_s=1.0, tpot_s=0.0141, attainment=0.95)
BATCH = SloClass("batch", priority=0, e2e_s=300.0, attainment=0.95)
CLASSED = Slo(ttft_s=1.0, tpot_s=0.0141, attainment=0.95, classes=(INTERACTIVE, BATCH))
CLASSED_GOAL = Goal(CLASSED, Bounds(1, 64, 0.0, 200.0, 256, 2048), replicas=ReplicaBounds(1, 4))
SHARED_FIT = StepModel(fixed_s=0.00138, per_row_s=0.000214, per_prefill_s=0.000214,
                       per_kv_s=0.0, points=8, used=("rows",), trusted=True,
                       together=("prefill", "kv"), max_rows=12.0)  # fmt: skip
SHARED_CONFIG = BatchingConfig(max_batch_size=64, batch_timeout_ms=0.0, prefill_token_budget=256)


def lengths(kind: str, p10: float, p50: float, p90: float, p99: float) -> dict[str, float]:
    return {
        f"{kind}_tokens_p{q}": v
        for q, v in zip((10, 50, 90, 99), (p10, p50, p90, p99), strict=True)
    }


def shared_window(**class_lengths: bool) -> Window:
    """The shared pool's window: 97 % chat, 3 % batch prompts of 2000-6000 tokens, whose
    totals' p90 and p99 the batch prompts lift; each class's lengths where
    `class_lengths[name]` (default: both; False: an older server's, without them)."""
    classes = {
        "interactive": ClassSignals(
            "interactive", slo_judged=466.0, slo_met=466.0,
            **lengths("prompt", 424, 1101, 1853, 2028), **lengths("output", 70, 239, 435, 504),
        ),
        "batch": ClassSignals(
            "batch", slo_judged=14.0, slo_met=14.0,
            **lengths("prompt", 2765, 4352, 5786, 6108), **lengths("output", 86, 203, 294, 375),
        ),
    }  # fmt: skip
    classes = {
        name: c if class_lengths.get(name, True) else replace(c, **{
            k: None for k in (*lengths("prompt", 0, 0, 0, 0), *lengths("output", 0, 0, 0, 0))
        })
        for name, c in classes.items()
    }  # fmt: skip
    signals = replace(
        window(8.0, pods=3, kv_usage=None, **lengths("prompt", 427, 1125, 2000, 5500),
               **lengths("output", 70, 237, 434, 504)),
        classes=classes,
    )  # fmt: skip
    return Window.of(signals, CLASSED, Fleet(3, 3), CLASSED_GOAL.replicas, ReplicaState())


def test_each_class_is_judged_by_its_own_lengths_so_the_shared_pool_holds() -> None:
    # Judged against the interactive class's TTFT, the batch class's long prompts (and the
    # totals' grid, which spreads them over the 90th-99th slice) spend the whole margin:
    # a fourth pod. Each class on its own lengths: 3 pods meet both with the margin.
    chosen = choose(shared_window(), SHARED_FIT, SHARED_CONFIG, CLASSED_GOAL)
    assert chosen.prediction is not None and chosen.prediction.candidate.replicas == 3
    assert "every class meets its attainment with the margin" in chosen.reason
    assert "class interactive binds" in chosen.reason  # the least room
    predicted = {c.name: c for c in chosen.prediction.classes}
    assert predicted["interactive"].attainment >= 1 - 0.5 * 0.05
    assert predicted["batch"].p99s["e2e"] < 300.0


def test_a_class_judged_without_its_own_lengths_keeps_the_totals() -> None:
    # an older server's window (no lengths by class): the totals against the top-level
    # targets, as before classes were judged apart, and that takes the fourth pod
    chosen = choose(shared_window(batch=False), SHARED_FIT, SHARED_CONFIG, CLASSED_GOAL)
    assert chosen.prediction is not None and chosen.prediction.candidate.replicas == 4
    assert chosen.prediction.classes == ()
    assert "meets attainment 0.95 with the margin" in chosen.reason


def test_a_policy_without_classes_judges_the_totals_whatever_the_window_carries() -> None:
    window_ = shared_window()
    plain = replace(CLASSED, classes=())
    alone = choose(replace(window_, slo=plain), SHARED_FIT, SHARED_CONFIG,
                   replace(CLASSED_GOAL, slo=plain))  # fmt: skip
    old = choose(shared_window(interactive=False, batch=False), SHARED_FIT, SHARED_CONFIG,
                 CLASSED_GOAL)  # fmt: skip
    assert alone.prediction is not None and alone.prediction.classes == ()
    assert (alone.reason, alone.config) == (old.reason, old.config)


def test_a_class_missing_its_own_target_binds_and_is_named() -> None:
    # a batch e2e target its long prompts cannot meet on any pod count: the best there is
    tight = replace(BATCH, e2e_s=1.0)
    slo = replace(CLASSED, classes=(INTERACTIVE, tight))
    window_ = replace(shared_window(), slo=slo)
    chosen = choose(window_, SHARED_FIT, SHARED_CONFIG, replace(CLASSED_GOAL, slo=slo))
    assert chosen.prediction is not None and chosen.prediction.candidate.replicas == 4
    verdict = (
        "no candidate on up to 4 pod(s) meets every class's attainment; class batch binds: "
        "predicted attainment 0.005 against 0.95 (e2e 1000 ms)"
    )
    assert verdict in chosen.reason, chosen.reason


def test_the_classes_share_the_totals_queue_and_judge_their_own_tails() -> None:
    candidate = Candidate(64, 0.0, 256, 3)
    classed = _queue(shared_window(), SHARED_FIT, candidate)
    totals = _queue(shared_window(interactive=False, batch=False), SHARED_FIT, candidate)
    assert classed is not None and totals is not None and totals.classes == ()
    # the slots, steps and waits: every class's requests together
    assert (classed.rho, classed.p_wait, classed.step_s) == (
        totals.rho,
        totals.p_wait,
        totals.step_s,
    )
    own = {load.name: queue for load, queue in classed.classes}
    assert own["interactive"].met(INTERACTIVE.stated) > totals.met(CLASSED.stated)
    assert own["batch"].miss("ttft", 1.0) > own["interactive"].miss("ttft", 1.0)
