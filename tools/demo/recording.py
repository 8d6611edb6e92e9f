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
    replicas: int  # the count of record after the round
    serving: int  # servers taking load when the round decided
    scale_action: str = "hold"  # the replica rule's; "hold" for a fixed fleet
    scale_reason: str = ""
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    attainment: float | None = None  # the pods' judgement: share meeting every target

    @property
    def p99s_ms(self) -> dict[str, float | None]:
        """Each target's observed p99 by short name (ttft, tpot, e2e)."""
        return {"ttft": self.ttft_p99_ms, "tpot": self.tpot_p99_ms, "e2e": self.p99_ms}

    def met(self, options: DemoOptions) -> bool | None:
        """Whether the interval met the SLO: the attainment where the pods judged it, else
        every stated target's p99 within it; None when nothing was observed."""
        if self.attainment is not None:
            return self.attainment >= options.slo_attainment
        observed = {
            name: p99
            for name, p99 in self.p99s_ms.items()
            if name in options.targets_ms and p99 is not None
        }
        if not observed:
            return None
        return all(p99 <= options.targets_ms[name] for name, p99 in observed.items())


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

    @property
    def covered_s(self) -> float:
        """From the load's start to the last round."""
        return self.samples[-1].t_s if self.samples else 0.0

    def replica_seconds(self) -> float:
        """Servers taking load over the rounds, each round's count for the interval it
        ends: the cost the demo's fleet paid."""
        total, since = 0.0, 0.0
        for sample in self.samples:
            total += sample.serving * (sample.t_s - since)
            since = sample.t_s
        return total


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def record_step(recording: Recording, step: TuneStep) -> None:
    signals = step.signals
    recording.config = step.decision.config
    elapsed = recording.elapsed()
    # A fixed fleet has no replica decision: it runs what it started with.
    fixed = recording.options.replicas.low
    scale, fleet = step.scale, step.fleet
    recording.samples.append(
        Sample(
            t_s=elapsed,
            offered_rps=recording.options.offered_rate(elapsed),
            p99_ms=_ms(signals.p99_latency_s),
            kv_usage=signals.kv_usage,
            max_batch_size=recording.config.max_batch_size,
            batch_timeout_ms=recording.config.batch_timeout_ms,
            action=step.decision.action,
            reason=step.decision.reason,
            replicas=fixed if scale is None else scale.replicas,
            serving=fixed if fleet is None else fleet.ready,
            scale_action="hold" if scale is None else scale.action,
            scale_reason="" if scale is None else scale.reason,
            ttft_p99_ms=_ms(signals.ttft_p99_s),
            tpot_p99_ms=_ms(signals.tpot_p99_s),
            attainment=signals.attainment,
        )
    )
