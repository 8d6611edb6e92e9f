"""Driving a scheduler without a model, under a virtual clock: what the model runner
would compute, for the scheduler tests."""

from __future__ import annotations

from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.scheduler import Output, QueueScheduler, StepPlan

BLOCK = 16
EOS = 99
CONFIG = BatchingConfig(max_batch_size=4, batch_timeout_ms=10, max_queue_size=8)


def run(scheduler: QueueScheduler, now: float) -> tuple[StepPlan, list[Output]]:
    """One step at virtual time `now`: what the model runner would compute, token 7."""
    plan = scheduler.schedule(now)
    for seq, chunk in zip(plan.prefill, plan.chunks or [None] * len(plan.prefill), strict=True):
        seq.num_computed = seq.num_tokens if chunk is None else seq.num_computed + chunk
    for seq in plan.decode:
        seq.num_computed = seq.num_tokens
    rows = [seq for seq in [*plan.prefill, *plan.decode] if seq.ready_to_sample]
    return plan, scheduler.postprocess(rows, [7] * len(rows), [0.0] * len(rows), now)
