"""Speculative decoding's k: what a draft is worth at an acceptance, what the simulator
draws, what the predictor makes of it, and the chooser's k at low load and near
saturation."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from batchpilot_operator.policy.choice import knob_candidates
from batchpilot_operator.policy.memory import PolicyMemory
from batchpilot_operator.policy.predictor import Candidate, predict, predict_config
from batchpilot_operator.policy.round import decide
from batchpilot_operator.policy.speculation import (
    accepted_share,
    draft_length,
    draft_token_s,
    measured_acceptance,
    per_token_acceptance,
    tokens_per_step,
)
from batchpilot_operator.policy.step_model import StepModel, StepPoint, fit
from batchpilot_operator.policy.types import Bounds, Goal, ReplicaState
from batchpilot_operator.policy.window import Window
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import (
    Scenario,
    SimOptions,
    StepCurve,
    accepted_run,
    simulate,
)

from tests.support.policy import points, step_s, window

K = 4
CURRENT = BatchingConfig(max_batch_size=16, batch_timeout_ms=0.0, prefill_token_budget=1024)
# only k may move: the rows below are about k alone
BOUNDS = Bounds(16, 16, 0.0, 0.0, 1024, 1024, 0, K)
# a plane where a verified token costs half a decode row: speculation pays while the
# weights' fixed cost dominates (few rows) and costs capacity once rows do
PLANE = (0.004, 0.0002, 0.0001, 0.0000005)
MODEL = fit(points(plane=PLANE))
assert MODEL is not None


@pytest.mark.parametrize(
    ("a", "k", "expected"),
    [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 2, 1.75), (0.7, 0, 1.0), (0.7, 4, 2.7731)],
)
def test_tokens_per_step_is_one_plus_the_expected_accepted_run(
    a: float, k: int, expected: float
) -> None:
    assert tokens_per_step(a, k) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("a", [0.2, 0.7])
def test_the_simulators_accepted_runs_average_what_the_formula_says(a: float) -> None:
    rng = np.random.default_rng(0)
    runs = [accepted_run(rng, a, K) for _ in range(20000)]
    assert 1 + float(np.mean(runs)) == pytest.approx(tokens_per_step(a, K), rel=0.02)


@pytest.mark.parametrize("a", [0.05, 0.2, 0.5, 0.7, 0.95])
def test_the_per_token_acceptance_is_read_back_from_the_pods_ratio(a: float) -> None:
    assert per_token_acceptance(accepted_share(a, K), K) == pytest.approx(a, abs=1e-6)
    measured = Signals(status="ok", spec_draft_tokens_per_s=100.0,
                       spec_accepted_tokens_per_s=100.0 * accepted_share(a, K))  # fmt: skip
    assert measured_acceptance(measured, K) == pytest.approx(a, abs=1e-6)
    assert measured_acceptance(measured, 0) is None
    assert measured_acceptance(Signals(status="ok"), K) is None


def _simulated(k: int, a: float):
    scenario = Scenario("steady", 120.0, 3.0, output_tokens=48, prompt_tokens=(16, 64),
                        acceptance=a)  # fmt: skip
    config = replace(CURRENT, num_speculative_tokens=k)
    options = SimOptions(mode="continuous", config=config, goal=Goal(Slo(tpot_s=0.05)),
                         tune=False)  # fmt: skip
    return simulate(scenario, options, StepCurve.load(), seed=3)


def test_the_simulator_accepts_drafts_at_the_workloads_rate_and_k0_drafts_nothing() -> None:
    copy = _simulated(K, 0.7)
    drafted = sum(iv.spec_draft_tokens for iv in copy.intervals)
    accepted = sum(iv.spec_accepted_tokens for iv in copy.intervals)
    assert drafted > 0
    # drafts near the end of an answer are shorter than k: a little under the formula
    assert accepted / drafted == pytest.approx(accepted_share(0.7, K), rel=0.1)
    off = _simulated(0, 0.7)
    assert sum(iv.spec_draft_tokens for iv in off.intervals) == 0
    assert off.completed == copy.completed  # every request answered either way
    # the same answer in fewer steps
    assert sum(iv.steps for iv in copy.intervals) < sum(iv.steps for iv in off.intervals)


def _predicted(rate: float, k: int, acceptance: float | None):
    w = replace(Window.of(window(rate), Slo(tpot_s=0.05), None, None, ReplicaState()),
                acceptance=acceptance)  # fmt: skip
    got = predict(w, MODEL, Candidate(16, 0.0, 1024, 1, k))
    assert got is not None
    return got


def test_the_predictor_divides_tpot_by_the_tokens_a_step_gives() -> None:
    off = _predicted(2.0, 0, None)
    copy = _predicted(2.0, K, 0.8)
    assert copy.tpot_p99_s < off.tpot_p99_s
    # no acceptance measured: no gain, and the verified tokens still cost their step
    blind = _predicted(2.0, K, None)
    assert blind.step_s > off.step_s and blind.tpot_p99_s >= off.tpot_p99_s
    # a draft pays less at a low acceptance, and costs capacity where a row costs much
    free = _predicted(2.0, K, 0.2)
    assert copy.tpot_p99_s < free.tpot_p99_s
    assert free.per_pod_rps < off.per_pod_rps


def test_default_bounds_keep_the_grid_as_before_k() -> None:
    default = Bounds(1, 64, 0.0, 50.0, 256, 4096)
    assert {k for *_, k in knob_candidates(default, CURRENT, MODEL)} == {0}
    widened = {k for *_, k in knob_candidates(BOUNDS, replace(CURRENT, num_speculative_tokens=2),
                                              MODEL)}  # fmt: skip
    assert widened == {0, 2, K}


def _seen(rate: float, config: BatchingConfig, slo: Slo, acceptance: float) -> Signals:
    """A window on PLANE whose p99s are what the fit predicts for `config` (so that the
    round uses the fit), its pods' drafts accepted at `acceptance` a token where the
    config speculates."""
    k = config.num_speculative_tokens
    drafts = 100.0 if k else 0.0
    base = window(rate)
    assert base.steps is not None and base.step_decode_rows is not None
    assert base.step_prefill_tokens is not None and base.step_kv_tokens is not None
    mean_step = step_s(base.step_decode_rows / base.steps, base.step_prefill_tokens / base.steps,
                       base.step_kv_tokens / base.steps, PLANE)  # fmt: skip
    accepted = drafts * accepted_share(acceptance, k)
    signals = replace(base, step_seconds=base.steps * mean_step, spec_draft_tokens_per_s=drafts,
                      spec_accepted_tokens_per_s=accepted)  # fmt: skip
    got = predict_config(signals, config, 1, slo, points(plane=PLANE))
    assert got is not None
    p99s = {"ttft_p99_s": got.ttft_p99_s, "tpot_p99_s": got.tpot_p99_s,
            "p99_latency_s": got.e2e_p99_s}  # fmt: skip
    return replace(signals, **{name: v for name, v in p99s.items() if v != float("inf")})


# the decision table: (load, acceptance, k in force, TPOT target) -> k chosen, action
@pytest.mark.parametrize(
    ("rate", "acceptance", "k_in_force", "tpot_s", "k_chosen", "action"),
    [
        # copy-heavy, k = 0's TPOT near its target: a draft of 4 gives ~3.4 tokens a step
        (4.0, 0.8, 0, 0.01, K, "set_speculation"),
        # low load, everything met either way: no move (fewest knobs moved)
        (1.0, 0.8, 0, 0.05, 0, "hold"),
        # copy-heavy near saturation: the verified tokens cost the capacity k = 0 has
        (5.0, 0.8, K, 0.02, 0, "set_speculation"),
        # free-form: the drafts cost more than they give once rows add up
        (4.0, 0.2, K, 0.02, 0, "set_speculation"),
    ],
)
def test_the_chooser_decides_k_from_the_prediction(
    rate: float, acceptance: float, k_in_force: int, tpot_s: float, k_chosen: int, action: str
) -> None:
    slo = Slo(ttft_s=2.0, tpot_s=tpot_s)
    current = replace(CURRENT, num_speculative_tokens=k_in_force)
    # seen under an earlier k
    memory = PolicyMemory(points=points(plane=PLANE), acceptance=acceptance)
    decision = decide(_seen(rate, current, slo, acceptance), current, Goal(slo, BOUNDS), memory)
    assert decision.config.num_speculative_tokens == k_chosen, decision.reason
    assert decision.action == action
    if action == "set_speculation":
        assert f"k {k_in_force} -> {k_chosen}" in decision.reason
    assert decision.memory.acceptance == pytest.approx(acceptance, abs=1e-6)


# The draft length from measured quantities: a step of 1.5 ms fixed and 0.2 ms a token
# (a row's newest and each prompt or draft token alike), k = 4 in force. A row's step at
# k is the measured one with k - 4 draft tokens a row more: at 8 rows 13.5 ms less 1.6 ms
# a draft token less; at 1 row 2.5 ms less 0.2 ms.
PRICED = StepModel(fixed_s=0.0015, per_row_s=0.0002, per_prefill_s=0.0002, per_kv_s=0.0,
                   points=3, used=("prefill",), trusted=False, flat=("rows", "kv"))  # fmt: skip
BUSY = StepPoint(rows=8, prefill=8 * K + 20, kv=1000, step_s=0.0015 + 0.0002 * (8 + 8 * K + 20))
IDLE = StepPoint(rows=1, prefill=1 * K, kv=100, step_s=0.0015 + 0.0002 * (1 + K))


@pytest.mark.parametrize(
    ("name", "a", "point", "low", "high", "k"),
    [
        # 1/7.1 ms = 141 tokens/s a row at k 0, 1.2/8.7 ms = 138 at k 1, 1.25/13.5 = 93 at 4
        ("free-form at 8 rows: the drafts cost more than they give", 0.2, BUSY, 0, K, 0),
        # k 2: 2.19/10.3 ms = 213, k 3: 2.53/11.9 = 213 (the most), k 1: 1.7/8.7 = 195; the
        # shortest within 5 % of the most is k 2
        ("copy-heavy at 8 rows: the shortest draft near the most", 0.7, BUSY, 0, K, 2),
        # the fixed cost dominates one row's step: k 1's 1.2 tokens in 1.9 ms (632/s) beat
        # k 0's one in 1.7 ms (588/s) by more than 5 %
        ("free-form at one row: one draft token pays for its step", 0.2, IDLE, 0, K, 1),
        # within the bounds: k 3 (1.248/11.9 ms = 105) over k 4 (93)
        ("the bounds: the best k inside them", 0.2, BUSY, 3, K, 3),
    ],
)
def test_the_draft_length_gives_a_row_the_most_tokens_a_second(
    name: str, a: float, point: StepPoint, low: int, high: int, k: int
) -> None:
    draft = draft_length(a, PRICED, point, K, low, high)
    assert draft.k == k, draft.why
    assert f"acceptance {a:.2f}" in draft.why and "200 us" in draft.why


@pytest.mark.parametrize(
    ("name", "a", "model", "point"),
    [
        ("no acceptance measured", None, PRICED, BUSY),
        ("no step fit", 0.2, None, BUSY),
        ("no operating point", 0.2, PRICED, None),
        (
            "neither rows nor prompt tokens varied: no token price",
            0.2,
            replace(PRICED, flat=("rows", "prefill", "kv"), used=()),
            BUSY,
        ),
    ],
)
def test_with_nothing_measured_the_draft_length_is_kept(
    name: str, a: float | None, model: StepModel | None, point: StepPoint | None
) -> None:
    draft = draft_length(a, model, point, K, 0, K)
    assert draft.k == K and draft.why == ""
    # kept inside the bounds all the same
    assert draft_length(a, model, point, K, 0, 2).k == 2


def test_a_rows_price_covers_its_draft_where_prompt_tokens_did_not_vary() -> None:
    """A row at k = 4 computes five tokens: its price over five is a draft token's."""
    rows_only = replace(PRICED, per_row_s=0.001, per_prefill_s=0.0, used=("rows",),
                        flat=("prefill", "kv"))  # fmt: skip
    assert draft_token_s(rows_only, K) == pytest.approx(0.0002)
    assert draft_token_s(PRICED, K) == pytest.approx(0.0002)
