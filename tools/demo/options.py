"""What a demo run is asked to do: the offered load, its SLO, the model, the poor start."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.model_presets import PRESET_NAMES
from batchpilot_tools.loadgen import LengthDist

# The labels the operator would give the servers' series; the tuner selects by them.
NAMESPACE = "local"
POLICY = "demo"
SERVERS = 2
# Poor on purpose: a small batch and a long idle wait before the first step, so
# the tuner has visible work to do before the load even steps up.
INITIAL = BatchingConfig(max_batch_size=1, batch_timeout_ms=100.0, max_queue_size=512)
ADMIN_TOKEN = "batchpilot-demo"


@dataclass(frozen=True)
class LoadProfile:
    """Defaults that fit a model: the offered load, its SLO and how long a server may load."""

    rate: float
    step_factor: float
    slo_p99_ms: float
    output_len: LengthDist
    ready_timeout_s: float


TINY_PROFILE = LoadProfile(
    rate=8.0, step_factor=6.0, slo_p99_ms=1000.0,
    output_len=LengthDist("uniform", 32, 96), ready_timeout_s=90.0,
)
# A 135M-parameter model decodes some 50x slower than tiny on one core per server:
# a fraction of a request per second, shorter answers and a SLO of seconds keep the
# step near capacity, so the tuner still has a visible decision to make. These are
# starting points, not measurements of every model: --rate and --slo-p99-ms override.
REAL_MODEL_PROFILE = LoadProfile(
    rate=0.5, step_factor=4.0, slo_p99_ms=10000.0,
    output_len=LengthDist("uniform", 16, 48), ready_timeout_s=600.0,
)


def profile_for(model: str) -> LoadProfile:
    return TINY_PROFILE if model in PRESET_NAMES else REAL_MODEL_PROFILE


@dataclass(frozen=True)
class DemoOptions:
    duration_s: float
    slo_p99_ms: float
    out: Path
    interval_s: float
    base_rate: float
    step_factor: float
    use_prometheus: bool
    model: str = "tiny"

    @property
    def profile(self) -> LoadProfile:
        return profile_for(self.model)

    @property
    def step_at_s(self) -> float:
        return self.duration_s / 2

    def offered_rate(self, elapsed_s: float) -> float:
        """Requests/s the load generator offers at `elapsed_s`: one step up, midway."""
        if elapsed_s < self.step_at_s:
            return self.base_rate
        return self.base_rate * self.step_factor
