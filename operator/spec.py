"""A BatchingPolicy spec, parsed and checked into typed values.

The CRD schema (crds/batchingpolicy.yaml) refuses most bad specs at the API
server. This module applies its defaults too (the test emulator applies none,
and a test keeps both in step), taking the tuning ones from their one home
(`BatchingConfig`, `policy.types.Bounds`, `policy.types.Cadence`, `KV_HIGH_WATERMARK`),
and adds the checks a schema cannot make: bounds that cannot hold together,
model presets that do not exist, and model references the schema cannot type
(`server.model` is a string or an object, which Kubernetes cannot give a type
or CEL rules). Any JSON value gives a spec or a SpecError, whatever its size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import PurePosixPath
from typing import Any, Literal, cast

from batchpilot_operator.policy.types import Bounds, Cadence, Goal, ReplicaBounds
from batchpilot_operator.slo import (
    DEFAULT_ATTAINMENT,
    DEFAULT_BUDGET_WINDOW_S,
    KV_HIGH_WATERMARK,
    Slo,
    SloClass,
)
from batchpilot_server.batching_config import (
    CLASS_NAME_PATTERN,
    DEFAULT_CLASS,
    MAX_BATCH_SIZE_LIMIT,
    MAX_BATCH_TIMEOUT_MS,
    MAX_CLASS_PRIORITY,
    MAX_PREFILL_TOKEN_BUDGET,
    MAX_QUEUE_SIZE_LIMIT,
    MAX_SLO_CLASSES,
    MAX_SLO_TARGET_MS,
    MAX_SPECULATIVE_TOKENS,
    MODES,
    BatchingConfig,
    Mode,
)
from batchpilot_server.model_presets import PRESET_NAMES

# A policy's batching.mode: a server mode, or auto (the operator chooses, policy/mode.py).
PolicyMode = Mode | Literal["auto"]
POLICY_MODES: tuple[PolicyMode, ...] = (*MODES, "auto")
# The CRD's default mode, and the one an auto policy serves until it has chosen.
DEFAULT_MODE: Mode = "continuous"
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEFAULT_IMAGE = "batchpilot:0.1.0"
MAX_REPLICAS = 100
MAX_STABILIZATION_S = 3600  # HPA's own limit for its stabilization windows
MAX_GPUS = 16
MAX_KV_CACHE_MB = 1_048_576
MAX_MODEL_LEN = 1_048_576
MAX_NAME_LENGTH = 253
# How long a pod may take from start to its first ready answer before the kubelet
# restarts it. A preset is built in memory in seconds; weights read from a volume
# (16 GB for an 8B model in bfloat16, often over the network) take minutes.
PRESET_STARTUP_TIMEOUT_S = 60
REFERENCE_STARTUP_TIMEOUT_S = 600
MAX_STARTUP_TIMEOUT_S = 7200
MODEL_REFERENCE_KEYS = ("persistentVolumeClaim", "path", "subPath")
# server.apiKeySecret: the key of the Secret's data when the policy names none, and
# what a Secret data key may be (Kubernetes' own rule for it)
DEFAULT_API_KEY_KEY = "api-key"
SECRET_KEY_PATTERN = re.compile(r"[-._a-zA-Z0-9]+")
# spec.slo: the targets by CRD key and the SLO's short name; p99LatencyMs is the
# older form of e2eMs (at attainment 0.99), the one a policy gets when it states none.
SLO_TARGET_KEYS = {"ttftMs": "ttft", "tpotMs": "tpot", "e2eMs": "e2e"}
LEGACY_P99_KEY = "p99LatencyMs"
DEFAULT_P99_LATENCY_MS = 500.0
# An attainment below one half is a typo, and 1 would leave no error budget at all.
MIN_ATTAINMENT, MAX_ATTAINMENT = 0.5, 0.9999
# slo.budgetWindow: a whole number of seconds, minutes, hours or days ("30m", "1h", "7d").
BUDGET_WINDOW_PATTERN = re.compile(r"([1-9][0-9]{0,5})([smhd])")
BUDGET_WINDOW_UNITS_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_BUDGET_WINDOW_S = 90 * 86400
SLO_CLASS_KEYS = ("name", "priority", *SLO_TARGET_KEYS, "attainment")


class SpecError(ValueError):
    """A policy spec that cannot be served; `reason` is a CamelCase condition reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class ModelReference:
    """Weights in a PersistentVolumeClaim: `path` (an HF directory or a .gguf file)
    inside the claim's volume, or inside its `sub_path` directory when one is given."""

    claim_name: str
    path: str
    sub_path: str | None = None


