"""What the run records: one sample per tuning round, for the view, the plot and the summary."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from batchpilot_operator.tuning_loop import TuneStep
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_tools.demo.options import INITIAL, DemoOptions
from batchpilot_tools.demo.waste import SlotWaste


@dataclass(frozen=True)
class Sample:
    """One tuner interval as the view and the plot show it."""

    t_s: float
    offered_rps: float
    p99_ms: float | None
    kv_usage: float | None
    max_batch_size: int
    batch_timeout_ms: float
    action: str
    reason: str


@dataclass
class Recording:
    options: DemoOptions
    started: float = field(default_factory=time.monotonic)
    samples: list[Sample] = field(default_factory=list)
    config: BatchingConfig = INITIAL
    signal_source: str = ""
    # read once the load has ended, while the servers still run
    slot_waste: SlotWaste | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def last(self) -> Sample | None:
        return self.samples[-1] if self.samples else None


def record_step(recording: Recording, step: TuneStep) -> None:
    signals = step.signals
    recording.config = step.decision.config
    elapsed = recording.elapsed()
    recording.samples.append(
        Sample(
            t_s=elapsed,
            offered_rps=recording.options.offered_rate(elapsed),
            p99_ms=None if signals.p99_latency_s is None else signals.p99_latency_s * 1000.0,
            kv_usage=signals.kv_usage,
            max_batch_size=recording.config.max_batch_size,
            batch_timeout_ms=recording.config.batch_timeout_ms,
            action=step.decision.action,
            reason=step.decision.reason,
        )
    )
