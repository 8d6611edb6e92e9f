"""Shared builders for the rule's unit tests: a plane of known step costs, the windows it
gives, and a memory holding a trusted fit."""

from __future__ import annotations

from dataclasses import replace

from batchpilot_operator.policy.memory import PolicyMemory
from batchpilot_operator.policy.predictor import predict_config
from batchpilot_operator.policy.step_model import StepPoint
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig

# seconds: fixed, per decode row, per prompt token computed, per KV token attended
PLANE = (0.004, 0.0002, 0.00001, 0.0000005)
OPERATING = [(1, 10, 100), (4, 200, 900), (8, 50, 3000), (16, 400, 5000), (2, 300, 400)]


def step_s(rows: float, prefill: float, kv: float, plane: tuple[float, ...] = PLANE) -> float:
    a, b, c, d = plane
    return a + b * rows + c * prefill + d * kv


def points(pods: int = 1, plane: tuple[float, ...] = PLANE) -> tuple[StepPoint, ...]:
    return tuple(StepPoint(r, p, k, step_s(r, p, k, plane), pods) for r, p, k in OPERATING)


def trusted(pods: int = 1) -> PolicyMemory:
    return PolicyMemory(points=points(pods))


def window(rate: float = 10.0, pods: int = 1, **changes: object) -> Signals:
    """A chat-like window: prompts 300/1000/2000 tokens, answers 100/200/400, steps that lie
    on PLANE (so that the fit is taken in without moving), 20 % of the KV pool in use."""
    steps, rows, prefill, kv = 1000.0, 8.0, 50.0, 3000.0
    base = Signals(
        status="ok", window_s=60.0, requests=rate * 60, request_rate=rate, arrival_rate=rate,
        p99_latency_s=2.0, queue_wait_p99_s=0.0, ttft_p99_s=0.1, tpot_p99_s=0.01,
        output_tokens_p50=100.0, output_tokens_p90=200.0, output_tokens_p99=400.0,
        prompt_tokens_p50=300.0, prompt_tokens_p90=1000.0, prompt_tokens_p99=2000.0,
        tokens_per_s=rate * 150, mean_batch_size=rows, pods=pods, kv_usage=0.2,
        steps=steps, step_seconds=steps * step_s(rows, prefill, kv),
        step_decode_rows=steps * rows, step_prefill_tokens=steps * prefill,
        step_kv_tokens=steps * kv,
    )  # fmt: skip
    return replace(base, **changes)  # type: ignore[arg-type]


def as_predicted(signals: Signals, config: BatchingConfig, slo: Slo) -> Signals:
    """The window with the p99s the fit predicts for `config` on its pods: one the fit
    predicts well, so that the round uses it."""
    got = predict_config(signals, config, max(1, signals.pods), slo, points(max(1, signals.pods)))
    assert got is not None
    finite = {k: v for k, v in (("ttft_p99_s", got.ttft_p99_s), ("tpot_p99_s", got.tpot_p99_s),
                                ("p99_latency_s", got.e2e_p99_s)) if v != float("inf")}  # fmt: skip
    return replace(signals, **finite)  # type: ignore[arg-type]
