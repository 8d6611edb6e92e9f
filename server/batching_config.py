"""The live batching config: shared by the server, the tuner and the operator.

Torch-free on purpose: the operator imports this module.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

# static: a batch fires only when full; dynamic: when full or at the timeout;
# continuous: every step admits and releases sequences
Mode = Literal["static", "dynamic", "continuous"]
MODES: tuple[Mode, ...] = ("static", "dynamic", "continuous")

# Hard limits any server accepts; a policy's bounds must sit inside them.
MAX_BATCH_SIZE_LIMIT = 1024
MAX_BATCH_TIMEOUT_MS = 60_000.0
MAX_QUEUE_SIZE_LIMIT = 1_000_000
MAX_PREFILL_TOKEN_BUDGET = 1_048_576
MAX_SLO_TARGET_MS = 86_400_000.0  # a day: any longer target is a typo
# draft tokens verified per row and step: beyond this a draft is almost never accepted
# whole, and each verified position costs a token of compute
MAX_SPECULATIVE_TOKENS = 16

FIELDS = (
    "max_batch_size",
    "batch_timeout_ms",
    "max_queue_size",
    "prefill_token_budget",
    "num_speculative_tokens",
    "slo",
)
SLO_TARGETS = ("ttft_ms", "tpot_ms", "e2e_ms")
SLO_CLASS_FIELDS = ("name", "priority", *SLO_TARGETS)
# The class of a request that names none: the top-level targets, at priority 0.
DEFAULT_CLASS = "default"
# A class is named as a Kubernetes object is (the Gateway API Inference Extension's
# InferenceObjective names one): a DNS label, which also keeps it a safe metric label.
CLASS_NAME_PATTERN = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
MAX_CLASS_PRIORITY = 1_000_000
MAX_SLO_CLASSES = 16


class ConfigError(ValueError):
    """A batching config the caller sent is malformed or out of range."""


def _check_targets(section: str, targets: dict[str, float | None]) -> None:
    for name, value in targets.items():
        if value is not None:
            _check_number(f"{section}.{name}", value, 0.0, MAX_SLO_TARGET_MS)
            if value <= 0:
                raise ConfigError(f"{section}.{name} must be positive, got {brief(value)}")


def _stated(targets: dict[str, float | None]) -> dict[str, float]:
    """The stated targets by short name (ttft, tpot, e2e)."""
    return {name.removesuffix("_ms"): value for name, value in targets.items() if value is not None}


@dataclass(frozen=True)
class SloClass:
    """A named class of requests with targets of its own (milliseconds) and a priority:
    higher is served first, the InferenceObjective's meaning. A class states at least one
    target: one without would judge nothing and could never bind."""

    name: str
    priority: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not CLASS_NAME_PATTERN.fullmatch(self.name):
            raise ConfigError(
                "slo.classes[].name must be a DNS label (lowercase letters, digits and '-', "
                f"at most 63), got {brief(self.name)}"
            )
        section = f"slo.classes[{self.name}]"
        _check_int(f"{section}.priority", self.priority, -MAX_CLASS_PRIORITY, MAX_CLASS_PRIORITY)
        _check_targets(section, self._targets())
        if not self.stated:
            raise ConfigError(f"{section} states no target: give ttft_ms, tpot_ms or e2e_ms")

    def _targets(self) -> dict[str, float | None]:
        return {name: getattr(self, name) for name in SLO_TARGETS}

    @property
    def stated(self) -> dict[str, float]:
        """The stated targets by short name (ttft, tpot, e2e), in milliseconds."""
        return _stated(self._targets())

    @classmethod
    def from_dict(cls, data: Any) -> SloClass:
        if not isinstance(data, dict):
            fields = ", ".join(SLO_CLASS_FIELDS)
            raise ConfigError(f"slo.classes[] must be JSON objects of {fields}")
        _refuse_unknown("slo.classes[]", data, SLO_CLASS_FIELDS)
        if "name" not in data:
            raise ConfigError("slo.classes[] needs a name")
        return cls(**data)


@dataclass(frozen=True)
class SloTargets:
    """The policy's per-request targets, in milliseconds; None: not stated.

    Each pod judges every request it finishes against its class's targets (a request
    meets the SLO when every stated target holds for it). The top-level targets are the
    default class's, the one a request naming no class is in; no target stated: nothing
    in that class is judged. `classes` adds named classes beside it.
    """

    ttft_ms: float | None = None  # arrival to first token
    tpot_ms: float | None = None  # mean time per output token after the first
    e2e_ms: float | None = None  # arrival to last byte
    classes: tuple[SloClass, ...] = ()

    def __post_init__(self) -> None:
        _check_targets("slo", {name: getattr(self, name) for name in SLO_TARGETS})
        if not isinstance(self.classes, tuple | list):
            raise ConfigError("slo.classes must be a list of classes")
        if len(self.classes) > MAX_SLO_CLASSES:
            raise ConfigError(f"slo.classes holds at most {MAX_SLO_CLASSES} classes")
        # from JSON (to_dict's form) the classes come as objects: type them
        classes = tuple(
            c if isinstance(c, SloClass) else SloClass.from_dict(c) for c in self.classes
        )
        object.__setattr__(self, "classes", classes)
        names = [c.name for c in classes]
        if DEFAULT_CLASS in names:
            raise ConfigError(
                f"slo.classes must not name a class {DEFAULT_CLASS!r}: that name is the "
                "top-level targets' (the class of a request that names none)"
            )
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ConfigError(f"slo.classes names {', '.join(duplicates)} more than once")

    @property
    def stated(self) -> dict[str, float]:
        """The default class's stated targets by short name (ttft, tpot, e2e), in ms."""
        return _stated({name: getattr(self, name) for name in SLO_TARGETS})

    @property
    def default_class(self) -> SloClass | None:
        """The top-level targets as a class; None when they state no target."""
        if not self.stated:
            return None
        return SloClass(DEFAULT_CLASS, 0, self.ttft_ms, self.tpot_ms, self.e2e_ms)

    def by_name(self) -> dict[str, SloClass | None]:
        """Every class a request may name: the default one (None: no targets, so its
        requests go unjudged), then the named ones in the order given."""
        return {DEFAULT_CLASS: self.default_class, **{c.name: c for c in self.classes}}

    @classmethod
    def from_dict(cls, data: Any) -> SloTargets:
        if not isinstance(data, dict):
            raise ConfigError("slo must be a JSON object of ttft_ms, tpot_ms, e2e_ms and classes")
        _refuse_unknown("slo", data, (*SLO_TARGETS, "classes"))
        return cls(**data)


