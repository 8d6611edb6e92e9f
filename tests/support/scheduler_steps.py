"""Driving a scheduler without a model, under a virtual clock, for the scheduler tests:
the engine's step without the forward (`postprocess` advances the rows as it does)."""

from __future__ import annotations

from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.scheduler import Output, QueueScheduler
from batchpilot_server.engine.step_plan import StepPlan

BLOCK = 16
EOS = 99
CONFIG = BatchingConfig(max_batch_size=4, batch_timeout_ms=10, max_queue_size=8)


def run(scheduler: QueueScheduler, now: float) -> tuple[StepPlan, list[Output]]:
    """One step at virtual time `now`, every sampling row drawing token 7."""
    plan = scheduler.schedule(now)
    rows = plan.sampling()
    return plan, scheduler.postprocess(plan, [7] * len(rows), [0.0] * len(rows), now)
