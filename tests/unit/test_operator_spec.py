"""Policy spec parsing: defaults, the checks a schema cannot make, and clamping."""

from __future__ import annotations

from typing import Any

import pytest
from batchpilot_operator.policy.types import Bounds, ReplicaBounds
from batchpilot_operator.slo import Slo
from batchpilot_operator.spec import (
    MAX_REPLICAS,
    MAX_STABILIZATION_S,
    PRESET_STARTUP_TIMEOUT_S,
    REFERENCE_STARTUP_TIMEOUT_S,
    ApiKeySecret,
    ModelReference,
    SpecError,
    parse_spec,
)
from batchpilot_server.batching_config import MAX_SPECULATIVE_TOKENS, BatchingConfig, SloTargets
from batchpilot_server.model_presets import PRESET_NAMES


def test_every_preset_name_is_a_server_model() -> None:
    models = pytest.importorskip("batchpilot_server.engine.models")  # imports torch
    assert set(PRESET_NAMES) == set(models.PRESETS)


def test_empty_spec_takes_the_documented_defaults() -> None:
    spec = parse_spec({})
    assert spec.replicas == 1
    assert (spec.server.model, spec.server.device, spec.server.gpus) == ("tiny", "auto", 0)
    assert spec.batching.mode == "continuous"
    assert spec.initial_config() == BatchingConfig(
        8, 10.0, 256, prefill_token_budget=2048, slo=SloTargets(e2e_ms=500.0)
    )
    assert spec.autotune.enabled
    assert spec.slo == Slo(e2e_s=0.5, attainment=0.99, budget_window_s=3600.0)
    bounds = spec.batching.bounds
    assert (bounds.min_prefill_budget, bounds.max_prefill_budget) == (2048, 2048)
    assert (spec.server.dtype, spec.server.max_model_len, spec.server.served_model_name) == (
        "auto", None, None,
    )
    assert spec.server.startup_timeout_seconds == PRESET_STARTUP_TIMEOUT_S
    assert spec.autoscale is None and spec.goal.replicas is None  # a fixed replica count


def reference(**fields: Any) -> dict[str, Any]:
    return {"persistentVolumeClaim": {"claimName": "weights"}, "path": "SmolLM2", **fields}


def test_a_model_reference_names_the_claim_and_the_path_inside_it() -> None:
    spec = parse_spec({"server": {
        "model": reference(path="team/SmolLM2-135M.Q4_1.gguf", subPath="models"),
        "dtype": "bfloat16", "maxModelLen": 4096, "servedModelName": "smol",
    }})
    assert spec.server.model == ModelReference("weights", "team/SmolLM2-135M.Q4_1.gguf", "models")
    assert (spec.server.dtype, spec.server.max_model_len, spec.server.served_model_name) == (
        "bfloat16", 4096, "smol",
    )


def test_an_api_key_secret_names_a_secret_and_its_key() -> None:
    assert parse_spec({}).server.api_key_secret is None  # the OpenAI routes stay open
    named = parse_spec({"server": {"apiKeySecret": {"name": "llm-key"}}}).server.api_key_secret
    assert named == ApiKeySecret("llm-key", "api-key")
    keyed = parse_spec({"server": {"apiKeySecret": {"name": "llm-key", "key": "openai.key"}}})
    assert keyed.server.api_key_secret == ApiKeySecret("llm-key", "openai.key")


def test_a_reference_waits_longer_for_its_model_to_load() -> None:
    assert parse_spec({"server": {"model": reference()}}).server.startup_timeout_seconds == (
        REFERENCE_STARTUP_TIMEOUT_S
    )
    assert REFERENCE_STARTUP_TIMEOUT_S > PRESET_STARTUP_TIMEOUT_S
    chosen = parse_spec({"server": {"model": reference(), "startupTimeoutSeconds": 1800}})
    assert chosen.server.startup_timeout_seconds == 1800


def test_an_unknown_preset_names_the_known_ones() -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec({"server": {"model": "/models/llama"}})
    assert caught.value.reason == "UnknownModel"
    assert all(name in caught.value.message for name in PRESET_NAMES)
    assert "persistentVolumeClaim" in caught.value.message  # how to name weights instead