@dataclass(frozen=True)
class BatchingConfig:
    max_batch_size: int = 8
    batch_timeout_ms: float = 10.0
    max_queue_size: int = 256
    # continuous mode: prompt tokens computed per step (vLLM's max_num_batched_tokens);
    # lower keeps running requests' TPOT steady, higher gives new requests a sooner TTFT
    prefill_token_budget: int = 2048
    # continuous mode: draft tokens (n-gram prompt lookup) each decode row verifies per
    # step, vLLM's num_speculative_tokens; 0 turns speculative decoding off
    num_speculative_tokens: int = 0
    slo: SloTargets = field(default_factory=SloTargets)

    def __post_init__(self) -> None:
        _check_int("max_batch_size", self.max_batch_size, 1, MAX_BATCH_SIZE_LIMIT)
        _check_number("batch_timeout_ms", self.batch_timeout_ms, 0.0, MAX_BATCH_TIMEOUT_MS)
        _check_int("max_queue_size", self.max_queue_size, 1, MAX_QUEUE_SIZE_LIMIT)
        _check_int("prefill_token_budget", self.prefill_token_budget, 1, MAX_PREFILL_TOKEN_BUDGET)
        _check_int(
            "num_speculative_tokens", self.num_speculative_tokens, 0, MAX_SPECULATIVE_TOKENS
        )
        if not isinstance(self.slo, SloTargets):  # a dict, as to_dict() gives it
            object.__setattr__(self, "slo", SloTargets.from_dict(self.slo))

    @property
    def batch_timeout_s(self) -> float:
        return self.batch_timeout_ms / 1000.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        # without classes, the form servers before SLO classes take (their schema refuses
        # an unknown key): a newer operator's ConfigMap and PUTs still reach older pods
        if not self.slo.classes:
            del data["slo"]["classes"]
        # likewise off: servers before speculative decoding refuse the key
        if not self.num_speculative_tokens:
            del data["num_speculative_tokens"]
        return data

    def merged(self, changes: dict[str, Any]) -> BatchingConfig:
        """This config with `changes` applied; rejects unknown keys and bad values."""
        if not isinstance(changes, dict):
            raise ConfigError("batching config must be a JSON object")
        _refuse_unknown("batching", changes, FIELDS)
        return replace(self, **changes)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base: BatchingConfig | None = None) -> BatchingConfig:
        return (base or cls()).merged(data)

    @classmethod
    def from_file(cls, path: str | Path, base: BatchingConfig | None = None) -> BatchingConfig:
        try:
            data = json.loads(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except RecursionError:
            raise ConfigError(f"config file {path} is nested too deeply to read") from None
        except ValueError as exc:  # JSONDecodeError, or a number past Python's digit limit
            raise ConfigError(f"config file {path} is not valid JSON: {exc}") from None
        return cls.from_dict(data, base)


def brief(value: Any) -> str:
    """`value` for an error message, short; never converts a huge integer to digits
    (Python refuses beyond 4300 digits, and no one wants to read them)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 128:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _refuse_unknown(section: str, data: dict[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ConfigError(
            f"unknown {section} field(s): {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise ConfigError(f"{name} must be between {low} and {high}, got {brief(value)}")


def _check_number(name: str, value: Any, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} must be a number, got {type(value).__name__}")
    if not low <= value <= high:
        raise ConfigError(f"{name} must be between {low:g} and {high:g}, got {brief(value)}")
