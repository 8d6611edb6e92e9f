"""The peer baselines of bench/planners.py: a tick in, a decision out, on recorded inputs.

KEDA's rule runs here; Dynamo's planner runs in its own virtualenv
(bench/peers/install_dynamo.sh), so its tests skip where that is not installed.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
from batchpilot_operator.policy.types import Fleet, ReplicaBounds, ReplicaState
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.simulator import Interval

# bench/ is scripts, not a package: its modules import each other by bare name
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import planner_baselines as pb

BOUNDS = ReplicaBounds(1, 4)
CAPABILITIES = pb.dynamo_capabilities(BatchingConfig(), kv_blocks=4096, block_size=16,
                                      context_length=4500)  # fmt: skip


def _keda(waiting: float, desired: int, state: ReplicaState, now: float):
    signals = Signals(status="ok", window_s=60.0, waiting=waiting, pods=desired)
    return pb.KedaRule(BOUNDS).decide(signals, Fleet(desired, desired), state, now)


def test_keda_scales_out_to_the_queue_over_the_threshold_at_once() -> None:
    decision = _keda(waiting=12, desired=1, state=ReplicaState(), now=30.0)
    assert (decision.replicas, decision.action) == (3, "scale_out")  # ceil(12 / 5)


def test_keda_is_bounded_and_holds_within_the_hpa_tolerance() -> None:
    assert _keda(waiting=80, desired=1, state=ReplicaState(), now=30.0).replicas == 4
    held = _keda(waiting=10.4, desired=2, state=ReplicaState(), now=30.0)  # ratio 1.04
    assert (held.replicas, held.action) == (2, "hold")


def test_keda_scales_in_only_after_the_300_s_window() -> None:
    out = _keda(waiting=20, desired=1, state=ReplicaState(), now=30.0)
    assert out.replicas == 4
    soon = _keda(waiting=0, desired=4, state=out.state, now=60.0)
    assert (soon.replicas, soon.action) == (4, "hold")  # 4 was recommended 30 s ago
    later = _keda(waiting=0, desired=4, state=soon.state, now=400.0)
    assert (later.replicas, later.action) == (1, "scale_in")


def test_traffic_of_an_interval_is_what_the_frontend_reports() -> None:
    iv = Interval(end_s=60.0, arrived=9, prompts=[100, 300], outputs=[10, 30])
    assert pb.traffic_of(iv, 30.0) == {
        "duration_s": 30.0, "num_req": 9.0, "isl": 200.0, "osl": 20.0, "shape_count": 2.0,
    }  # fmt: skip


def test_dynamo_config_sets_the_targets_only_for_sla() -> None:
    slo = Slo(ttft_s=0.5, tpot_s=0.02, attainment=0.95)
    sla = pb.dynamo_config("sla", slo, BOUNDS, 30.0)
    assert (sla["ttft_ms"], sla["itl_ms"], sla["max_gpu_budget"]) == (500.0, 20.0, 4)
    assert "ttft_ms" not in pb.dynamo_config("throughput", slo, BOUNDS, 30.0)


def test_a_dynamo_planner_travels_to_a_worker_process_without_its_driver() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.015, attainment=0.95)
    planner = pb.DynamoPlanner(
        "sla", pb.dynamo_config("sla", slo, BOUNDS, 30.0), CAPABILITIES, BOUNDS
    )
    copy = pickle.loads(pickle.dumps(planner))
    assert (copy.process, copy.fleet_id, copy.config) == (None, None, planner.config)


needs_dynamo = pytest.mark.skipif(
    not pb.dynamo_installed(),
    reason=f"Dynamo's planner is not installed ({pb.DYNAMO_PYTHON}): "
    "run bench/peers/install_dynamo.sh; `make test` does not need it",
)


def _tick(now_s: float, ready: int, queued_prefill_tokens: int) -> dict:
    """A recorded round: one FPM per ready engine, each with this queue."""
    fpm = {
        "wall_time": 0.05,
        "scheduled": {
            "num_prefill_requests": 1, "sum_prefill_tokens": 512,
            "num_decode_requests": 7, "sum_decode_kv_tokens": 8000,
        },
        "queued": {
            "num_prefill_requests": queued_prefill_tokens // 1000,
            "sum_prefill_tokens": queued_prefill_tokens,
        },
    }  # fmt: skip
    return {
        "op": "tick",
        "now_s": now_s,
        "traffic": {"duration_s": 30.0, "num_req": 60.0, "isl": 1000.0, "osl": 200.0,
                    "shape_count": 50.0},
        "workers": {"ready": ready, "expected": ready, "pending": 0, "in_progress": False},
        "fpms": [{**fpm, "worker_id": f"server-{i}"} for i in range(ready)],
    }


def _started(target: pb.DynamoTarget) -> pb.DynamoProcess:
    slo = Slo(ttft_s=1.0, tpot_s=0.015, attainment=0.95)
    process = pb.DynamoProcess()
    config = pb.dynamo_config(target, slo, BOUNDS, 30.0)
    reply = process.call({"op": "start", "config": config, "capabilities": CAPABILITIES})
    assert reply["next_at_s"] == 30.0  # its first tick is one interval in
    return process


@needs_dynamo
def test_dynamo_throughput_scales_up_when_the_queue_overfills_the_kv_cache() -> None:
    process = _started("throughput")
    try:
        # (8,000 scheduled + 70,000 queued) KV tokens over 65,536: above its 100% bar
        assert process.call(_tick(30.0, ready=1, queued_prefill_tokens=70_000))["scale_to"] == 2
        # two engines at (8,000 + 0) / 65,536, under its 60% bar: one goes
        reply = process.call(_tick(60.0, ready=2, queued_prefill_tokens=0))
        assert (reply["scale_to"], reply["reason"]) == (1, "scale_down")
    finally:
        process.close()


@needs_dynamo
def test_dynamo_sla_waits_for_its_perf_model_before_deciding() -> None:
    process = _started("sla")
    try:
        reply = process.call(_tick(30.0, ready=1, queued_prefill_tokens=20_000))
        assert (reply["scale_to"], reply["reason"]) == (None, "insufficient_data")
        early = process.call(_tick(10.0, ready=1, queued_prefill_tokens=0))
        assert not early["ticked"]  # before its next tick: no decision
    finally:
        process.close()