@pytest.mark.parametrize(
    ("raw", "reason", "words"),
    [
        ({"server": {"model": "llama-70b"}}, "UnknownModel", "'llama-70b' is not a model preset"),
        ({"batching": {"maxBatchSize": {"initial": 100}}}, "InvalidBounds", "initial=100"),
        ({"batching": {"batchTimeoutMs": {"min": 20, "initial": 10}}}, "InvalidBounds", "min=20"),
        (
            {"batching": {"maxQueueSize": 2, "maxBatchSize": {"min": 4, "initial": 4}}},
            "InvalidBounds", "could never fill",
        ),
        (
            {"slo": {"p99LatencyMs": 10}, "batching": {"batchTimeoutMs": {"min": 10}}},
            "InvalidBounds", "SLO could never be met",
        ),
        (
            {"slo": {"ttftMs": 10}, "batching": {"batchTimeoutMs": {"min": 10}}},
            "InvalidBounds", "is not below slo.ttftMs (10 ms)",
        ),
        ({"slo": {}}, "InvalidSLO", "slo states no target"),
        ({"slo": {"attainment": 0.9}}, "InvalidSLO", "slo states no target"),
        ({"slo": {"p99LatencyMs": 300, "e2eMs": 300}}, "InvalidSLO", "keep e2eMs only"),
        ({"slo": {"ttftMs": "fast"}}, "InvalidSpec", "slo.ttftMs must be a number"),
        ({"slo": {"tpotMs": 0.5}}, "InvalidSpec", "slo.tpotMs must be a finite number between 1"),
        ({"slo": {"ttftMs": 200, "attainment": 1}}, "InvalidSpec",
         "slo.attainment must be a finite number between 0.5 and 0.9999"),
        ({"slo": {"ttftMs": 200, "budgetWindow": "1 hour"}}, "InvalidSLO",
         "slo.budgetWindow must be a whole number of s, m, h or d"),
        ({"slo": {"ttftMs": 200, "budgetWindow": "91d"}}, "InvalidSLO", "at most 90d"),
        ({"slo": {"ttftMs": 200, "budgetWindow": 3600}}, "InvalidSpec",
         "slo.budgetWindow must be a string"),
        ({"slo": {"ttftMs": 200, "budgetWindow": "30s"}}, "InvalidSLO",
         "shorter than autotune.windowSeconds (60)"),
        ({"slo": [200]}, "InvalidSpec", "slo must be an object"),
        ({"slo": {"ttftMs": 200,
                  "classes": [{"name": "a", "ttftMs": 9}, {"name": "a", "e2eMs": 9}]}},
         "InvalidSLO", "slo.classes names a more than once"),
        ({"slo": {"ttftMs": 200, "classes": [{"name": "batch"}]}}, "InvalidSLO",
         "slo.classes[0] (batch) states no target"),
        ({"slo": {"ttftMs": 200, "classes": [{"name": "default", "ttftMs": 9}]}}, "InvalidSLO",
         "'default' is the top-level targets' class"),
        ({"slo": {"ttftMs": 200, "classes": [{"name": "a", "ttftMs": 9, "ttft": 1}]}},
         "InvalidSLO", "slo.classes[0] has unknown field(s) ttft"),
        ({"slo": {"ttftMs": 200, "classes": {"name": "a"}}}, "InvalidSLO",
         "slo.classes must be a list"),
        ({"slo": {"tpotMs": 50, "classes": [{"name": "chat", "ttftMs": 10}]},
          "batching": {"batchTimeoutMs": {"min": 10}}},
         "InvalidBounds", "is not below slo.classes[chat].ttftMs (10 ms)"),
        ({"batching": {"prefillTokenBudget": {"initial": 4096}}}, "InvalidBounds",
         "batching.prefillTokenBudget needs min <= initial <= max"),
        ({"batching": {"prefillTokenBudget": {"max": 2_000_000}}}, "InvalidSpec",
         "batching.prefillTokenBudget.max must be between 1 and 1048576"),
        # k is off unless the policy widens its bounds: initial alone exceeds max 0
        ({"batching": {"numSpeculativeTokens": {"initial": 2}}}, "InvalidBounds",
         "batching.numSpeculativeTokens needs min <= initial <= max"),
        ({"batching": {"numSpeculativeTokens": {"max": 17}}}, "InvalidSpec",
         "batching.numSpeculativeTokens.max must be between 0 and 16"),
        ({"batching": {"numSpeculativeTokens": {"min": -1}}}, "InvalidSpec",
         "batching.numSpeculativeTokens.min must be between 0 and 16"),
        ({"server": {"device": "cuda"}}, "InvalidDevice", "needs server.gpus >= 1"),
        ({"server": {"device": "cpu", "gpus": 2}}, "InvalidDevice", "never uses"),
        ({"autotune": {"intervalSeconds": 60, "windowSeconds": 30}}, "InvalidAutotune", "shorter"),
        ({"replicas": "two"}, "InvalidSpec", "replicas must be an integer"),
        ({"replicas": True}, "InvalidSpec", "replicas must be an integer"),
        (
            {"batching": {"mode": "greedy"}},
            "InvalidSpec",
            "must be one of static, dynamic, continuous",
        ),
        ({"batching": []}, "InvalidSpec", "batching must be an object"),
        ({"autotune": {"enabled": "yes"}}, "InvalidSpec", "true or false"),
        ({"autotune": {"kvHighWatermark": 0}}, "InvalidSpec", "between 0.01 and 1"),
        ({"batching": {"maxBatchSize": {"max": 5000}}}, "InvalidSpec", "between 1 and 1024"),
        ({"server": {"model": 7}}, "InvalidSpec", "a preset name or a model reference"),
        (
            {"server": {"model": {"path": "SmolLM2"}}},
            "InvalidModelReference", "needs persistentVolumeClaim.claimName",
        ),
        (
            {"server": {"model": {"persistentVolumeClaim": {"claimName": ""}, "path": "m"}}},
            "InvalidModelReference", "needs persistentVolumeClaim.claimName",
        ),
        (
            {"server": {"model": {"persistentVolumeClaim": {"claimName": "w"}}}},
            "InvalidModelReference", "needs path",
        ),
        ({"server": {"model": reference(path="/etc/passwd")}}, "InvalidModelReference",
         "'/etc/passwd' must be relative"),
        ({"server": {"model": reference(path="a/../../b")}}, "InvalidModelReference",
         "must not contain '..'"),
        ({"server": {"model": reference(subPath="..")}}, "InvalidModelReference",
         "subPath '..' must not contain '..'"),
        ({"server": {"model": reference(pth="x")}}, "InvalidModelReference",
         "unknown field(s) pth"),
        ({"server": {"dtype": "int4"}}, "InvalidSpec", "must be one of auto, float32"),
        ({"server": {"maxModelLen": 0}}, "InvalidSpec", "server.maxModelLen must be between"),
        ({"server": {"servedModelName": ""}}, "InvalidSpec", "1 to 253 characters"),
        ({"server": {"startupTimeoutSeconds": 1}}, "InvalidSpec", "between 10 and 7200"),
        (
            {"server": {"apiKeySecret": "llm-key"}},
            "InvalidSpec",
            "server.apiKeySecret must be {name, key}, got 'llm-key'",
        ),
        ({"server": {"apiKeySecret": {"key": "k"}}}, "InvalidSpec", "apiKeySecret needs name"),
        (
            {"server": {"apiKeySecret": {"name": "s", "value": "x"}}},
            "InvalidSpec",
            "unknown field(s) value",
        ),
        (
            {"server": {"apiKeySecret": {"name": "s", "key": "a/b"}}},
            "InvalidSpec",
            "server.apiKeySecret.key must be a Secret data key",
        ),
        (
            {"autoscale": {"minReplicas": 5, "maxReplicas": 3}},
            "InvalidAutoscale", "minReplicas (5) exceeds autoscale.maxReplicas (3)",
        ),
        ({"autoscale": {"minReplicas": 0}}, "InvalidSpec", "autoscale.minReplicas must be between"),
        ({"autoscale": {"maxReplicas": MAX_REPLICAS + 1}}, "InvalidSpec",
         f"between 1 and {MAX_REPLICAS}"),
        ({"autoscale": {"scaleDownStabilizationSeconds": MAX_STABILIZATION_S + 1}},
         "InvalidSpec", f"between 0 and {MAX_STABILIZATION_S}"),
        ({"autoscale": {"scaleUpStabilizationSeconds": -1}}, "InvalidSpec", "between 0"),
        ({"autoscale": {"minReplicas": 1.5}}, "InvalidSpec", "must be an integer"),
        ({"autoscale": 3}, "InvalidSpec", "autoscale must be an object"),
    ],
)
def test_unservable_specs_name_their_reason(raw: dict[str, Any], reason: str, words: str) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec(raw)
    assert caught.value.reason == reason
    assert words in caught.value.message


