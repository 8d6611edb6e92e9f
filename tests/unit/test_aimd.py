"""The AIMD fallback through the round (no step counters: the fit never forms): a legacy
end-to-end SLO moves as before, TTFT- and TPOT-only SLOs are read by their own p99s."""

from __future__ import annotations

from dataclasses import replace

import pytest
from batchpilot_operator.policy.memory import PolicyMemory
from batchpilot_operator.policy.round import decide
from batchpilot_operator.policy.types import Bounds, Fleet, Goal, ReplicaBounds, ReplicaState
from batchpilot_operator.policy.window import Window
from batchpilot_operator.signals import (
    Signals,
    misses_are_evidence,
    status_detail,
    traffic_status,
)
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig

E2E = Goal(Slo(e2e_s=1.0), Bounds(1, 64, 0.0, 200.0))
CURRENT = BatchingConfig(max_batch_size=8, batch_timeout_ms=10.0)


def signals(**values: object) -> Signals:
    base = dict(status="ok", window_s=30.0, requests=600.0, request_rate=20.0,
                kv_usage=0.2, mean_batch_size=8.0, pods=1)  # fmt: skip
    return Signals(**{**base, **values})  # type: ignore[arg-type]


def step(s: Signals, goal: Goal = E2E, current: BatchingConfig = CURRENT, **kw: object):
    return decide(s, current, goal, PolicyMemory(), **kw)  # type: ignore[arg-type]


def test_queueing_past_the_target_grows_the_batch_multiplicatively() -> None:
    d = step(signals(p99_latency_s=3.0, queue_wait_p99_s=2.5))
    assert d.action == "grow_batch" and d.config.max_batch_size == 12
    assert d.reason.startswith("AIMD (no step fit yet")
    assert d.memory.since_change == 0


def test_running_past_the_target_backs_off_and_remembers_a_ceiling() -> None:
    d = step(signals(p99_latency_s=1.5, queue_wait_p99_s=0.0))
    assert d.action == "backoff_batch" and d.config.max_batch_size == 5
    assert d.memory.ceiling == 8
    # where another pod can take the load, the ceiling caps the growth that follows
    queued = signals(p99_latency_s=3.0, queue_wait_p99_s=2.5)
    fleet = replace(E2E, replicas=ReplicaBounds(1, 4))
    again = decide(queued, d.config, fleet, d.memory, fleet=Fleet(1, 1), now=100.0)
    assert again.config.max_batch_size == 7
    # where none can, a queue loses the SLO at any batch under the load's: it grows past
    alone = decide(queued, d.config, E2E, d.memory)
    assert alone.action == "grow_batch" and alone.config.max_batch_size == 9


@pytest.mark.parametrize(
    ("changes", "cause"),
    [({"kv_usage": 0.95}, "KV usage 0.95 >= watermark"), ({"preemption_rate": 1.0}, "preempt")],
)
def test_kv_pressure_cuts_the_batch_whatever_the_headroom(changes: dict, cause: str) -> None:
    d = step(signals(p99_latency_s=0.1, **changes))
    assert d.action == "kv_guard" and d.config.max_batch_size == 6 and cause in d.reason


def test_headroom_with_requests_queueing_behind_full_batches_grows_additively() -> None:
    d = step(signals(p99_latency_s=0.5, queue_wait_p99_s=0.2))
    assert d.action == "grow_batch" and d.config.max_batch_size == 12


def test_ample_headroom_and_underfilled_batches_grow_the_timeout_without_a_ttft_target() -> None:
    quiet = signals(p99_latency_s=0.2, queue_wait_p99_s=0.0, mean_batch_size=2.0)
    grown = step(quiet)
    assert grown.action == "grow_timeout" and grown.config.batch_timeout_ms == 30.0
    with_ttft = Goal(Slo(ttft_s=1.0, e2e_s=1.0), E2E.bounds)
    assert step(quiet, with_ttft).action == "hold"  # a timeout only costs the first token


def test_windows_without_evidence_hold_and_say_why() -> None:
    thin = Signals(status="too_little_traffic", detail="only 3 requests finished")
    d = step(thin)
    assert d.action == "hold" and "only 3 requests finished" in d.reason
    assert d.memory.since_change == PolicyMemory().since_change  # capped, not moved


def test_a_config_outside_the_bounds_is_clamped_first() -> None:
    d = step(signals(p99_latency_s=0.1), current=BatchingConfig(max_batch_size=500))
    assert d.action == "clamp" and d.config.max_batch_size == 64


