"""What a policy's users state: per-request latency targets and the share to meet.

Torch-free and I/O-free. A request *meets the SLO* when every stated target holds
for it; the goal is that at least `attainment` of the requests meet it. The pods
judge each request exactly (`batchpilot_requests_slo_total`), so the operator hands
them the targets (`targets()`) with the batching config.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot_server.batching_config import SloClass as PodSloClass
from batchpilot_server.batching_config import SloTargets

KV_HIGH_WATERMARK = 0.9
DEFAULT_ATTAINMENT = 0.99
DEFAULT_BUDGET_WINDOW_S = 3600.0


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1000.0


@dataclass(frozen=True)
class SloClass:
    """A named class of requests beside the top-level (default) one: its own targets in
    seconds and attainment, and a priority (higher is served first, as an
    InferenceObjective's). The pods judge each request in its class."""

    name: str
    priority: int = 0
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    attainment: float = DEFAULT_ATTAINMENT

    def __post_init__(self) -> None:
        if not self.stated:
            raise ValueError(f"the SLO class {self.name!r} must state a target")
        if not 0 < self.attainment < 1:
            raise ValueError(f"the attainment must be in (0, 1), got {self.attainment:g}")

    @property
    def stated(self) -> dict[str, float]:
        """The stated targets by short name (ttft, tpot, e2e), in seconds."""
        values = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2e": self.e2e_s}
        return {name: value for name, value in values.items() if value is not None}

    def targets(self) -> PodSloClass:
        """The class as the pods take it (milliseconds, no attainment)."""
        return PodSloClass(
            self.name, self.priority, _ms(self.ttft_s), _ms(self.tpot_s), _ms(self.e2e_s)
        )


@dataclass(frozen=True)
class Slo:
    """Targets in seconds (None: not stated); at least one must be stated."""

    ttft_s: float | None = None  # arrival to first token
    tpot_s: float | None = None  # mean time per output token after the first
    e2e_s: float | None = None  # arrival to last byte
    attainment: float = DEFAULT_ATTAINMENT
    budget_window_s: float = DEFAULT_BUDGET_WINDOW_S  # the error budget's period
    kv_high_watermark: float = KV_HIGH_WATERMARK
    classes: tuple[SloClass, ...] = ()  # named classes beside the top-level one

    def __post_init__(self) -> None:
        stated = self.stated
        if not stated:
            raise ValueError("the SLO must state at least one of ttft, tpot and e2e")
        for name, value in stated.items():
            if value <= 0:
                raise ValueError(f"the {name} target must be positive, got {value:g} s")
        if not 0 < self.attainment < 1:
            raise ValueError(f"the attainment must be in (0, 1), got {self.attainment:g}")
        if self.budget_window_s <= 0:
            raise ValueError(f"the budget window must be positive, got {self.budget_window_s:g} s")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError(
                f"the KV high watermark must be in (0, 1], got {self.kv_high_watermark:g}"
            )

    @property
    def stated(self) -> dict[str, float]:
        """The stated targets by short name (ttft, tpot, e2e), in seconds."""
        values = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2e": self.e2e_s}
        return {name: value for name, value in values.items() if value is not None}

    def targets(self) -> SloTargets:
        """The targets as the pods take them (milliseconds), the classes with them."""
        return SloTargets(
            ttft_ms=_ms(self.ttft_s),
            tpot_ms=_ms(self.tpot_s),
            e2e_ms=_ms(self.e2e_s),
            classes=tuple(c.targets() for c in self.classes),
        )

    @property
    def allowed_miss_share(self) -> float:
        """The share of requests that may miss: the error budget's rate."""
        return 1.0 - self.attainment