def test_clamp_keeps_tuned_values_inside_the_bounds() -> None:
    spec = parse_spec({
        "batching": {
            "maxBatchSize": {"initial": 8, "min": 4, "max": 16},
            "batchTimeoutMs": {"initial": 10, "min": 5, "max": 20},
            "maxQueueSize": 99,
        }
    })
    slo = SloTargets(e2e_ms=500.0)
    assert spec.clamp(BatchingConfig(64, 1.0, 256)) == BatchingConfig(16, 5.0, 99, slo=slo)
    assert spec.clamp(BatchingConfig(2, 50.0, 256)) == BatchingConfig(4, 20.0, 99, slo=slo)
    inside = BatchingConfig(12, 7.5, 99, slo=slo)
    assert spec.clamp(inside) == inside


def test_a_ttft_tpot_slo_and_a_prefill_range_reach_the_goal_and_the_pods_config() -> None:
    spec = parse_spec({
        "slo": {"ttftMs": 400, "tpotMs": 60, "attainment": 0.95, "budgetWindow": "6h"},
        "batching": {"prefillTokenBudget": {"initial": 1024, "min": 256, "max": 4096}},
        "autotune": {"kvHighWatermark": 0.8},
    })
    assert spec.goal.slo == Slo(
        ttft_s=0.4, tpot_s=0.06, attainment=0.95, budget_window_s=6 * 3600.0,
        kv_high_watermark=0.8,
    )
    bounds = spec.goal.bounds
    assert (bounds.min_prefill_budget, bounds.max_prefill_budget) == (256, 4096)
    config = spec.initial_config()
    assert config.prefill_token_budget == 1024
    assert config.slo == SloTargets(ttft_ms=400.0, tpot_ms=60.0)
    # a config in force from before an SLO change takes the spec's targets, and the
    # budget its bounds
    older = BatchingConfig(8, 10.0, 256, prefill_token_budget=8192, slo=SloTargets(e2e_ms=500.0))
    clamped = spec.clamp(older)
    assert (clamped.prefill_token_budget, clamped.slo) == (4096, config.slo)


