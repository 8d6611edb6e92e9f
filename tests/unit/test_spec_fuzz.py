"""Property-based fuzzing of the two parsers that take configuration from outside:
a BatchingPolicy spec (operator) and a batching config body (server admin API, config file).

The property: any JSON value gives a valid result or the parser's own validation
error (SpecError / ConfigError) with a message, never another exception.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any

import pytest
from batchpilot_operator.spec import PolicySpec, SpecError, parse_spec
from batchpilot_server.batching_config import FIELDS, BatchingConfig, ConfigError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

# Bounded so that the whole module runs in seconds on a shared machine.
EXAMPLES = 300
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)  # Python's json reads NaN and Infinity
    | st.text(max_size=20)
)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner,
                                                                 max_size=4),
    max_leaves=20,
)


def _object(keys: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Objects with any subset of `keys` (each a plausible or a hostile value) and stray keys."""
    return st.fixed_dictionaries({}, optional=keys).flatmap(
        lambda known: st.dictionaries(st.text(max_size=8), JSON, max_size=2).map(
            lambda extra: {**extra, **known}
        )
    )


HUGE = 10**4300  # one digit past what int() may turn into a string
NUMBER = st.integers(-5, 5000) | st.floats(-1, 1e5) | JSON
# A spec's numbers may be any size: Python's json reads integers of any length.
SPEC_NUMBER = NUMBER | st.sampled_from([HUGE, -HUGE])
KNOB = _object({"initial": SPEC_NUMBER, "min": SPEC_NUMBER, "max": SPEC_NUMBER}) | JSON
SLO_CLASS = _object({
    "name": st.sampled_from(["chat", "batch", "default", "Bad_Name", ""]) | JSON,
    "priority": SPEC_NUMBER,
    "ttftMs": SPEC_NUMBER,
    "e2eMs": SPEC_NUMBER,
    "attainment": SPEC_NUMBER,
}) | JSON
SPECS = _object({
    "replicas": SPEC_NUMBER,
    "server": _object({
        "image": st.text(max_size=10) | JSON,
        "model": st.sampled_from(["tiny", "nope"]) | JSON,
        "device": st.sampled_from(["auto", "cpu", "cuda", "tpu"]) | JSON,
        "gpus": SPEC_NUMBER,
        "resources": JSON,
        "kvCacheMB": SPEC_NUMBER,
    }) | JSON,
    "batching": _object({
        "mode": st.sampled_from(["dynamic", "continuous", "static"]) | JSON,
        "maxBatchSize": KNOB,
        "batchTimeoutMs": KNOB,
        "prefillTokenBudget": KNOB,
        "numSpeculativeTokens": KNOB,
        "maxQueueSize": SPEC_NUMBER,
    }) | JSON,
    "slo": _object({
        "p99LatencyMs": SPEC_NUMBER,
        "ttftMs": SPEC_NUMBER,
        "tpotMs": SPEC_NUMBER,
        "e2eMs": SPEC_NUMBER,
        "attainment": SPEC_NUMBER,
        "budgetWindow": st.sampled_from(["1h", "30m", "0d", "99999d", "1w"]) | JSON,
        "classes": st.lists(SLO_CLASS, max_size=3) | JSON,
    }) | JSON,
    "autotune": _object({
        "enabled": st.booleans() | JSON,
        "intervalSeconds": SPEC_NUMBER,
        "windowSeconds": SPEC_NUMBER,
        "kvHighWatermark": SPEC_NUMBER,
        "prometheusUrl": st.text(max_size=10) | JSON,
    }) | JSON,
})  # fmt: skip
CHANGES = _object({name: NUMBER for name in FIELDS}) | JSON


def deeply_nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def assert_valid_spec(spec: PolicySpec) -> None:
    """What the operator does with a spec parse_spec accepted must work too."""
    config = spec.initial_config()
    assert spec.clamp(config) == config
    assert spec.slo.stated and all(math.isfinite(v) for v in spec.slo.stated.values())


@FUZZ
@given(SPECS)
def test_any_spec_parses_or_raises_spec_error(raw: dict[str, Any]) -> None:
    try:
        spec = parse_spec(raw)
    except SpecError as exc:
        assert exc.reason and exc.message
        return
    assert_valid_spec(spec)


@FUZZ
@given(JSON)
def test_any_json_value_as_a_spec_section_parses_or_raises_spec_error(value: Any) -> None:
    for section in ("server", "batching", "slo", "autotune"):
        try:
            parse_spec({section: value})
        except SpecError as exc:
            assert exc.message


@FUZZ
@given(CHANGES)
def test_any_admin_body_merges_or_raises_config_error(changes: Any) -> None:
    try:
        merged = BatchingConfig().merged(changes)
    except ConfigError as exc:
        assert str(exc)
        return
    assert merged == BatchingConfig(**merged.to_dict())  # re-validates every field


@settings(max_examples=EXAMPLES // 3, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(JSON | CHANGES)
def test_any_config_file_loads_or_raises_config_error(tmp_path: Path, value: Any) -> None:
    path = tmp_path / "batching.json"
    path.write_text(json.dumps(value))
    with contextlib.suppress(ConfigError):
        BatchingConfig.from_file(path)


@pytest.mark.parametrize(
    "raw",
    [
        {"replicas": HUGE},
        {"server": {"image": HUGE}},
        {"slo": {"p99LatencyMs": HUGE}},
        {"batching": {"maxBatchSize": {"max": -HUGE}}},
        {"server": {"model": HUGE}},
        {"slo": {"p99LatencyMs": math.inf}},
        {"slo": {"ttftMs": HUGE}},
        {"slo": {"tpotMs": 100, "attainment": -HUGE}},
        {"batching": {"prefillTokenBudget": {"initial": HUGE}}},
    ],
)
def test_huge_integers_and_infinities_in_a_spec_are_spec_errors(raw: dict[str, Any]) -> None:
    with pytest.raises(SpecError) as raised:
        parse_spec(raw)
    assert len(raised.value.message) < 300


@pytest.mark.parametrize("field", FIELDS)
def test_huge_integers_in_an_admin_body_are_config_errors(field: str) -> None:
    with pytest.raises(ConfigError):
        BatchingConfig().merged({field: HUGE})


@pytest.mark.parametrize(
    "text",
    [
        pytest.param(deeply_nested(100), id="nested-100"),
        pytest.param(deeply_nested(100_000), id="nested-100000"),
        pytest.param('{"max_batch_size": 1' + "0" * 5000 + "}", id="int-5001-digits"),
    ],
)
def test_hostile_config_files_are_config_errors(tmp_path: Path, text: str) -> None:
    path = tmp_path / "batching.json"
    path.write_text(text)
    with pytest.raises(ConfigError):
        BatchingConfig.from_file(path)