@dataclass(frozen=True)
class ApiKeySecret:
    """The Secret key that holds the server's API key; the operator never reads its value."""

    name: str
    key: str = DEFAULT_API_KEY_KEY


@dataclass(frozen=True)
class ServerSpec:
    image: str
    model: str | ModelReference  # a preset name, or weights in a volume
    device: str
    gpus: int
    resources: dict[str, Any]
    kv_cache_mb: int
    dtype: str = "auto"
    max_model_len: int | None = None
    served_model_name: str | None = None
    startup_timeout_seconds: int = PRESET_STARTUP_TIMEOUT_S
    api_key_secret: ApiKeySecret | None = None  # None: the OpenAI routes are open


@dataclass(frozen=True)
class BatchingSpec:
    mode: PolicyMode
    initial: BatchingConfig  # where the knobs start; its queue size is the policy's
    bounds: Bounds  # the range the tuner may move them in


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
    slo: Slo  # with the policy's KV watermark (autotune.kvHighWatermark)
    autotune: AutotuneSpec
    # spec.autoscale: None keeps `replicas` as the user (or an HPA) sets it
    autoscale: ReplicaBounds | None = None

    def initial_config(self) -> BatchingConfig:
        """Where a new policy's pods start: the initial knobs and the SLO's targets."""
        return replace(self.batching.initial, slo=self.slo.targets())

    @property
    def goal(self) -> Goal:
        return Goal(self.slo, self.batching.bounds, replicas=self.autoscale)

    @property
    def cadence(self) -> Cadence:
        return Cadence(self.autotune.interval_seconds, self.autotune.window_seconds)

    def clamp(self, config: BatchingConfig) -> BatchingConfig:
        """`config` moved inside this policy's bounds; the queue size and the SLO's
        targets always follow the spec (the pods judge requests against them)."""
        return replace(
            self.batching.bounds.clamp(config),
            max_queue_size=self.batching.initial.max_queue_size,
            slo=self.slo.targets(),
        )


def parse_spec(raw: Mapping[str, Any]) -> PolicySpec:
    """The typed spec of a BatchingPolicy, with CRD defaults; raises SpecError with the cause."""
    autoscale = _autoscale(raw)
    # An omitted count starts at the bottom of the autoscale range (the CRD sets no default).
    replicas_default = autoscale.min_replicas if autoscale is not None else 1
    autotune = _autotune(_section(raw, "autotune"))
    spec = PolicySpec(
        replicas=_int(raw, "replicas", replicas_default, "replicas", 0, MAX_REPLICAS),
        server=_server(_section(raw, "server")),
        batching=_batching(_section(raw, "batching")),
        slo=_slo(raw.get("slo"), autotune.kv_high_watermark),
        autotune=autotune,
        autoscale=autoscale,
    )
    _check_servable(spec)
    return spec


def _server(raw: Mapping[str, Any]) -> ServerSpec:
    model = _model(raw.get("model", "tiny"))
    default_timeout = (
        REFERENCE_STARTUP_TIMEOUT_S
        if isinstance(model, ModelReference)
        else PRESET_STARTUP_TIMEOUT_S
    )
    return ServerSpec(
        image=_str(raw, "image", DEFAULT_IMAGE, "server.image"),
        model=model,
        device=_choice(raw, "device", "auto", "server.device", DEVICES),
        gpus=_int(raw, "gpus", 0, "server.gpus", 0, MAX_GPUS),
        resources=dict(_section(raw, "resources", "server.resources")),
        kv_cache_mb=_int(raw, "kvCacheMB", 256, "server.kvCacheMB", 1, MAX_KV_CACHE_MB),
        dtype=_choice(raw, "dtype", "auto", "server.dtype", DTYPES),
        max_model_len=(
            None
            if raw.get("maxModelLen") is None
            else _int(raw, "maxModelLen", 0, "server.maxModelLen", 1, MAX_MODEL_LEN)
        ),
        served_model_name=_optional_name(raw, "servedModelName", "server.servedModelName"),
        startup_timeout_seconds=_int(
            raw, "startupTimeoutSeconds", default_timeout, "server.startupTimeoutSeconds",
            10, MAX_STARTUP_TIMEOUT_S,
        ),
        api_key_secret=_api_key_secret(raw.get("apiKeySecret")),
    )