def test_speculation_is_off_by_default_and_a_k_range_reaches_the_goal_and_the_config() -> None:
    default = parse_spec({})
    assert default.initial_config().num_speculative_tokens == 0
    bounds = default.goal.bounds
    assert (bounds.min_speculative_tokens, bounds.max_speculative_tokens) == (0, 0)
    spec = parse_spec(
        {"batching": {"numSpeculativeTokens": {"initial": 2, "min": 1, "max": 4}}}
    )
    bounds = spec.goal.bounds
    assert (bounds.min_speculative_tokens, bounds.max_speculative_tokens) == (1, 4)
    assert spec.initial_config().num_speculative_tokens == 2
    # a config in force from before the bounds changed is moved inside them
    assert spec.clamp(BatchingConfig(num_speculative_tokens=8)).num_speculative_tokens == 4
    assert spec.clamp(BatchingConfig()).num_speculative_tokens == 1


def test_bounds_clamp_k_and_refuse_a_range_past_the_servers_limit() -> None:
    bounds = Bounds(min_speculative_tokens=1, max_speculative_tokens=4)
    assert bounds.clamp(BatchingConfig(num_speculative_tokens=9)).num_speculative_tokens == 4
    assert bounds.clamp(BatchingConfig()).num_speculative_tokens == 1
    assert bounds.contains(BatchingConfig(num_speculative_tokens=3))
    # the default bounds hold speculation off, whatever a config in force says
    assert Bounds().clamp(BatchingConfig(num_speculative_tokens=4)) == BatchingConfig()
    for low, high in ((2, 1), (-1, 2), (0, MAX_SPECULATIVE_TOKENS + 1)):
        with pytest.raises(ValueError, match="speculative token bounds"):
            Bounds(min_speculative_tokens=low, max_speculative_tokens=high)


def test_autoscale_bounds_take_the_replica_rules_defaults_and_reach_the_goal() -> None:
    spec = parse_spec({"autoscale": {}})
    assert spec.autoscale == ReplicaBounds()
    assert spec.goal.replicas == spec.autoscale
    chosen = parse_spec({"autoscale": {
        "minReplicas": 2, "maxReplicas": 8,
        "scaleUpStabilizationSeconds": 30, "scaleDownStabilizationSeconds": 600,
    }})
    assert chosen.autoscale == ReplicaBounds(2, 8, 30.0, 600.0)


def test_an_omitted_replica_count_starts_at_min_replicas_under_autoscale() -> None:
    assert parse_spec({"autoscale": {"minReplicas": 3, "maxReplicas": 5}}).replicas == 3
    assert parse_spec({"autoscale": {}}).replicas == ReplicaBounds().min_replicas
    # a count given (by the user, kubectl scale, an HPA or the rule) is the count of record
    assert parse_spec({"replicas": 4, "autoscale": {"minReplicas": 3}}).replicas == 4


def test_slo_classes_reach_the_pods_config_and_a_policy_without_keeps_the_older_form() -> None:
    # older pods refuse an unknown slo key: a policy without classes writes none
    plain = parse_spec({"slo": {"ttftMs": 200}}).initial_config()
    assert "classes" not in plain.to_dict()["slo"]
    classes = [{"name": "batch", "priority": -1, "e2eMs": 60000, "attainment": 0.9}]
    config = parse_spec({"slo": {"ttftMs": 200, "classes": classes}}).initial_config()
    assert list(config.to_dict()["slo"]["classes"]) == [
        {"name": "batch", "priority": -1, "ttft_ms": None, "tpot_ms": None, "e2e_ms": 60000.0}
    ]
    assert BatchingConfig.from_dict(config.to_dict()) == config  # the ConfigMap's round trip
