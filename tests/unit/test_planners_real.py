"""bench/planners_real.py's real-fleet tick: recorded `/metrics` text in, the baselines'
inputs (Dynamo's tick request, KEDA's signals and decision) out."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from batchpilot_operator.policy.types import Fleet, ReplicaState

# bench/ is scripts, not a package: its modules import each other by bare name
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planners_real as pr

# A tiny server's /metrics, the series the tick reads, at the interval's start and end.
BEFORE = """\
# TYPE batchpilot_requests_arrived_total counter
batchpilot_requests_arrived_total{mode="continuous",model="tiny"} 10.0
# TYPE batchpilot_request_prompt_tokens histogram
batchpilot_request_prompt_tokens_count{mode="continuous",model="tiny"} 8.0
batchpilot_request_prompt_tokens_sum{mode="continuous",model="tiny"} 240.0
# TYPE batchpilot_request_generation_tokens histogram
batchpilot_request_generation_tokens_count{mode="continuous",model="tiny"} 8.0
batchpilot_request_generation_tokens_sum{mode="continuous",model="tiny"} 256.0
# TYPE batchpilot_step_duration_seconds histogram
batchpilot_step_duration_seconds_count{mode="continuous",model="tiny"} 100.0
batchpilot_step_duration_seconds_sum{mode="continuous",model="tiny"} 2.0
# TYPE batchpilot_step_decode_rows_total counter
batchpilot_step_decode_rows_total{mode="continuous",model="tiny"} 300.0
# TYPE batchpilot_step_prefill_tokens_total counter
batchpilot_step_prefill_tokens_total{mode="continuous",model="tiny"} 240.0
# TYPE batchpilot_step_kv_tokens_total counter
batchpilot_step_kv_tokens_total{mode="continuous",model="tiny"} 9000.0
# TYPE batchpilot_requests_waiting gauge
batchpilot_requests_waiting{mode="continuous",model="tiny"} 0.0
"""
NOW = """\
# TYPE batchpilot_requests_arrived_total counter
batchpilot_requests_arrived_total{mode="continuous",model="tiny"} 60.0
# TYPE batchpilot_request_prompt_tokens histogram
batchpilot_request_prompt_tokens_count{mode="continuous",model="tiny"} 48.0
batchpilot_request_prompt_tokens_sum{mode="continuous",model="tiny"} 1440.0
# TYPE batchpilot_request_generation_tokens histogram
batchpilot_request_generation_tokens_count{mode="continuous",model="tiny"} 48.0
batchpilot_request_generation_tokens_sum{mode="continuous",model="tiny"} 1536.0
# TYPE batchpilot_step_duration_seconds histogram
batchpilot_step_duration_seconds_count{mode="continuous",model="tiny"} 300.0
batchpilot_step_duration_seconds_sum{mode="continuous",model="tiny"} 6.0
# TYPE batchpilot_step_decode_rows_total counter
batchpilot_step_decode_rows_total{mode="continuous",model="tiny"} 1900.0
# TYPE batchpilot_step_prefill_tokens_total counter
batchpilot_step_prefill_tokens_total{mode="continuous",model="tiny"} 1440.0
# TYPE batchpilot_step_kv_tokens_total counter
batchpilot_step_kv_tokens_total{mode="continuous",model="tiny"} 49000.0
# TYPE batchpilot_requests_waiting gauge
batchpilot_requests_waiting{mode="continuous",model="tiny"} 12.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",model_name="tiny",num_gpu_blocks="512"} 1.0
"""
# A server that joined during the interval: everything it counted is new.
JOINED = """\
# TYPE batchpilot_requests_arrived_total counter
batchpilot_requests_arrived_total{mode="continuous",model="tiny"} 5.0
# TYPE batchpilot_requests_waiting gauge
batchpilot_requests_waiting{mode="continuous",model="tiny"} 3.0
"""
A, B = "http://127.0.0.1:1", "http://127.0.0.1:2"


def _tick(state: pr.FleetState) -> dict:
    before = {A: pr.Scrape.of(BEFORE)}
    now = {A: pr.Scrape.of(NOW), B: pr.Scrape.of(JOINED)}
    return pr.real_tick(42.0, 5.0, before, now, state)


def test_the_tick_counts_the_interval_from_the_scrapes_deltas() -> None:
    request = _tick(pr.FleetState(desired=2, serving=2, alive=2))
    assert (request["op"], request["now_s"]) == ("tick", 42.0)
    # 50 + 5 arrived; 40 finished of 30 prompt and 32 answer tokens on average
    assert request["traffic"] == {
        "duration_s": 5.0, "num_req": 55.0, "isl": 30.0, "osl": 32.0, "shape_count": 40.0,
    }  # fmt: skip
    assert request["workers"] == {"ready": 2, "expected": 2, "pending": 0, "in_progress": False}


def test_each_engine_gets_the_intervals_mean_step_and_its_queue_now() -> None:
    first, joined = _tick(pr.FleetState(2, 2, 2))["fpms"]
    # 200 steps over 4 s; per step 8 decode rows, 6 prompt tokens (of a 30-token mean
    # prompt: one prefill), 200 KV tokens; 12 waiting of 30 tokens each
    assert first == {
        "worker_id": A,
        "wall_time": 0.02,
        "scheduled": {
            "num_prefill_requests": 1, "sum_prefill_tokens": 6,
            "num_decode_requests": 8, "sum_decode_kv_tokens": 200,
        },
        "queued": {"num_prefill_requests": 12, "sum_prefill_tokens": 360},
    }  # fmt: skip
    assert joined["wall_time"] == 0.0  # no step yet
    assert joined["queued"] == {"num_prefill_requests": 3, "sum_prefill_tokens": 90}


def test_a_starting_server_is_pending_and_a_draining_one_hides_it() -> None:
    starting = _tick(pr.FleetState(desired=3, serving=2, alive=3))["workers"]
    assert starting == {"ready": 2, "expected": 3, "pending": 1, "in_progress": True}
    draining = _tick(pr.FleetState(desired=3, serving=2, alive=4))["workers"]
    assert draining["pending"] == 0  # as Dynamo's connector: none counted while one drains


def test_keda_scales_the_real_fleet_on_its_summed_waiting_gauges() -> None:
    now = {A: pr.Scrape.of(NOW), B: pr.Scrape.of(JOINED)}
    signals = pr.waiting_signals(now, 15.0)
    assert (signals.waiting, signals.pods) == (15.0, 2)
    decision = pr.KedaRule(pr.BOUNDS).decide(signals, Fleet(2, 2), ReplicaState(), 42.0)
    assert (decision.replicas, decision.action) == (3, "scale_out")  # ceil(15 / 5)


def test_dynamos_kv_capability_comes_from_the_cache_config_series() -> None:
    assert pr.kv_config(NOW) == (512, 16)
    with pytest.raises(ValueError, match="cache_config_info"):
        pr.kv_config(BEFORE)
