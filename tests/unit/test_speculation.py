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
    measured_acceptance,
    per_token_acceptance,
    tokens_per_step,
)
from batchpilot_operator.policy.step_model import fit
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