def test_a_tpot_only_slo_backs_off_on_its_own_p99() -> None:
    goal = Goal(Slo(tpot_s=0.02), E2E.bounds)
    d = step(signals(p99_latency_s=30.0, tpot_p99_s=0.05, ttft_p99_s=0.1), goal)
    assert (
        d.action == "backoff_batch" and d.reason.startswith("AIMD") and "tpot p99 50 ms" in d.reason
    )


def test_a_ttft_only_slo_grows_the_batch_when_requests_queue() -> None:
    goal = Goal(Slo(ttft_s=0.5), E2E.bounds)
    d = step(signals(p99_latency_s=30.0, ttft_p99_s=2.0, queue_wait_p99_s=1.9), goal)
    assert d.action == "grow_batch" and "ttft p99 2000 ms > target 500 ms" in d.reason


def test_a_queue_as_long_as_what_finished_is_evidence_for_a_slow_model() -> None:
    # SmolLM2 on two cores: 10 requests a window at batch 1, 25 waiting and more coming;
    # the demo's 30-request minimum no longer holds it
    assert traffic_status(10.0, 25.0, 0.0, min_requests=30) == "ok"
    slow = signals(requests=10.0, request_rate=0.33, arrival_rate=1.2, waiting=25.0,
                   p99_latency_s=20.0, queue_wait_p99_s=15.0, mean_batch_size=1.0)  # fmt: skip
    d = step(slow, Goal(Slo(e2e_s=10.0), E2E.bounds), BatchingConfig(max_batch_size=1))
    assert d.action == "grow_batch" and d.config.max_batch_size > 1


def test_a_full_batch_of_long_answers_is_judged_though_few_finish() -> None:
    # 64 long answers fill the batch and 5 of them finished in the window: load, not a
    # thin window (counting only what finished and waits held it)
    status = traffic_status(5.0, 0.0, 64.0)
    assert status == "ok"
    full = signals(status=status, requests=5.0, request_rate=0.17, running=64.0,
                   mean_batch_size=64.0, tpot_p99_s=0.08, ttft_p99_s=0.3)  # fmt: skip
    d = step(full, Goal(Slo(tpot_s=0.05), E2E.bounds), BatchingConfig(max_batch_size=64))
    assert d.action == "backoff_batch" and d.config.max_batch_size < 64
    assert "tpot p99 80 ms > target 50 ms while running" in d.reason


def test_requests_queueing_behind_a_full_batch_that_few_finish_grow_it() -> None:
    # 16 run, 2 wait behind them and 4 finished: the queue alone is shorter than what
    # finished, the batch in flight makes it evidence
    status = traffic_status(4.0, 2.0, 16.0)
    assert status == "ok"
    full = signals(status=status, requests=4.0, request_rate=0.13, waiting=2.0, running=16.0,
                   mean_batch_size=16.0, ttft_p99_s=2.0, queue_wait_p99_s=1.9)  # fmt: skip
    d = step(full, Goal(Slo(ttft_s=0.5), E2E.bounds), BatchingConfig(max_batch_size=16))
    assert d.action == "grow_batch" and d.config.max_batch_size > 16


def test_a_full_batch_with_nothing_finished_holds_and_says_why() -> None:
    # no request finished: no p99 to read, whatever runs; a hold that says so, not a crash
    status = traffic_status(0.0, 3.0, 64.0)
    detail = status_detail(status, 0.0, 3.0, 64.0, min_requests=50)
    busy = Signals(status=status, window_s=30.0, waiting=3.0, running=64.0, pods=1,
                   kv_usage=0.5, detail=detail)  # fmt: skip
    d = step(busy, current=BatchingConfig(max_batch_size=64))
    assert d.action == "hold" and d.config.max_batch_size == 64
    assert "too little traffic: no request finished in the window while 64 run" in d.reason


def test_a_spent_batch_under_queueing_scales_out_by_measured_throughput() -> None:
    goal = Goal(Slo(e2e_s=1.0), Bounds(1, 8), replicas=ReplicaBounds(1, 4))
    spent = signals(p99_latency_s=3.0, queue_wait_p99_s=2.5, arrival_rate=50.0)
    d = step(spent, goal, fleet=Fleet(1, 1), now=100.0)
    assert d.action == "hold" and d.scale is not None
    assert d.scale.action == "scale_out" and d.scale.replicas == 4
    assert "the batch is spent" in d.scale.reason