def _api_key_secret(value: Any) -> ApiKeySecret | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise SpecError(
            "InvalidSpec",
            f"server.apiKeySecret must be {{name, key}}, got {_shown(value)}",
        )
    unknown = sorted(set(value) - {"name", "key"})
    if unknown:
        raise SpecError(
            "InvalidSpec", f"server.apiKeySecret has unknown field(s) {', '.join(unknown)}"
        )
    name = _optional_name(value, "name", "server.apiKeySecret.name")
    if name is None:
        raise SpecError("InvalidSpec", "server.apiKeySecret needs name: a Secret's name")
    key = _str(value, "key", DEFAULT_API_KEY_KEY, "server.apiKeySecret.key")
    if not SECRET_KEY_PATTERN.fullmatch(key) or len(key) > MAX_NAME_LENGTH:
        raise SpecError(
            "InvalidSpec",
            f"server.apiKeySecret.key must be a Secret data key (letters, digits, '-', '_', "
            f"'.'; at most {MAX_NAME_LENGTH}), got {_shown(key)}",
        )
    return ApiKeySecret(name=name, key=key)


def _model(value: Any) -> str | ModelReference:
    """A preset name (checked against the presets later) or a model reference."""
    if isinstance(value, str):
        return value
    if not isinstance(value, Mapping):
        raise SpecError(
            "InvalidSpec",
            "server.model must be a preset name or a model reference "
            f"{{persistentVolumeClaim: {{claimName}}, path}}, got {_shown(value)}",
        )
    unknown = sorted(set(value) - set(MODEL_REFERENCE_KEYS))
    if unknown:
        raise _bad_reference(
            f"unknown field(s) {', '.join(unknown)}; "
            f"a reference has {', '.join(MODEL_REFERENCE_KEYS)}"
        )
    claim = value.get("persistentVolumeClaim")
    claim_name = claim.get("claimName") if isinstance(claim, Mapping) else None
    if not isinstance(claim_name, str) or not claim_name:
        raise _bad_reference(
            "needs persistentVolumeClaim.claimName: the claim that holds the weights"
        )
    path = value.get("path")
    if not isinstance(path, str) or not path:
        raise _bad_reference(
            "needs path: the model directory or .gguf file inside the volume"
        )
    sub_path = value.get("subPath")
    if sub_path is not None and not isinstance(sub_path, str):
        raise _bad_reference(f"subPath must be a string, got {_shown(sub_path)}")
    for field, relative in (("path", path), ("subPath", sub_path)):
        if relative:
            _check_relative(field, relative)
    return ModelReference(claim_name=claim_name, path=path, sub_path=sub_path or None)


def _check_relative(field: str, value: str) -> None:
    # The volume is mounted at a fixed directory: a path must stay inside it.
    parts = PurePosixPath(value).parts
    if value.startswith("/"):
        raise _bad_reference(f"{field} {value!r} must be relative to the volume, not absolute")
    if ".." in parts:
        raise _bad_reference(f"{field} {value!r} must not contain '..': it would leave the volume")


def _bad_reference(detail: str) -> SpecError:
    return SpecError("InvalidModelReference", f"server.model reference {detail}")


def _optional_name(raw: Mapping[str, Any], key: str, path: str) -> str | None:
    if raw.get(key) is None:
        return None
    value = _str(raw, key, "", path)
    if not 1 <= len(value) <= MAX_NAME_LENGTH:
        raise SpecError(
            "InvalidSpec", f"{path} must have 1 to {MAX_NAME_LENGTH} characters, got {value!r}"
        )
    return value


