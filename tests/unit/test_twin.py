"""The digital twin: the real continuous scheduler under the fitted plane gives the right
direction and size on hand-made windows, and the same answer for the same seed."""

from __future__ import annotations

from batchpilot_operator.policy.predictor import Candidate, Prediction
from batchpilot_operator.policy.step_model import fit
from batchpilot_operator.policy.twin import simulate
from batchpilot_operator.policy.types import ReplicaState
from batchpilot_operator.policy.window import Window
from batchpilot_operator.slo import Slo

from tests.support.policy import points, step_s, window

SLO = Slo(ttft_s=0.5, tpot_s=0.05)
MODEL = fit(points())
assert MODEL is not None

# a short run keeps the file under a few seconds; the window's lengths are chat-like
# (prompts up to 2,000 tokens, answers up to 400)
RUN_S = 20.0


def twin(
    rate: float, batch: int = 32, budget: int = 1024, pods: int = 1, seed: int = 0, **changes
) -> Prediction:
    w = Window.of(window(rate, **changes), SLO, None, None, ReplicaState())
    got = simulate(w, MODEL, Candidate(batch, 0.0, budget, pods), duration_s=RUN_S, seed=seed)
    assert got is not None
    return got


def test_under_light_load_the_p99_ttft_is_about_one_prefill_step() -> None:
    # a budget above the longest prompt: the p99 prompt (2,000 tokens) is one step
    light = twin(0.5, budget=4096)
    prefill = step_s(0, 2000, 2000)
    assert 0.5 * prefill <= light.ttft_p99_s <= 2 * prefill
    assert light.attainment == 1.0


def test_arrivals_past_capacity_collapse_the_attainment() -> None:
    calm, over = twin(5.0), twin(40.0)
    assert calm.attainment >= 0.99
    assert over.attainment < 0.2 and over.ttft_p99_s > 10 * SLO.ttft_s  # type: ignore[operator]


def test_a_backlog_raises_the_ttft_and_more_pods_drain_it() -> None:
    calm, behind = twin(5.0), twin(5.0, waiting=100.0)
    assert behind.ttft_p99_s > 10 * calm.ttft_p99_s
    assert behind.attainment < calm.attainment
    # the backlog's oldest waited as long on any fleet (it formed at the same arrivals):
    # more pods serve it sooner, so more of the window meets the targets
    assert twin(5.0, pods=3, waiting=100.0).attainment > behind.attainment + 0.2


def test_a_smaller_budget_lowers_the_tpot_and_raises_the_ttft() -> None:
    small, big = twin(8.0, budget=256), twin(8.0, budget=4096)
    assert small.tpot_p99_s < big.tpot_p99_s
    assert small.ttft_p99_s > big.ttft_p99_s


def test_the_run_is_the_same_for_a_seed() -> None:
    assert twin(8.0) == twin(8.0)
    assert twin(8.0, seed=1).ttft_p99_s != twin(8.0).ttft_p99_s


def test_no_lengths_no_prediction() -> None:
    bare = window(5.0, output_tokens_p50=None, output_tokens_p90=None, output_tokens_p99=None,
                  tokens_per_s=0.0)  # fmt: skip
    w = Window.of(bare, SLO, None, None, ReplicaState())
    assert simulate(w, MODEL, Candidate(8, 0.0, 256, 1)) is None
