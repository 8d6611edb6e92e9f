"""The BatchingPolicy CRD: its schema (with jsonschema), its CEL rules (with cel-python),
and its agreement with the operator's own spec parsing."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from batchpilot_operator.policy.types import ReplicaBounds, ReplicaState, ScaleChange
from batchpilot_operator.spec import (
    DEFAULT_API_KEY_KEY,
    MAX_REPLICAS,
    MAX_STABILIZATION_S,
    SpecError,
    parse_spec,
)

from tests.support import ROOT
from tests.support.crd import CEL, CRD, SCHEMA, VERSION, refusals, to_cel, with_defaults
from tests.support.policies import policy_object

# A preset policy is one file; a policy of weights in a volume is a kustomize
# directory with the claim that holds them (test_manifests.py renders those).
EXAMPLES_DIR = ROOT / "manifests" / "examples"
EXAMPLES = sorted(
    [*EXAMPLES_DIR.glob("*.yaml"), *EXAMPLES_DIR.glob("*/policy.yaml")],
    key=lambda p: p.relative_to(EXAMPLES_DIR).as_posix(),
)


def example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def test_there_are_cpu_and_gpu_examples_of_a_preset_and_of_real_models() -> None:
    names = [p.relative_to(EXAMPLES_DIR).as_posix() for p in EXAMPLES]
    assert names == [
        "cpu-policy.yaml", "gpu-policy.yaml",
        "llama3-8b-gpu/policy.yaml", "smollm2-cpu/policy.yaml",
    ]
    for gpu_example in ("gpu-policy.yaml", "llama3-8b-gpu/policy.yaml"):
        gpu = example(EXAMPLES_DIR / gpu_example)["spec"]["server"]
        assert gpu["gpus"] >= 1 and gpu["device"] == "cuda"
    llama = example(EXAMPLES_DIR / "llama3-8b-gpu/policy.yaml")["spec"]["server"]
    assert (llama["dtype"], llama["maxModelLen"]) == ("bfloat16", 8192)
    smollm2 = example(EXAMPLES_DIR / "smollm2-cpu/policy.yaml")["spec"]
    assert smollm2["server"]["device"] == "cpu" and smollm2["batching"]["mode"] == "continuous"
    for spec in (llama, smollm2["server"]):
        assert spec["model"]["persistentVolumeClaim"]["claimName"]
    # the CPU example is autoscaled and leaves the replica count to the operator
    cpu = example(EXAMPLES_DIR / "cpu-policy.yaml")["spec"]
    assert "replicas" not in cpu
    assert parse_spec(cpu).replicas == cpu["autoscale"]["minReplicas"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_are_accepted_by_the_crd_and_the_operator(path: Path) -> None:
    obj = example(path)
    assert refusals(obj) == []
    assert obj["apiVersion"] == f"{CRD['spec']['group']}/{VERSION['name']}"
    assert obj["kind"] == CRD["spec"]["names"]["kind"]
    parse_spec(with_defaults(SCHEMA, obj)["spec"])


def test_crd_defaults_are_the_operators_defaults() -> None:
    defaulted = with_defaults(SCHEMA, {"spec": {}})["spec"]
    assert parse_spec(defaulted) == parse_spec({})
    # autoscale has no default (absent: a fixed count); given empty, its fields have
    autoscaled = with_defaults(SCHEMA, {"spec": {"autoscale": {}}})["spec"]
    assert parse_spec(autoscaled) == parse_spec({"autoscale": {}})
    assert parse_spec(autoscaled).autoscale == ReplicaBounds()


def test_the_api_key_secret_key_defaults_as_in_the_operator() -> None:
    obj = policy(server={"apiKeySecret": {"name": "llm-key"}})
    assert refusals(obj) == []
    defaulted = with_defaults(SCHEMA, obj)["spec"]
    assert defaulted["server"]["apiKeySecret"]["key"] == DEFAULT_API_KEY_KEY
    assert parse_spec(defaulted) == parse_spec(obj["spec"])


def test_replica_limits_are_the_operators() -> None:
    spec = SCHEMA["properties"]["spec"]["properties"]
    autoscale = spec["autoscale"]["properties"]
    for node in (spec["replicas"], autoscale["minReplicas"], autoscale["maxReplicas"]):
        assert node["maximum"] == MAX_REPLICAS
    assert autoscale["minReplicas"]["minimum"] == 1  # a fleet of none has no signals
    for key in ("scaleUpStabilizationSeconds", "scaleDownStabilizationSeconds"):
        assert (autoscale[key]["minimum"], autoscale[key]["maximum"]) == (0, MAX_STABILIZATION_S)
    # No default: an omitted count under autoscale starts at minReplicas, not at 1.
    assert "default" not in spec["replicas"]


def policy(**spec: Any) -> dict[str, Any]:
    return policy_object("p", "default", spec)


INVALID = [
    # (id, spec, words in the API server's refusal)
    ("unknown mode", {"batching": {"mode": "greedy"}}, "'greedy' is not one of"),
    ("negative replicas", {"replicas": -1}, "-1 is less than the minimum"),
    ("batch over the server limit", {"batching": {"maxBatchSize": {"max": 2000}}}, "maximum"),
    ("unknown device", {"server": {"device": "tpu"}}, "'tpu' is not one of"),
    ("timeout as text", {"batching": {"batchTimeoutMs": {"initial": "ten"}}}, "not of type"),
    ("watermark over 1", {"autotune": {"kvHighWatermark": 1.5}}, "maximum"),
    ("watermark of 0", {"autotune": {"kvHighWatermark": 0}}, "minimum"),
    ("zero SLO", {"slo": {"p99LatencyMs": 0}}, "less than the minimum"),
    (
        "initial above max",
        {"batching": {"maxBatchSize": {"initial": 80, "min": 1, "max": 64}}},
        "maxBatchSize needs min <= initial <= max",
    ),
    (
        "min above initial",
        {"batching": {"maxBatchSize": {"initial": 2, "min": 4, "max": 64}}},
        "maxBatchSize needs min <= initial <= max",
    ),
    (
        "timeout initial above max",
        {"batching": {"batchTimeoutMs": {"initial": 300}}},
        "batchTimeoutMs needs min <= initial <= max",
    ),
    (
        "timeout min above initial",
        {"batching": {"batchTimeoutMs": {"initial": 5, "min": 6, "max": 50}}},
        "batchTimeoutMs needs min <= initial <= max",
    ),
    (
        "batch that cannot fill the queue",
        {"batching": {"maxQueueSize": 4, "maxBatchSize": {"initial": 8, "min": 8, "max": 16}}},
        "maxBatchSize.min must not exceed maxQueueSize",
    ),
    (
        "timeout floor above the SLO",
        {"batching": {"batchTimeoutMs": {"initial": 60, "min": 50, "max": 100}},
         "slo": {"p99LatencyMs": 40}},
        "SLO could never be met",
    ),
    (
        "TTFT target at the timeout floor",
        {"batching": {"batchTimeoutMs": {"initial": 60, "min": 50, "max": 100}},
         "slo": {"ttftMs": 50, "tpotMs": 100}},
        "must be below slo.ttftMs: the SLO could never be met",
    ),
    (
        "e2e target under the timeout floor",
        {"batching": {"batchTimeoutMs": {"initial": 60, "min": 50, "max": 100}},
         "slo": {"e2eMs": 40}},
        "must be below slo.e2eMs: the SLO could never be met",
    ),
    ("SLO without a target", {"slo": {"attainment": 0.95}}, "slo must state at least one target"),
    ("empty SLO", {"slo": {}}, "slo must state at least one target"),
    (
        "both p99LatencyMs and e2eMs",
        {"slo": {"p99LatencyMs": 500, "e2eMs": 400}},
        "slo states both p99LatencyMs and e2eMs",
    ),
    ("attainment of 1", {"slo": {"ttftMs": 200, "attainment": 1}}, "maximum"),
    ("attainment of a third", {"slo": {"ttftMs": 200, "attainment": 0.33}}, "minimum"),
    ("zero TPOT target", {"slo": {"tpotMs": 0}}, "less than the minimum"),
    ("budget window without unit", {"slo": {"ttftMs": 200, "budgetWindow": "60"}},
     "does not match"),
    ("budget window in weeks", {"slo": {"ttftMs": 200, "budgetWindow": "1w"}}, "does not match"),
    (
        "two SLO classes of one name",
        {"slo": {"ttftMs": 200, "classes": [{"name": "chat", "ttftMs": 100},
                                            {"name": "chat", "e2eMs": 60000}]}},
        "slo.classes must not name a class twice",
    ),
    (
        "an SLO class without a target",
        {"slo": {"ttftMs": 200, "classes": [{"name": "batch", "priority": -1}]}},
        "each of slo.classes must state at least one target",
    ),
    (
        "an SLO class named default",
        {"slo": {"ttftMs": 200, "classes": [{"name": "default", "ttftMs": 100}]}},
        "slo.classes must not name a class default",
    ),
    (
        "an SLO class whose TTFT is at the timeout floor",
        {"batching": {"batchTimeoutMs": {"initial": 60, "min": 50, "max": 100}},
         "slo": {"tpotMs": 100, "classes": [{"name": "chat", "ttftMs": 50}]}},
        "must be below each class's ttftMs and e2eMs",
    ),
    (
        "an SLO class name that is no DNS label",
        {"slo": {"ttftMs": 200, "classes": [{"name": "Chat_UI", "ttftMs": 100}]}},
        "does not match",
    ),
    (
        "prefill budget initial above max",
        {"batching": {"prefillTokenBudget": {"initial": 4096}}},
        "prefillTokenBudget needs min <= initial <= max",
    ),
    (
        "prefill budget min above initial",
        {"batching": {"prefillTokenBudget": {"initial": 512, "min": 1024, "max": 4096}}},
        "prefillTokenBudget needs min <= initial <= max",
    ),
    ("prefill budget of 0", {"batching": {"prefillTokenBudget": {"min": 0}}},
     "less than the minimum"),
    (
        "speculative k initial above the default max of 0",
        {"batching": {"numSpeculativeTokens": {"initial": 2}}},
        "numSpeculativeTokens needs min <= initial <= max",
    ),
    (
        "speculative k min above initial",
        {"batching": {"numSpeculativeTokens": {"initial": 1, "min": 2, "max": 4}}},
        "numSpeculativeTokens needs min <= initial <= max",
    ),
    ("speculative k past the server's 16", {"batching": {"numSpeculativeTokens": {"max": 17}}},
     "greater than the maximum"),
    (
        "window shorter than interval",
        {"autotune": {"intervalSeconds": 60, "windowSeconds": 30}},
        "windowSeconds must be at least intervalSeconds",
    ),
    ("unknown dtype", {"server": {"dtype": "int4"}}, "'int4' is not one of"),
    (
        "autoscale min above max",
        {"autoscale": {"minReplicas": 4, "maxReplicas": 3}},
        "autoscale.minReplicas must not exceed autoscale.maxReplicas",
    ),
    (
        "autoscale min above the default max",
        {"autoscale": {"minReplicas": 11}},
        "autoscale.minReplicas must not exceed autoscale.maxReplicas",
    ),
    ("autoscale to no pods", {"autoscale": {"minReplicas": 0}}, "less than the minimum"),
    ("autoscale past the limit", {"autoscale": {"maxReplicas": 101}}, "maximum"),
    (
        "stabilization past HPA's limit",
        {"autoscale": {"scaleDownStabilizationSeconds": 3601}},
        "maximum",
    ),
    ("zero model length", {"server": {"maxModelLen": 0}}, "less than the minimum"),
    ("instant startup timeout", {"server": {"startupTimeoutSeconds": 1}}, "less than the minimum"),
    (
        "API key Secret without a name",
        {"server": {"apiKeySecret": {"key": "k"}}},
        "'name' is a required property",
    ),
    ("API key Secret as a bare name", {"server": {"apiKeySecret": "llm-key"}}, "not of type"),
    (
        "API key in a key no Secret can have",
        {"server": {"apiKeySecret": {"name": "s", "key": "a/b"}}},
        "does not match",
    ),
    (
        "reference without claim",
        {"server": {"model": {"persistentVolumeClaim": {}, "path": "m"}}},
        "'claimName' is a required property",
    ),
    (
        "reference without path",
        {"server": {"model": {"persistentVolumeClaim": {"claimName": "w"}}}},
        "'path' is a required property",
    ),
    (
        "absolute model path",
        {"server": {"model": {"persistentVolumeClaim": {"claimName": "w"}, "path": "/etc/x"}}},
        "path must be relative to the volume",
    ),
    (
        "model path that leaves the volume",
        {"server": {"model": {"persistentVolumeClaim": {"claimName": "w"}, "path": "a/../../x"}}},
        "path must be relative to the volume and must not contain '..'",
    ),
    (
        "subPath that leaves the volume",
        {"server": {"model": {"persistentVolumeClaim": {"claimName": "w"}, "path": "m",
                              "subPath": ".."}}},
        "subPath must be relative to the volume",
    ),
]


@pytest.mark.parametrize(("spec", "words"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_policies_are_refused_by_the_crd_and_the_operator(
    spec: dict[str, Any], words: str
) -> None:
    found = refusals(policy(**spec))
    assert any(words in message for message in found), found
    # Where CEL is not enforced (old clusters, the test emulator) the operator refuses it too.
    with pytest.raises(SpecError):
        parse_spec(with_defaults(SCHEMA, policy(**spec))["spec"])


def test_a_policy_without_spec_is_refused() -> None:
    obj = policy()
    del obj["spec"]
    assert refusals(obj) == ["'spec' is a required property"]


def test_mode_rule_refuses_unknown_modes_on_its_own() -> None:
    # The enum already refuses them; the CEL rule states the same intent for clusters
    # and tools that only read x-kubernetes-validations.
    batching = with_defaults(SCHEMA, {"spec": {}})["spec"]["batching"]
    node = SCHEMA["properties"]["spec"]["properties"]["batching"]
    (mode_rule,) = [r for r in node["x-kubernetes-validations"] if "self.mode" in r["rule"]]
    program = CEL.program(CEL.compile(mode_rule["rule"]))
    for mode, accepted in (("dynamic", True), ("continuous", True), ("greedy", False)):
        verdict = program.evaluate({"self": to_cel(node, {**batching, "mode": mode})})
        assert bool(verdict) is accepted


def test_both_model_forms_are_accepted_by_the_crd_and_the_operator() -> None:
    reference = {"persistentVolumeClaim": {"claimName": "w"}, "path": "models/x.gguf",
                 "subPath": "team-a"}
    for model in ("tiny", reference):
        obj = policy(server={"model": model})
        assert refusals(obj) == []
        assert parse_spec(with_defaults(SCHEMA, obj)["spec"]).server.model is not None


@pytest.mark.parametrize(
    ("model", "reason"),
    [
        (7, "InvalidSpec"),
        ("gpt-9", "UnknownModel"),
        ({"persistentVolumeClaim": {"claimName": "w"}, "path": "m", "pth": "n"},
         "InvalidModelReference"),
    ],
    ids=["number", "unknown preset", "unknown field"],
)
def test_what_the_schema_cannot_type_the_operator_refuses(model: Any, reason: str) -> None:
    # server.model is a string or an object: an untyped node, so the API server lets
    # these through (and keeps unknown fields) and the operator says why with Ready=False.
    obj = policy(server={"model": model})
    assert refusals(obj) == []
    with pytest.raises(SpecError) as caught:
        parse_spec(with_defaults(SCHEMA, obj)["spec"])
    assert caught.value.reason == reason


JUNCTORS = ("allOf", "anyOf", "oneOf", "not")
# What Kubernetes forbids inside a junctor (the int-or-string patterns aside, unused here).
FORBIDDEN_IN_JUNCTORS = ("type", "default", "description", "additionalProperties", "nullable")


def junctor_violations(schema: Any, path: str) -> Iterator[str]:
    """Keywords inside allOf/anyOf/oneOf/not that make a schema non-structural."""
    branches = schema if isinstance(schema, list) else [schema]
    for branch in branches:
        if not isinstance(branch, dict):
            continue
        for key in FORBIDDEN_IN_JUNCTORS:
            if key in branch:
                yield f"{path} sets {key} inside a junctor"
        for key, sub in branch.get("properties", {}).items():
            yield from junctor_violations(sub, f"{path}.{key}")
        for junctor in JUNCTORS:
            if junctor in branch:
                yield from junctor_violations(branch[junctor], path)


def structural_violations(schema: dict[str, Any], path: str = "") -> Iterator[str]:
    """Kubernetes' structural-schema rules: a type on every node unless it is
    int-or-string or preserves unknown fields, nothing typed inside junctors, and
    properties never next to additionalProperties."""
    untyped_ok = schema.get("x-kubernetes-int-or-string") or schema.get(
        "x-kubernetes-preserve-unknown-fields"
    )
    if "type" not in schema and not untyped_ok:
        yield f"{path or '<root>'} has no type"
    if "type" not in schema and schema.get("x-kubernetes-validations"):
        yield f"{path} has CEL rules but no type: Kubernetes cannot compile them"
    if "properties" in schema and "additionalProperties" in schema:
        yield f"{path} has both properties and additionalProperties"
    for junctor in JUNCTORS:
        if junctor in schema:
            yield from junctor_violations(schema[junctor], path)
    for key, sub in schema.get("properties", {}).items():
        yield from structural_violations(sub, f"{path}.{key}")
    if isinstance(schema.get("items"), dict):
        yield from structural_violations(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from structural_violations(schema["additionalProperties"], f"{path}{{}}")


def test_schema_is_structural() -> None:
    assert list(structural_violations(SCHEMA)) == []


def schema_node(path: str) -> dict[str, Any]:
    node = SCHEMA
    for key in path.strip(".").split("."):
        node = node["properties"][key]
    return node


def test_the_scale_subresource_points_at_fields_of_the_right_type() -> None:
    # kubectl scale, HPA and KEDA read and write the policy through /scale.
    scale = VERSION["subresources"]["scale"]
    assert scale == {
        "specReplicasPath": ".spec.replicas",
        "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector",
    }
    assert schema_node(scale["specReplicasPath"])["type"] == "integer"
    assert schema_node(scale["statusReplicasPath"])["type"] == "integer"
    assert schema_node(scale["labelSelectorPath"])["type"] == "string"  # HPA needs a string


def test_the_status_holds_what_the_replica_rule_records() -> None:
    state = ReplicaState(ScaleChange(at=1.5e9, before=2, after=4), ((1.5e9, 4), (1.5e9 + 30, 3)))
    status = {
        "replicas": 4, "readyReplicas": 3,
        "selector": "app.kubernetes.io/name=batchpilot-server,batchpilot.io/policy=p",
        "lastScaling": {"time": "2026-01-01T00:00:00Z", "action": "scale_out",
                        "from": 2, "to": 4, "reason": "batch spent"},
        "replicaState": state.to_dict(),
    }
    assert refusals({**policy(), "status": status}) == []
    assert ReplicaState.from_dict(status["replicaState"]) == state
    assert schema_node("status.replicaState")["x-kubernetes-preserve-unknown-fields"]


ACCEPTED_SLOS = [
    # (id, spec.slo, the operator's Slo fields in seconds)
    ("TTFT and TPOT", {"ttftMs": 200, "tpotMs": 50}, {"ttft_s": 0.2, "tpot_s": 0.05}),
    ("TPOT alone", {"tpotMs": 80, "attainment": 0.95}, {"tpot_s": 0.08, "attainment": 0.95}),
    ("all three", {"ttftMs": 300, "tpotMs": 40, "e2eMs": 5000, "budgetWindow": "7d"},
     {"ttft_s": 0.3, "tpot_s": 0.04, "e2e_s": 5.0, "budget_window_s": 7 * 86400.0}),
    ("the older p99LatencyMs", {"p99LatencyMs": 250}, {"e2e_s": 0.25, "attainment": 0.99}),
]


def test_slo_classes_are_accepted_by_the_crd_and_parsed_alike() -> None:
    classes = [
        {"name": "chat", "priority": 10, "ttftMs": 1000, "tpotMs": 100, "attainment": 0.95},
        {"name": "batch", "priority": -5, "e2eMs": 300000},
    ]
    obj = policy(slo={"ttftMs": 2000, "classes": classes})
    assert refusals(obj) == []
    parsed = parse_spec(obj["spec"]).slo
    chat, batch = parsed.classes
    assert (chat.name, chat.priority, chat.stated, chat.attainment) == (
        "chat", 10, {"ttft": 1.0, "tpot": 0.1}, 0.95
    )
    assert (batch.name, batch.priority, batch.stated, batch.attainment) == (
        "batch", -5, {"e2e": 300.0}, 0.99
    )
    # the pods get every class's targets with the default class's (the top-level ones)
    pods = parsed.targets()
    assert list(pods.by_name()) == ["default", "chat", "batch"]
    assert pods.by_name()["batch"].e2e_ms == 300000.0  # type: ignore[union-attr]


def test_the_status_holds_per_class_slo_and_the_binding_class() -> None:
    status = {"slo": {"bindingClass": "chat", "classes": [
        {"name": "chat", "priority": 10, "objective": "ttft<=1000ms @95%", "attainmentTarget": 0.95,
         "judged": 120, "attainment": 0.93, "p99TtftMs": 1400.0, "p99TpotMs": 80.0,
         "p99E2eMs": 9000.0, "budgetAttainment": 0.96, "errorBudgetRemaining": 0.2},
        {"name": "default", "priority": 0, "judged": 0},
    ]}}
    assert refusals({**policy(), "status": status}) == []


@pytest.mark.parametrize(
    ("slo", "expected"), [c[1:] for c in ACCEPTED_SLOS], ids=[c[0] for c in ACCEPTED_SLOS]
)
def test_slo_forms_are_accepted_by_the_crd_and_parsed_alike(
    slo: dict[str, Any], expected: dict[str, float]
) -> None:
    obj = policy(slo=slo)
    assert refusals(obj) == []
    from_crd = parse_spec(with_defaults(SCHEMA, obj)["spec"])
    assert from_crd == parse_spec(obj["spec"])  # the operator's defaults are the CRD's
    parsed = from_crd.slo
    for name, value in expected.items():
        assert getattr(parsed, name) == pytest.approx(value), name
    assert set(parsed.stated) == {k.removesuffix("_s") for k in expected if k.endswith("_s")
                                  and k != "budget_window_s"}


def test_a_speculative_range_is_accepted_by_the_crd_and_parsed_alike() -> None:
    obj = policy(batching={"numSpeculativeTokens": {"initial": 2, "max": 4}})
    assert refusals(obj) == []
    spec = parse_spec(with_defaults(SCHEMA, obj)["spec"])
    assert spec.initial_config().num_speculative_tokens == 2
    assert spec.goal.bounds.max_speculative_tokens == 4


def test_an_absent_slo_defaults_to_the_older_p99_of_500_ms() -> None:
    defaulted = with_defaults(SCHEMA, policy())["spec"]
    assert defaulted["slo"] == {"p99LatencyMs": 500, "attainment": 0.99, "budgetWindow": "1h"}
    assert parse_spec(defaulted).slo.stated == {"e2e": 0.5}


def test_a_tpot_only_slo_allows_any_timeout_floor() -> None:
    # the timeout delays a request's first token, not its later ones
    spec = {"slo": {"tpotMs": 20},
            "batching": {"batchTimeoutMs": {"initial": 60, "min": 50, "max": 100}}}
    assert refusals(policy(**spec)) == []
    assert parse_spec(spec).batching.bounds.min_timeout_ms == 50


def test_names_subresource_and_printer_columns() -> None:
    assert CRD["metadata"]["name"] == f"{CRD['spec']['names']['plural']}.{CRD['spec']['group']}"
    assert CRD["spec"]["names"]["shortNames"] == ["bp"]
    assert set(VERSION["subresources"]) == {"status", "scale"}
    columns = VERSION["additionalPrinterColumns"]
    assert [c["name"].upper() for c in columns] == [
        "MODE", "REPLICAS", "READY-PODS", "BATCH", "TIMEOUT", "SPEC-K", "ATTAINMENT", "BUDGET",
        "SLO", "P99", "BINDING", "READY", "AGE",
    ]
    # the older p99 column only in -o wide: the attainment and the objective say more
    for column in columns:
        field_path = re.sub(r"\[\?.*\]", "", column["jsonPath"])
        node = SCHEMA
        for key in field_path.strip(".").split("."):
            if key == "metadata":
                break
            node = node["properties"][key]
            node = node.get("items", node)
        else:
            assert node["type"] in (column["type"], "integer" if column["type"] == "number" else "")
    priorities = {c["name"]: c.get("priority", 0) for c in columns}
    assert priorities["P99"] == priorities["Binding"] == priorities["Spec-K"] == 1


def test_every_schema_node_is_an_object_with_a_type_or_a_union() -> None:
    """A comma inside an unquoted flow-style description splits it into a stray key with a
    null value, which jsonschema ignores and kustomize drops: catch it here."""

    def nodes(node: dict[str, Any], path: str) -> Iterator[tuple[str, Any]]:
        for key, sub in node.get("properties", {}).items():
            yield f"{path}.{key}", sub
            if isinstance(sub, dict):
                yield from nodes(sub, f"{path}.{key}")
                if isinstance(sub.get("items"), dict):
                    yield from nodes(sub["items"], f"{path}.{key}[]")

    for path, node in nodes(SCHEMA, ""):
        assert isinstance(node, dict), path
        assert all(value is not None for value in node.values()), (path, node)
