"""The two names of `aisimulate_core.sdk` the planner's core uses, as a stand-in
(../README.md): the estimator's configuration record and an FPM-regression estimator."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

MIN_OBSERVATIONS = 5  # the planner's `load_min_observations` default
MAX_OBSERVATIONS = 64  # its `max_num_fpm_samples` default


@dataclass
class ForwardPassPerfModelConfig:
    model: str
    system: str
    backend: str
    worker_type: str
    estimation_mode: str = "fpm_regression"
    tp: int = 1
    pp: int = 1
    kv_block_size: int | None = None
    nextn: int = 0
    speculation: dict[str, Any] | None = None
    estimator_config: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_legacy_engine_config(
        cls, engine: dict[str, Any], worker_type: str, options: dict[str, int]
    ) -> ForwardPassPerfModelConfig:
        """The planner's sampling options carried into the estimator's controls."""
        sampling = {
            "max_observations": options.get("max_observations", MAX_OBSERVATIONS),
            "min_observations": options.get("min_observations", MIN_OBSERVATIONS),
        }
        return cls(
            model=engine["model_name"], system=engine["system_name"],
            backend=engine["backend"], worker_type=worker_type,
            estimator_config={"fpm_regression": {"sampling": sampling}},
        )  # fmt: skip


def _features(fpm: dict[str, Any]) -> list[float]:
    """What a forward pass's time grows with: prompt tokens computed, decode rows, and the
    KV tokens those rows attend to (1 for the intercept)."""
    scheduled = fpm.get("scheduled_requests") or {}
    return [
        1.0,
        float(scheduled.get("sum_prefill_tokens", 0)),
        float(scheduled.get("num_decode_requests", 0)),
        float(scheduled.get("sum_decode_kv_tokens", 0)),
    ]


class RustForwardPassPerfModel:
    """Wall time of a forward pass by least squares over the last observed passes."""

    def __init__(self, config: dict[str, Any]) -> None:
        sampling = config.get("estimator_config", {}).get("fpm_regression", {}).get(
            "sampling", {}
        )
        self.min_observations = int(sampling.get("min_observations", MIN_OBSERVATIONS))
        self.max_observations = int(sampling.get("max_observations", MAX_OBSERVATIONS))
        self.rows: list[list[float]] = []
        self.seconds: list[float] = []
        self.coef: np.ndarray | None = None

    @classmethod
    def best_available(cls, config: dict[str, Any]) -> RustForwardPassPerfModel:
        return cls(config)

    def tune_with_fpms(self, iterations: list[list[dict[str, Any]]]) -> None:
        for ranks in iterations:
            for fpm in ranks:
                wall = float(fpm.get("wall_time", 0.0))
                if wall > 0:
                    self.rows.append(_features(fpm))
                    self.seconds.append(wall)
        self.rows = self.rows[-self.max_observations :]
        self.seconds = self.seconds[-self.max_observations :]
        if len(self.rows) >= self.min_observations:
            fit, *_ = np.linalg.lstsq(np.array(self.rows), np.array(self.seconds), rcond=None)
            self.coef = np.maximum(fit, 0.0)  # no feature makes a pass faster

    def diagnostics(self) -> dict[str, Any]:
        return {
            "source": "stand-in fpm_regression (not AISimulate)",
            "readiness": "ready" if self.coef is not None else "warming_up",
            "observations": len(self.rows),
        }

    def estimate_forward_pass_time_ms(self, ranks: list[dict[str, Any]]) -> float | None:
        if self.coef is None:
            return None
        return max(float(np.dot(self.coef, _features(fpm))) for fpm in ranks) * 1000.0
