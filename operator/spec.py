"""A BatchingPolicy spec, parsed and checked into typed values.

The CRD schema (crds/batchingpolicy.yaml) refuses most bad specs at the API
server. This module repeats its defaults (the test emulator applies none, and
a test keeps both in step) and adds the checks a schema cannot make: bounds
that cannot hold together and model presets that do not exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from batchpilot_server.batching import (
    MAX_BATCH_SIZE_LIMIT,
    MAX_BATCH_TIMEOUT_MS,
    MAX_QUEUE_SIZE_LIMIT,
    MODES,
    BatchingConfig,
    Mode,
)
from batchpilot_server.model_presets import PRESET_NAMES

DEVICES = ("auto", "cpu", "cuda")
DEFAULT_IMAGE = "batchpilot:0.1.0"
MAX_REPLICAS = 100
MAX_GPUS = 16
MAX_KV_CACHE_MB = 1_048_576


class SpecError(ValueError):
    """A policy spec that cannot be served; `reason` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Knob:
    """One tuned knob: where it starts and the range the tuner may move it in."""

    initial: float
    min: float
    max: float

    def clamp(self, value: float) -> float:
        return min(max(value, self.min), self.max)


@dataclass(frozen=True)
class ServerSpec:
    image: str
    model: str
    device: str
    gpus: int
    resources: dict[str, Any]
    kv_cache_mb: int


@dataclass(frozen=True)
class BatchingSpec:
    mode: Mode
    max_batch_size: Knob
    batch_timeout_ms: Knob
    max_queue_size: int


@dataclass(frozen=True)
class AutotuneSpec:
    enabled: bool
    interval_seconds: int
    window_seconds: int
    kv_high_watermark: float
    prometheus_url: str


@dataclass(frozen=True)
class PolicySpec:
    replicas: int
    server: ServerSpec
    batching: BatchingSpec
    p99_latency_ms: float
    autotune: AutotuneSpec

    def initial_config(self) -> BatchingConfig:
        return BatchingConfig(
            max_batch_size=int(self.batching.max_batch_size.initial),
            batch_timeout_ms=float(self.batching.batch_timeout_ms.initial),
            max_queue_size=self.batching.max_queue_size,
        )

    def clamp(self, config: BatchingConfig) -> BatchingConfig:
        """`config` moved inside this policy's bounds; the queue size always follows the spec."""
        return BatchingConfig(
            max_batch_size=int(self.batching.max_batch_size.clamp(config.max_batch_size)),
            batch_timeout_ms=float(self.batching.batch_timeout_ms.clamp(config.batch_timeout_ms)),
            max_queue_size=self.batching.max_queue_size,
        )


def parse_spec(raw: Mapping[str, Any]) -> PolicySpec:
    """The typed spec of a BatchingPolicy, with CRD defaults; raises SpecError with the cause."""
    server = _section(raw, "server")
    batching = _section(raw, "batching")
    spec = PolicySpec(
        replicas=_int(raw, "replicas", 1, "replicas", 0, MAX_REPLICAS),
        server=ServerSpec(
            image=_str(server, "image", DEFAULT_IMAGE, "server.image"),
            model=_str(server, "model", "tiny", "server.model"),
            device=_choice(server, "device", "auto", "server.device", DEVICES),
            gpus=_int(server, "gpus", 0, "server.gpus", 0, MAX_GPUS),
            resources=dict(_section(server, "resources", "server.resources")),
            kv_cache_mb=_int(server, "kvCacheMB", 256, "server.kvCacheMB", 1, MAX_KV_CACHE_MB),
        ),
        batching=BatchingSpec(
            mode=cast(Mode, _choice(batching, "mode", "continuous", "batching.mode", MODES)),
            max_batch_size=_knob(
                batching, "maxBatchSize", (8, 1, 64), 1, MAX_BATCH_SIZE_LIMIT, True
            ),
            batch_timeout_ms=_knob(
                batching, "batchTimeoutMs", (10, 0, 200), 0, MAX_BATCH_TIMEOUT_MS, False
            ),
            max_queue_size=_int(
                batching, "maxQueueSize", 256, "batching.maxQueueSize", 1, MAX_QUEUE_SIZE_LIMIT
            ),
        ),
        p99_latency_ms=_number(_section(raw, "slo"), "p99LatencyMs", 500, "slo.p99LatencyMs"),
        autotune=_autotune(_section(raw, "autotune")),
    )
    _check_servable(spec)
    return spec