def test_a_growing_batch_that_cannot_carry_the_demand_scales_out_beside_it() -> None:
    # 20 finished a second by a pod always busy (it queues); 60 arrive and 300 wait:
    # even a batch grown 1.5x carries 24 at 80 % busy, so 60 + 300/30 = 70 a second
    # needs 3 pods now
    goal = Goal(Slo(e2e_s=1.0), Bounds(1, 64), replicas=ReplicaBounds(1, 4))
    behind = signals(p99_latency_s=3.0, queue_wait_p99_s=2.5, arrival_rate=60.0,
                     waiting=300.0)  # fmt: skip
    d = step(behind, goal, fleet=Fleet(1, 1), now=100.0)
    assert d.action == "grow_batch" and d.config.max_batch_size == 12
    assert d.scale is not None and d.scale.action == "scale_out" and d.scale.replicas == 3
    assert "even a batch grown 1.5x" in d.scale.reason
    # where the grown batch can carry it, the knobs go first
    light = signals(p99_latency_s=3.0, queue_wait_p99_s=2.5, arrival_rate=22.0)
    first = step(light, goal, fleet=Fleet(1, 1), now=100.0)
    assert first.scale is not None and first.scale.replicas == 1
    assert "knobs first" in first.scale.reason


# long prompts beside answers of at least 3 tokens (2 decode steps)
LONG_PROMPTS = {"prompt_tokens_p50": 1000.0, "prompt_tokens_p99": 3000.0,
                "output_tokens_p10": 3.0}  # fmt: skip
BUDGETS = Bounds(1, 64, 0.0, 200.0, min_prefill_budget=256, max_prefill_budget=4096)


def test_a_tpot_broken_while_running_cuts_the_prefill_budget_before_the_batch() -> None:
    goal = Goal(Slo(tpot_s=0.02), BUDGETS)
    broken = signals(tpot_p99_s=0.05, ttft_p99_s=0.1, **LONG_PROMPTS)
    d = step(broken, goal, BatchingConfig(max_batch_size=8, prefill_token_budget=2048))
    assert d.action == "set_budget" and d.config.prefill_token_budget == 512
    assert d.config.max_batch_size == 8 and "prefill budget 2048 -> 512" in d.reason
    # at the budget's floor the batch backs off as before
    floor = step(broken, goal, BatchingConfig(max_batch_size=8, prefill_token_budget=256))
    assert floor.action == "backoff_batch" and floor.config.prefill_token_budget == 256
    # prompts shorter than the cut budget: the budget splits nothing, the batch backs off
    short = step(replace(broken, prompt_tokens_p99=200.0), goal,
                 BatchingConfig(max_batch_size=8, prefill_token_budget=1024))  # fmt: skip
    assert short.action == "backoff_batch"
    # answers of 21 tokens or more take the 3000-token prompt in 150 tokens a step at
    # most, whatever the budget above it: a cut to 512 changes nothing
    longer = step(replace(broken, output_tokens_p10=21.0), goal,
                  BatchingConfig(max_batch_size=8, prefill_token_budget=2048))  # fmt: skip
    assert longer.action == "backoff_batch"
    # nor is the budget judged without the answers' lengths
    unknown = step(replace(broken, output_tokens_p10=None), goal,
                   BatchingConfig(max_batch_size=8, prefill_token_budget=2048))  # fmt: skip
    assert unknown.action == "backoff_batch"


def test_a_tpot_broken_in_underfilled_batches_holds_and_adds_a_pod() -> None:
    # steps of 1.5 decode rows in batch 8: the prompts beside them slow them, not the rows
    goal = Goal(Slo(tpot_s=0.02), BUDGETS, replicas=ReplicaBounds(1, 4))
    crowded = signals(tpot_p99_s=0.05, ttft_p99_s=0.1, mean_batch_size=1.5, pods=2,
                      **LONG_PROMPTS)  # fmt: skip
    at_floor = BatchingConfig(max_batch_size=8, prefill_token_budget=256)
    d = step(crowded, goal, at_floor, fleet=Fleet(2, 2), now=100.0)
    assert d.action == "hold" and d.config == at_floor and "underfilled" in d.reason
    assert d.scale is not None and (d.scale.action, d.scale.replicas) == ("scale_out", 3)
    # the step counters' decode rows, where the window has them, tell the rows
    full = replace(crowded, steps=100.0, step_decode_rows=800.0)
    assert step(full, goal, at_floor, fleet=Fleet(2, 2), now=100.0).action == "backoff_batch"