def _batching(raw: Mapping[str, Any]) -> BatchingSpec:
    """Each knob's initial, min and max, checked to hold together before they become
    the initial config and the bounds."""
    default, bounds = BatchingConfig(), Bounds()
    batch = _knob(
        raw, "maxBatchSize", (default.max_batch_size, bounds.min_batch, bounds.max_batch),
        1, MAX_BATCH_SIZE_LIMIT, True,
    )  # fmt: skip
    timeout = _knob(
        raw, "batchTimeoutMs",
        (default.batch_timeout_ms, bounds.min_timeout_ms, bounds.max_timeout_ms),
        0, MAX_BATCH_TIMEOUT_MS, False,
    )  # fmt: skip
    budget = _knob(
        raw, "prefillTokenBudget",
        (default.prefill_token_budget, bounds.min_prefill_budget, bounds.max_prefill_budget),
        1, MAX_PREFILL_TOKEN_BUDGET, True,
    )  # fmt: skip
    speculative = _knob(
        raw, "numSpeculativeTokens",
        (default.num_speculative_tokens, bounds.min_speculative_tokens,
         bounds.max_speculative_tokens),
        0, MAX_SPECULATIVE_TOKENS, True,
    )  # fmt: skip
    queue = _int(
        raw, "maxQueueSize", default.max_queue_size, "batching.maxQueueSize",
        1, MAX_QUEUE_SIZE_LIMIT,
    )  # fmt: skip
    return BatchingSpec(
        mode=cast(PolicyMode, _choice(raw, "mode", DEFAULT_MODE, "batching.mode", POLICY_MODES)),
        initial=BatchingConfig(
            int(batch[0]), float(timeout[0]), queue, prefill_token_budget=int(budget[0]),
            num_speculative_tokens=int(speculative[0]),
        ),
        bounds=Bounds(
            int(batch[1]), int(batch[2]), float(timeout[1]), float(timeout[2]),
            min_prefill_budget=int(budget[1]), max_prefill_budget=int(budget[2]),
            min_speculative_tokens=int(speculative[1]),
            max_speculative_tokens=int(speculative[2]),
        ),
    )  # fmt: skip


def _slo(value: Any, kv_high_watermark: float) -> Slo:
    """spec.slo: the stated targets (ms in the spec, seconds in Slo), the attainment and
    the budget window. Absent, it is the CRD's default, p99LatencyMs 500."""
    absent = {LEGACY_P99_KEY: DEFAULT_P99_LATENCY_MS}
    raw: Mapping[str, Any] = absent if value is None else _section({"slo": value}, "slo")
    if LEGACY_P99_KEY in raw and "e2eMs" in raw:
        raise SpecError(
            "InvalidSLO",
            "slo states both p99LatencyMs and e2eMs: p99LatencyMs is the older name of "
            "e2eMs (at attainment 0.99); keep e2eMs only",
        )
    keys = {**SLO_TARGET_KEYS, LEGACY_P99_KEY: "e2e"}
    targets_s = {
        name: _number(raw, key, 0, f"slo.{key}", low=1, high=MAX_SLO_TARGET_MS) / 1000.0
        for key, name in keys.items()
        if key in raw
    }
    if not targets_s:
        raise SpecError(
            "InvalidSLO",
            "slo states no target: give at least one of ttftMs, tpotMs and e2eMs "
            "(or the older p99LatencyMs)",
        )
    return Slo(
        ttft_s=targets_s.get("ttft"),
        tpot_s=targets_s.get("tpot"),
        e2e_s=targets_s.get("e2e"),
        attainment=_number(
            raw, "attainment", DEFAULT_ATTAINMENT, "slo.attainment",
            low=MIN_ATTAINMENT, high=MAX_ATTAINMENT,
        ),
        budget_window_s=_budget_window(raw),
        kv_high_watermark=kv_high_watermark,
        classes=_slo_classes(raw.get("classes")),
    )  # fmt: skip


def _slo_classes(value: Any) -> tuple[SloClass, ...]:
    """slo.classes: named classes beside the top-level targets (the default class)."""
    if value is None:
        return ()
    if not isinstance(value, list) or len(value) > MAX_SLO_CLASSES:
        raise SpecError(
            "InvalidSLO", f"slo.classes must be a list of at most {MAX_SLO_CLASSES} classes"
        )
    classes = tuple(_slo_class(item, index) for index, item in enumerate(value))
    names = [c.name for c in classes]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise SpecError("InvalidSLO", f"slo.classes names {', '.join(duplicates)} more than once")
    return classes


