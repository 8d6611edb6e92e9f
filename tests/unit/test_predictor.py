"""The predictor: monotone where it must be, unstable where the pods cannot keep up, and the
function the benchmark compares against measured windows."""

from __future__ import annotations

import math

import pytest
from batchpilot_operator.policy.predictor import (
    Candidate,
    _queue,
    kv_capacity_tokens,
    predict,
    predict_config,
)
from batchpilot_operator.policy.step_model import fit
from batchpilot_operator.policy.types import ReplicaState
from batchpilot_operator.policy.window import Window
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from hypothesis import given
from hypothesis import strategies as st

from tests.support.policy import points, window

SLO = Slo(ttft_s=0.5, tpot_s=0.05)
MODEL = fit(points())
assert MODEL is not None


def predicted(rate: float, batch: int = 32, budget: int = 1024, pods: int = 1, **changes: object):
    w = Window.of(window(rate, **changes), SLO, None, None, ReplicaState())
    result = predict(w, MODEL, Candidate(batch, 0.0, budget, pods))
    assert result is not None
    return result


def test_more_pods_give_a_lower_ttft() -> None:
    ttfts = [predicted(20.0, pods=n).ttft_p99_s for n in (2, 3, 4, 6)]
    assert ttfts == sorted(ttfts, reverse=True) and ttfts[0] > ttfts[-1]


def test_a_bigger_budget_gives_a_lower_ttft_and_a_higher_tpot() -> None:
    # TPOT is a request's mean over its answer: the budget moves it where answers are
    # short enough that one prompt's chunk is a large part of their decode
    short = {"output_tokens_p10": 2.0, "output_tokens_p50": 4.0, "output_tokens_p90": 8.0,
             "output_tokens_p99": 16.0}  # fmt: skip
    runs = [predicted(10.0, budget=g, pods=3, **short) for g in (256, 512, 1024, 2048)]
    ttfts = [r.ttft_p99_s for r in runs]
    tpots = [r.tpot_p99_s for r in runs]
    assert ttfts == sorted(ttfts, reverse=True) and ttfts[0] > ttfts[-1]
    assert tpots == sorted(tpots) and tpots[0] < tpots[-1]


def test_a_pod_that_cannot_keep_up_misses_every_latency_target() -> None:
    over = predicted(20.0, pods=1)
    assert over.utilisation >= 1
    assert math.isinf(over.ttft_p99_s) and math.isinf(over.e2e_p99_s)
    assert over.attainment == 0.0
    assert "ttft p99 never" in over.describe(SLO)


def test_a_backlog_raises_the_predicted_ttft() -> None:
    calm = predicted(10.0, pods=3)
    behind = predicted(10.0, pods=3, waiting=300.0)
    assert behind.ttft_p99_s > calm.ttft_p99_s
    assert behind.attainment <= calm.attainment


def test_predict_config_needs_a_fit_at_the_windows_fleet_size() -> None:
    config = BatchingConfig(max_batch_size=32, batch_timeout_ms=0.0, prefill_token_budget=1024)
    got = predict_config(window(10.0, pods=1), config, 3, SLO, points(pods=1))
    assert got is not None and got.candidate.replicas == 3
    assert got.ttft_p99_s == predicted(10.0, pods=3).ttft_p99_s
    assert predict_config(window(10.0, pods=2), config, 3, SLO, points(pods=1)) is None
    # two windows fit a plane the rule does not trust yet: no prediction to judge it by
    assert predict_config(window(10.0, pods=1), config, 3, SLO, points(pods=1)[:2]) is None
    no_lengths = window(10.0, output_tokens_p50=None, output_tokens_p90=None,
                        output_tokens_p99=None, tokens_per_s=0.0)  # fmt: skip
    assert predict_config(no_lengths, config, 1, SLO, points()) is None


@given(
    rate=st.floats(0.5, 40.0),
    batch=st.integers(1, 64),
    budget=st.integers(64, 8192),
    pods=st.integers(1, 8),
)
def test_predictions_are_sane_and_more_pods_never_hurt(
    rate: float, batch: int, budget: int, pods: int
) -> None:
    one = predicted(rate, batch, budget, pods)
    more = predicted(rate, batch, budget, pods + 1)
    assert 0.0 <= one.attainment <= 1.0
    assert one.tpot_p99_s > 0 and one.ttft_p99_s > 0
    assert more.ttft_p99_s <= one.ttft_p99_s * (1 + 1e-9)
    assert more.attainment >= one.attainment - 1e-9


def test_the_chance_to_wait_follows_the_slots_a_pod_holds_at_its_load() -> None:
    # The steps lengthen with the rows: at 8 req/s a pod holds about 12 of its 64 slots,
    # though at the full step's pace it would be 0.68 busy; it all but never fills them.
    # Near its capacity it fills them often, and past it every request waits.
    def queue(rate: float):
        w = Window.of(window(rate), SLO, None, None, ReplicaState())
        q = _queue(w, MODEL, Candidate(64, 0.0, 1024, 1))
        assert q is not None
        return q

    light, near, past = queue(8.0), queue(11.0), queue(12.0)
    assert light.rho > 0.6 and light.rows < 64 / 4 and light.p_wait < 1e-6
    assert 0.01 < near.p_wait < 1 and near.rows > light.rows
    assert past.rho >= 1 and past.wait_tail(10.0) == 1.0


RAG = {"prompt_tokens_p50": 2500.0, "prompt_tokens_p90": 3500.0, "prompt_tokens_p99": 4000.0,
       "output_tokens_p50": 40.0, "output_tokens_p90": 70.0, "output_tokens_p99": 80.0}  # fmt: skip


@pytest.mark.parametrize(
    ("pods", "prompt_beside"),
    [(1, True), (2, True), (4, False), (8, False)],
)
def test_the_balancer_keeps_prompts_off_a_running_requests_pod_at_light_load(
    pods: int, prompt_beside: bool
) -> None:
    # rag's long prompts and short answers at 0.3 req/s a pod (3% busy): alone, a pod
    # computes a prompt beside more than one decode in a hundred; behind a balancer that
    # sends each request to a pod holding the fewest, an arrival joins a running
    # request's pod only where every pod holds one, which four pods at this load all but
    # never do, so the p99 TPOT is the decode step alone (the simulator's rag/bursts: 2.2
    # ms measured, where an even random split predicted 23 ms)
    w = Window.of(window(0.3 * pods, pods=pods, **RAG), SLO, None, None, ReplicaState())
    q = _queue(w, MODEL, Candidate(64, 0.0, 512, pods))
    assert q is not None
    decode_alone = float(q.tpot_tail.tpot_s.min())
    assert (q.quantile("tpot") > 1.05 * decode_alone) is prompt_beside


def test_the_kv_pool_is_the_pods_own_where_they_export_it() -> None:
    # the estimate (KV tokens per step over the fullest pod's peak usage: 3000 / 0.2)
    # reads a pool far smaller than it is where the mean step's context stands beside
    # that peak; the pods' own figure replaces it, and the predicted KV use scales with it
    estimated, exported = window(10.0), window(10.0, kv_pool_tokens=65536.0)
    assert kv_capacity_tokens(estimated) == pytest.approx(15000.0)
    assert kv_capacity_tokens(exported) == 65536.0
    uses = []
    for signals in (estimated, exported):
        w = Window.of(signals, SLO, None, None, ReplicaState())
        result = predict(w, MODEL, Candidate(32, 0.0, 1024, 1))
        assert result is not None and result.kv_use is not None
        uses.append(result.kv_use)
    assert uses[0] == pytest.approx(uses[1] * 65536 / 15000)