def test_pods_whose_steps_run_few_rows_scale_in_one_at_a_time() -> None:
    # a continuous pod serving long answers reads busy whatever its load: the busy share
    # asks for all four pods, the rows (2 a step of 64) allow one fewer
    goal = Goal(Slo(e2e_s=10.0), Bounds(1, 64),
                replicas=ReplicaBounds(1, 4, scale_down_stabilization_s=0.0))  # fmt: skip
    few = signals(p99_latency_s=2.0, queue_wait_p99_s=0.0, requests=240.0, request_rate=8.0,
                  arrival_rate=8.0, pods=4, mean_batch_size=2.0, busy_s_per_token=1.0,
                  tokens_per_s=4.0)  # fmt: skip
    current = BatchingConfig(max_batch_size=64)
    d = step(few, goal, current, fleet=Fleet(4, 4), now=1e4)
    assert d.scale is not None and (d.scale.action, d.scale.replicas) == ("scale_in", 3)
    assert "one pod fewer" in d.scale.reason
    # rows near the batch: no room on fewer pods
    busy = step(replace(few, mean_batch_size=40.0), goal, current, fleet=Fleet(4, 4), now=1e4)
    assert busy.scale is not None and busy.scale.replicas == 4


def test_a_ttft_broken_while_running_grows_the_budget_for_prompts_longer_than_it() -> None:
    goal = Goal(Slo(ttft_s=0.5), BUDGETS)
    slow = signals(ttft_p99_s=2.0, queue_wait_p99_s=0.0, **LONG_PROMPTS)
    d = step(slow, goal, BatchingConfig(max_batch_size=8, prefill_token_budget=512))
    assert d.action == "set_budget" and d.config.prefill_token_budget == 1024


def test_a_p99_past_its_target_with_the_attainment_met_holds() -> None:
    goal = Goal(Slo(tpot_s=0.02, attainment=0.95), BUDGETS)
    met = signals(tpot_p99_s=0.05, slo_judged=600.0, slo_met=580.0, **LONG_PROMPTS)
    d = step(met, goal, BatchingConfig(max_batch_size=8, prefill_token_budget=2048))
    assert d.action == "hold" and "attainment 0.967 >= 0.95: the SLO holds" in d.reason
    missed = replace(met, slo_met=540.0)
    assert step(missed, goal, BatchingConfig(prefill_token_budget=2048)).action == "set_budget"


def test_a_thin_window_whose_pods_judged_many_misses_is_evidence() -> None:
    goal = Goal(Slo(ttft_s=0.5, attainment=0.95), E2E.bounds)
    # 40 requests, too few for a p99 by count; 12 missed where 5 % allow 2: no chance
    thin = signals(status="too_little_traffic", requests=40.0, ttft_p99_s=2.0,
                   queue_wait_p99_s=1.9, slo_judged=40.0, slo_met=28.0,
                   slo_missed={"all": 12.0, "ttft": 12.0})  # fmt: skip
    assert misses_are_evidence(40, 12, goal.slo.allowed_miss_share)
    assert step(thin, goal).action == "grow_batch"
    # 3 of 40 is within chance at 5 %: the thin window holds
    chance = replace(thin, slo_met=37.0, slo_missed={"all": 3.0, "ttft": 3.0})
    assert not misses_are_evidence(40, 3, goal.slo.allowed_miss_share)
    assert step(chance, goal).action == "hold"


CHAT = Goal(Slo(ttft_s=1.0, tpot_s=0.02), Bounds(1, 64), replicas=ReplicaBounds(1, 4))


def test_a_wait_that_is_most_of_the_ttft_is_queueing_though_long_answers_hide_it() -> None:
    # The wait is nearly all of the TTFT p99 and a quarter of the end-to-end p99 of long
    # answers; no queue is left at the window's end.
    s = signals(ttft_p99_s=2.3, queue_wait_p99_s=2.2, p99_latency_s=9.0, tpot_p99_s=0.01)
    assert Window.of(s, CHAT.slo, None, None, ReplicaState()).queueing()
    # an end-to-end SLO reads the wait against its own p99, as before
    assert not Window.of(s, Slo(e2e_s=10.0), None, None, ReplicaState()).queueing()


def test_a_grown_batch_counts_for_nothing_where_the_tpot_is_outside_its_band() -> None:
    # 20 finished a second by a pod always busy; 22 arrive. With TPOT headroom a batch
    # grown 1.5x carries 24 at 80 % busy (knobs first); with TPOT past its band more
    # rows lengthen every step, so one pod carries 16 and two are needed now.
    queued = dict(ttft_p99_s=2.3, queue_wait_p99_s=2.2, p99_latency_s=9.0, arrival_rate=22.0)
    roomy = step(signals(tpot_p99_s=0.01, **queued), CHAT, fleet=Fleet(1, 1), now=100.0)
    assert roomy.scale is not None and roomy.scale.replicas == 1
    assert "knobs first" in roomy.scale.reason
    tight = step(signals(tpot_p99_s=0.018, **queued), CHAT, fleet=Fleet(1, 1), now=100.0)
    assert tight.action == "grow_batch"
    assert tight.scale is not None and tight.scale.replicas == 2
    assert "a grown batch adds nothing usable" in tight.scale.reason