def _slo_class(value: Any, index: int) -> SloClass:
    path = f"slo.classes[{index}]"
    raw = _section({path: value}, path)
    unknown = sorted(set(raw) - set(SLO_CLASS_KEYS))
    if unknown:
        raise SpecError("InvalidSLO", f"{path} has unknown field(s) {', '.join(unknown)}")
    name = _str(raw, "name", "", f"{path}.name")
    if not CLASS_NAME_PATTERN.fullmatch(name):
        raise SpecError(
            "InvalidSLO",
            f"{path}.name must be a DNS label (lowercase letters, digits and '-', at most "
            f"63), got {_shown(name)}",
        )
    if name == DEFAULT_CLASS:
        raise SpecError(
            "InvalidSLO",
            f"{path}.name {DEFAULT_CLASS!r} is the top-level targets' class: name it otherwise",
        )
    targets_s = {
        short: _number(raw, key, 0, f"{path}.{key}", low=1, high=MAX_SLO_TARGET_MS) / 1000.0
        for key, short in SLO_TARGET_KEYS.items()
        if key in raw
    }
    if not targets_s:
        raise SpecError(
            "InvalidSLO", f"{path} ({name}) states no target: give ttftMs, tpotMs or e2eMs"
        )
    return SloClass(
        name=name,
        priority=_int(
            raw, "priority", 0, f"{path}.priority", -MAX_CLASS_PRIORITY, MAX_CLASS_PRIORITY
        ),
        ttft_s=targets_s.get("ttft"),
        tpot_s=targets_s.get("tpot"),
        e2e_s=targets_s.get("e2e"),
        attainment=_number(
            raw, "attainment", DEFAULT_ATTAINMENT, f"{path}.attainment",
            low=MIN_ATTAINMENT, high=MAX_ATTAINMENT,
        ),
    )  # fmt: skip


def _budget_window(raw: Mapping[str, Any]) -> float:
    """slo.budgetWindow ("30m", "1h", "7d") in seconds."""
    if "budgetWindow" not in raw:
        return DEFAULT_BUDGET_WINDOW_S
    value = _str(raw, "budgetWindow", "", "slo.budgetWindow")
    match = BUDGET_WINDOW_PATTERN.fullmatch(value)
    seconds = int(match[1]) * BUDGET_WINDOW_UNITS_S[match[2]] if match else None
    if seconds is None or seconds > MAX_BUDGET_WINDOW_S:
        raise SpecError(
            "InvalidSLO",
            "slo.budgetWindow must be a whole number of s, m, h or d (such as 30m, 1h, 7d), "
            f"at most {MAX_BUDGET_WINDOW_S // 86400}d, got {_shown(value)}",
        )
    return float(seconds)


def _autotune(raw: Mapping[str, Any]) -> AutotuneSpec:
    cadence = Cadence()
    return AutotuneSpec(
        enabled=_bool(raw, "enabled", True, "autotune.enabled"),
        interval_seconds=_int(
            raw, "intervalSeconds", int(cadence.interval_s), "autotune.intervalSeconds", 5, 3600
        ),
        window_seconds=_int(
            raw, "windowSeconds", int(cadence.window_s), "autotune.windowSeconds", 10, 86400
        ),
        # the watermark is a share of the KV pool: at 0 every reading would cut the batch
        kv_high_watermark=_number(
            raw, "kvHighWatermark", KV_HIGH_WATERMARK, "autotune.kvHighWatermark",
            low=0.01, high=1.0,
        ),
        prometheus_url=_str(raw, "prometheusUrl", "", "autotune.prometheusUrl"),
    )


def _autoscale(raw: Mapping[str, Any]) -> ReplicaBounds | None:
    if raw.get("autoscale") is None:
        return None
    section = _section(raw, "autoscale")
    defaults = ReplicaBounds()
    low = _int(section, "minReplicas", defaults.min_replicas, "autoscale.minReplicas",
               1, MAX_REPLICAS)  # fmt: skip
    high = _int(section, "maxReplicas", defaults.max_replicas, "autoscale.maxReplicas",
                1, MAX_REPLICAS)  # fmt: skip
    if low > high:
        raise SpecError(
            "InvalidAutoscale",
            f"autoscale.minReplicas ({low}) exceeds autoscale.maxReplicas ({high})",
        )
    up = _int(
        section, "scaleUpStabilizationSeconds", int(defaults.scale_up_stabilization_s),
        "autoscale.scaleUpStabilizationSeconds", 0, MAX_STABILIZATION_S,
    )  # fmt: skip
    down = _int(
        section, "scaleDownStabilizationSeconds", int(defaults.scale_down_stabilization_s),
        "autoscale.scaleDownStabilizationSeconds", 0, MAX_STABILIZATION_S,
    )  # fmt: skip
    return ReplicaBounds(low, high, float(up), float(down))