def _autotune(raw: Mapping[str, Any]) -> AutotuneSpec:
    return AutotuneSpec(
        enabled=_bool(raw, "enabled", True, "autotune.enabled"),
        interval_seconds=_int(raw, "intervalSeconds", 30, "autotune.intervalSeconds", 5, 3600),
        window_seconds=_int(raw, "windowSeconds", 60, "autotune.windowSeconds", 10, 86400),
        kv_high_watermark=_number(
            raw, "kvHighWatermark", 0.9, "autotune.kvHighWatermark", low=0.0, high=1.0
        ),
        prometheus_url=_str(raw, "prometheusUrl", "", "autotune.prometheusUrl"),
    )


def _check_servable(spec: PolicySpec) -> None:
    """Cross-field checks: each names the fields and why they cannot be served together."""
    if spec.server.model not in PRESET_NAMES:
        raise SpecError(
            "UnknownModel",
            f"server.model {spec.server.model!r} is not a model preset; "
            f"known: {', '.join(PRESET_NAMES)}",
        )
    for name, knob in (
        ("maxBatchSize", spec.batching.max_batch_size),
        ("batchTimeoutMs", spec.batching.batch_timeout_ms),
    ):
        if not knob.min <= knob.initial <= knob.max:
            raise SpecError(
                "InvalidBounds",
                f"batching.{name} needs min <= initial <= max, "
                f"got min={knob.min:g} initial={knob.initial:g} max={knob.max:g}",
            )
    if spec.batching.max_batch_size.min > spec.batching.max_queue_size:
        raise SpecError(
            "InvalidBounds",
            f"batching.maxBatchSize.min ({spec.batching.max_batch_size.min:g}) exceeds "
            f"batching.maxQueueSize ({spec.batching.max_queue_size}): a batch could never fill",
        )
    if spec.batching.batch_timeout_ms.min >= spec.p99_latency_ms:
        raise SpecError(
            "InvalidBounds",
            f"batching.batchTimeoutMs.min ({spec.batching.batch_timeout_ms.min:g} ms) is not "
            f"below slo.p99LatencyMs ({spec.p99_latency_ms:g} ms): the SLO could never be met",
        )
    if spec.autotune.window_seconds < spec.autotune.interval_seconds:
        raise SpecError(
            "InvalidAutotune",
            f"autotune.windowSeconds ({spec.autotune.window_seconds}) is shorter than "
            f"autotune.intervalSeconds ({spec.autotune.interval_seconds}): "
            "each decision would ignore part of the traffic since the last one",
        )
    if spec.server.device == "cuda" and spec.server.gpus == 0:
        raise SpecError("InvalidDevice", "server.device cuda needs server.gpus >= 1")
    if spec.server.device == "cpu" and spec.server.gpus > 0:
        raise SpecError(
            "InvalidDevice",
            f"server.device cpu with server.gpus {spec.server.gpus} would hold GPUs it never uses",
        )


def _section(raw: Mapping[str, Any], key: str, path: str | None = None) -> Mapping[str, Any]:
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise SpecError("InvalidSpec", f"{path or key} must be an object")
    return value


def _knob(
    raw: Mapping[str, Any],
    key: str,
    defaults: tuple[float, float, float],
    low: float,
    high: float,
    integer: bool,
) -> Knob:
    section = _section(raw, key, f"batching.{key}")
    read = _int if integer else _number
    values = [
        read(section, part, default, f"batching.{key}.{part}", low, high)  # type: ignore[operator]
        for part, default in zip(("initial", "min", "max"), defaults, strict=True)
    ]
    return Knob(*values)


def _int(raw: Mapping[str, Any], key: str, default: int, path: str, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError("InvalidSpec", f"{path} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise SpecError("InvalidSpec", f"{path} must be between {low} and {high}, got {value}")
    return value


def _number(
    raw: Mapping[str, Any],
    key: str,
    default: float,
    path: str,
    low: float = 0.0,
    high: float = float("inf"),
) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SpecError("InvalidSpec", f"{path} must be a number, got {value!r}")
    if not low <= value <= high:
        raise SpecError("InvalidSpec", f"{path} must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _str(raw: Mapping[str, Any], key: str, default: str, path: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise SpecError("InvalidSpec", f"{path} must be a string, got {value!r}")
    return value


def _bool(raw: Mapping[str, Any], key: str, default: bool, path: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise SpecError("InvalidSpec", f"{path} must be true or false, got {value!r}")
    return value


def _choice(
    raw: Mapping[str, Any], key: str, default: str, path: str, choices: tuple[str, ...]
) -> str:
    value = _str(raw, key, default, path)
    if value not in choices:
        raise SpecError(
            "InvalidSpec", f"{path} must be one of {', '.join(choices)}, got {value!r}"
        )
    return value
