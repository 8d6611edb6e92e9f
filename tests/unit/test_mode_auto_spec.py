"""`batching.mode: auto` in the CRD, the spec and the owned objects built for it."""

from __future__ import annotations

from typing import Any

import pytest
from batchpilot_operator import builders
from batchpilot_operator.spec import DEFAULT_MODE, parse_spec
from batchpilot_server.batching_config import MODES, BatchingConfig

from tests.support.crd import SCHEMA, refusals, with_defaults
from tests.support.policies import policy_object


def auto(**spec: Any) -> dict[str, Any]:
    return policy_object("llm", "default", {"batching": {"mode": "auto"}, **spec}, uid="u-1")


def test_the_crd_and_the_operator_accept_auto() -> None:
    assert refusals(auto()) == []
    assert parse_spec(with_defaults(SCHEMA, auto())["spec"]).batching.mode == "auto"
    default = SCHEMA["properties"]["spec"]["properties"]["batching"]["properties"]["mode"]
    assert default["default"] == DEFAULT_MODE


def test_an_auto_policy_serves_its_recorded_choice_else_the_default() -> None:
    spec = parse_spec(auto()["spec"])
    assert builders.serving_mode(spec, None) == DEFAULT_MODE
    for mode in MODES:
        assert builders.serving_mode(spec, mode) == mode
        # A fixed mode is served whatever an earlier auto spec recorded.
        fixed = parse_spec({"batching": {"mode": "dynamic"}})
        assert builders.serving_mode(fixed, mode) == "dynamic"


def test_the_config_map_records_the_mode_beside_the_knobs() -> None:
    config = BatchingConfig(12, 7.5, 99)
    data = builders.build_config_map(auto(), config, "dynamic")["data"]
    assert builders.parse_config_data(data) == config
    assert builders.parse_mode_data(data) == "dynamic"
    assert builders.parse_mode_data({builders.MODE_KEY: "greedy"}) is None
    assert builders.parse_mode_data(None) is None


def args_of(deployment: dict[str, Any]) -> list[str]:
    args: list[str] = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    return args


@pytest.mark.parametrize("gpus", [0, 1])
def test_a_mode_switch_rolls_without_taking_capacity_away(gpus: int) -> None:
    server = {"device": "cuda", "gpus": gpus} if gpus else {}
    body = auto(server=server)
    spec = parse_spec(body["spec"])
    deployment = builders.build_deployment(body, spec, "dynamic")
    assert args_of(deployment)[args_of(deployment).index("--mode") + 1] == "dynamic"
    assert deployment["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    # Only the mode differs between the two modes' Deployments: the pods roll for it alone.
    other = builders.build_deployment(body, spec, "continuous")
    flag = args_of(other).index("--mode") + 1
    assert args_of(other)[flag] == "continuous"
    args_of(other)[flag] = "dynamic"
    assert other == deployment