def _check_servable(spec: PolicySpec) -> None:
    """Cross-field checks: each names the fields and why they cannot be served together."""
    model = spec.server.model
    if isinstance(model, str) and model not in PRESET_NAMES:
        raise SpecError(
            "UnknownModel",
            f"server.model {model!r} is not a model preset; known: {', '.join(PRESET_NAMES)} "
            "(weights of your own: a reference {persistentVolumeClaim: {claimName}, path})",
        )
    bounds, queue = spec.batching.bounds, spec.batching.initial.max_queue_size
    if bounds.min_batch > queue:
        raise SpecError(
            "InvalidBounds",
            f"batching.maxBatchSize.min ({bounds.min_batch}) exceeds "
            f"batching.maxQueueSize ({queue}): a batch could never fill",
        )
    # A dynamic batch may hold its oldest request the whole timeout before the first
    # token: a floor at the TTFT or e2e target could never meet it. TPOT has no such
    # bound (the timeout delays a request's start, not its later tokens).
    floors = [
        (spec.slo.stated, "slo.ttftMs", "slo.e2eMs (or slo.p99LatencyMs)"),
        *((c.stated, f"slo.classes[{c.name}].ttftMs", f"slo.classes[{c.name}].e2eMs")
          for c in spec.slo.classes),
    ]  # fmt: skip
    for stated, ttft_field, e2e_field in floors:
        for name, field in (("ttft", ttft_field), ("e2e", e2e_field)):
            target_s = stated.get(name)
            if target_s is not None and bounds.min_timeout_ms >= target_s * 1000.0:
                raise SpecError(
                    "InvalidBounds",
                    f"batching.batchTimeoutMs.min ({bounds.min_timeout_ms:g} ms) is not below "
                    f"{field} ({target_s * 1000.0:g} ms): the SLO could never be met",
                )
    if spec.slo.budget_window_s < spec.autotune.window_seconds:
        raise SpecError(
            "InvalidSLO",
            f"slo.budgetWindow ({spec.slo.budget_window_s:g} s) is shorter than "
            f"autotune.windowSeconds ({spec.autotune.window_seconds}): the error budget "
            "would be measured over less than one tuning window",
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
) -> tuple[float, float, float]:
    """(initial, min, max) of one knob, min <= initial <= max."""
    section = _section(raw, key, f"batching.{key}")
    read = _int if integer else _number
    initial, least, most = (
        read(section, part, default, f"batching.{key}.{part}", low, high)  # type: ignore[operator]
        for part, default in zip(("initial", "min", "max"), defaults, strict=True)
    )
    if not least <= initial <= most:
        raise SpecError(
            "InvalidBounds",
            f"batching.{key} needs min <= initial <= max, "
            f"got min={least:g} initial={initial:g} max={most:g}",
        )
    return initial, least, most


def _int(raw: Mapping[str, Any], key: str, default: int, path: str, low: int, high: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError("InvalidSpec", f"{path} must be an integer, got {_shown(value)}")
    if not low <= value <= high:
        raise SpecError(
            "InvalidSpec", f"{path} must be between {low} and {high}, got {_shown(value)}"
        )
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
        raise SpecError("InvalidSpec", f"{path} must be a number, got {_shown(value)}")
    try:
        number = float(value)
    except OverflowError:  # an integer past the float range
        number = math.inf
    if not math.isfinite(number) or not low <= number <= high:
        raise SpecError(
            "InvalidSpec", f"{path} must be a finite number between {low:g} and {high:g}, "
            f"got {_shown(value)}",
        )
    return number


def _str(raw: Mapping[str, Any], key: str, default: str, path: str) -> str:
    value = raw.get(key, default)
    if not isinstance(value, str):
        raise SpecError("InvalidSpec", f"{path} must be a string, got {_shown(value)}")
    return value


def _bool(raw: Mapping[str, Any], key: str, default: bool, path: str) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise SpecError("InvalidSpec", f"{path} must be true or false, got {_shown(value)}")
    return value


def _choice(
    raw: Mapping[str, Any], key: str, default: str, path: str, choices: tuple[str, ...]
) -> str:
    value = _str(raw, key, default, path)
    if value not in choices:
        raise SpecError(
            "InvalidSpec", f"{path} must be one of {', '.join(choices)}, got {_shown(value)}"
        )
    return value


SHOWN_CHARS = 80


def _shown(value: Any) -> str:
    """A user's value for an error message: its repr, cut short."""
    try:
        text = repr(value)
    except ValueError:  # an int past Python's digit limit for str(): say its size instead
        digits = math.floor(abs(value).bit_length() * math.log10(2)) + 1
        return f"an integer of about {digits} digits"
    return text if len(text) <= SHOWN_CHARS else f"{text[: SHOWN_CHARS - 3]}..."
