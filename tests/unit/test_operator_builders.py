"""Desired owned objects: pure functions of the policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchpilot_operator import builders
from batchpilot_operator.reconcile import is_subset, set_conditions
from batchpilot_operator.spec import (
    PRESET_STARTUP_TIMEOUT_S,
    REFERENCE_STARTUP_TIMEOUT_S,
    parse_spec,
)
from batchpilot_server.batching_config import FIELDS, BatchingConfig
from batchpilot_server.serve_options import api_key
from batchpilot_server.serve_options import parser as serve_parser

from tests.support.policies import policy_object


def policy(**spec: Any) -> dict[str, Any]:
    return policy_object("llm", "team", spec, uid="u-1")


def pod_template(**spec: Any) -> dict[str, Any]:
    body = policy(**spec)
    return builders.build_deployment(body, parse_spec(body["spec"]))["spec"]["template"]


def test_tuned_values_never_enter_the_pod_template() -> None:
    small = pod_template(
        batching={"maxBatchSize": {"initial": 2}, "batchTimeoutMs": {"initial": 1}}
    )
    large = pod_template(
        batching={"maxBatchSize": {"initial": 32}, "batchTimeoutMs": {"initial": 50}}
    )
    assert small == large  # a different starting config would otherwise roll the pods
    args = small["spec"]["containers"][0]["args"]
    assert not {"--max-batch-size", "--batch-timeout-ms", "--max-queue-size"} & set(args)
    assert not any(field in json.dumps(small) for field in FIELDS)


def test_server_flags_follow_the_spec_and_mount_config_and_token() -> None:
    template = pod_template(server={"model": "tiny", "device": "cpu", "kvCacheMB": 64},
                            batching={"mode": "dynamic"})
    (container,) = template["spec"]["containers"]
    flags = flags_of(container)
    assert container["args"][0] == "serve"
    assert flags == {
        "--model": "tiny", "--mode": "dynamic", "--port": str(builders.SERVER_PORT),
        "--host": "0.0.0.0", "--device": "cpu", "--kv-cache-mb": "64",
        "--admin-token-file": f"{builders.TOKEN_DIR}/{builders.TOKEN_KEY}",
        "--config-file": f"{builders.CONFIG_DIR}/{builders.CONFIG_KEY}",
    }
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert flags["--config-file"].startswith(mounts["batching"])
    assert flags["--admin-token-file"].startswith(mounts["admin-token"])


def flags_of(container: dict[str, Any]) -> dict[str, str]:
    args = container["args"]
    return dict(zip(args[1::2], args[2::2], strict=True))


MODEL_REFERENCE = {
    "persistentVolumeClaim": {"claimName": "weights"},
    "path": "SmolLM2-135M-Instruct",
    "subPath": "team-a",
}


def test_a_model_reference_mounts_its_claim_read_only_and_passes_the_path() -> None:
    pod = pod_template(server={
        "model": MODEL_REFERENCE, "dtype": "bfloat16", "maxModelLen": 8192,
        "servedModelName": "smol",
    })["spec"]
    (container,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"] == {"claimName": "weights", "readOnly": True}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] and mount["subPath"] == "team-a"
    flags = flags_of(container)
    assert flags["--model"] == f"{mount['mountPath']}/SmolLM2-135M-Instruct"
    assert (flags["--dtype"], flags["--max-model-len"], flags["--served-model-name"]) == (
        "bfloat16", "8192", "smol",
    )


def test_a_preset_mounts_no_model_and_sets_no_model_flags() -> None:
    pod = pod_template(server={"model": "tiny"})["spec"]
    (container,) = pod["containers"]
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert not {"--dtype", "--max-model-len", "--served-model-name"} & set(container["args"])
    without_sub_path = pod_template(server={"model": {**MODEL_REFERENCE, "subPath": None}})
    mounts = without_sub_path["spec"]["containers"][0]["volumeMounts"]
    assert not any("subPath" in m for m in mounts)


def test_an_api_key_secret_is_mounted_read_only_and_given_as_the_key_file(tmp_path: Path) -> None:
    pod = pod_template(server={"apiKeySecret": {"name": "llm-key", "key": "openai"}})["spec"]
    (container,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == builders.API_KEY_VOLUME]
    assert volume["secret"]["secretName"] == "llm-key"
    assert volume["secret"]["items"] == [{"key": "openai", "path": builders.API_KEY_FILE}]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == builders.API_KEY_VOLUME]
    assert mount["readOnly"] and "subPath" not in mount  # a subPath mount misses rotations
    # the server reads its key from the mounted file (and its flags parse as the server's)
    args = serve_parser().parse_args(container["args"][1:])
    assert str(args.api_key_file) == f"{mount['mountPath']}/{builders.API_KEY_FILE}"
    assert args.api_key is None
    # the same server, given that file, guards its OpenAI routes with the Secret's value
    key_file = tmp_path / builders.API_KEY_FILE
    key_file.write_text("s3cret\n")
    args.api_key_file = key_file
    assert api_key(args).current() == "s3cret"  # type: ignore[union-attr]


def test_the_api_key_secret_key_defaults_and_no_secret_means_no_key_flag() -> None:
    pod = pod_template(server={"apiKeySecret": {"name": "llm-key"}})["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == builders.API_KEY_VOLUME]
    assert volume["secret"]["items"] == [{"key": "api-key", "path": builders.API_KEY_FILE}]
    open_pod = pod_template(server={"model": "tiny"})["spec"]
    assert "--api-key-file" not in open_pod["containers"][0]["args"]
    assert not [v for v in open_pod["volumes"] if v["name"] == builders.API_KEY_VOLUME]


def startup_budget_s(container: dict[str, Any]) -> int:
    probe = container["startupProbe"]
    return int(probe["periodSeconds"] * probe["failureThreshold"])


def test_the_startup_probe_waits_as_long_as_the_model_needs_to_load() -> None:
    def container(**server: Any) -> dict[str, Any]:
        return pod_template(server=server)["spec"]["containers"][0]

    preset = container(model="tiny")
    reference = container(model=MODEL_REFERENCE)
    assert preset["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert startup_budget_s(preset) >= PRESET_STARTUP_TIMEOUT_S
    assert startup_budget_s(reference) >= REFERENCE_STARTUP_TIMEOUT_S
    assert startup_budget_s(container(model=MODEL_REFERENCE, startupTimeoutSeconds=1801)) >= 1801
    # liveness and readiness are the same for every model: the startup probe holds them off
    for probe in ("livenessProbe", "readinessProbe"):
        assert preset[probe] == reference[probe]


def test_pod_is_locked_down_probed_and_drains() -> None:
    template = pod_template()
    pod = template["spec"]
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] and security["readOnlyRootFilesystem"]
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    sleep = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > sleep
    assert template["metadata"]["labels"][builders.APP_LABEL] == "batchpilot-server"
    assert template["metadata"]["labels"][builders.POLICY_LABEL] == "llm"
    annotations = template["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(container["ports"][0]["containerPort"])


def test_gpus_bring_limits_and_a_toleration_only_when_asked() -> None:
    cpu = pod_template(server={"resources": {"limits": {"memory": "1Gi", "cpu": 2}}})["spec"]
    assert "tolerations" not in cpu
    assert cpu["containers"][0]["resources"] == {"limits": {"memory": "1Gi", "cpu": "2"}}
    gpu = pod_template(server={"device": "cuda", "gpus": 2,
                               "resources": {"limits": {"memory": "1Gi"}}})["spec"]
    assert gpu["containers"][0]["resources"]["limits"] == {
        "memory": "1Gi", builders.GPU_RESOURCE: "2",
    }
    assert gpu["tolerations"] == [
        {"key": builders.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    ]


def test_config_map_round_trips_the_config() -> None:
    config = BatchingConfig(12, 7.5, 99)
    config_map = builders.build_config_map(policy(), config)
    assert config_map["metadata"]["name"] == "llm-batching"
    assert builders.parse_config_data(config_map["data"]) == config
    assert builders.parse_config_data({builders.CONFIG_KEY: "{not json"}) is None
    assert builders.parse_config_data(None) is None


def test_config_map_carries_k_and_leaves_it_out_while_off() -> None:
    speculating = BatchingConfig(12, 7.5, 99, num_speculative_tokens=3)
    data = builders.build_config_map(policy(), speculating)["data"]
    assert builders.parse_config_data(data) == speculating
    # k = 0 is left out: a server from before speculative decoding refuses the key
    off = builders.build_config_map(policy(), BatchingConfig(12, 7.5, 99))["data"]
    assert "num_speculative_tokens" not in off[builders.CONFIG_KEY]
    assert builders.parse_config_data(off) == BatchingConfig(12, 7.5, 99)


def test_drift_is_a_missing_or_different_value_not_an_added_default() -> None:
    desired = {"spec": {"ports": [{"port": 8000}], "type": "ClusterIP"}}
    defaulted = {"spec": {"ports": [{"port": 8000, "protocol": "TCP"}], "type": "ClusterIP",
                          "clusterIP": "10.0.0.1"}}
    assert is_subset(desired, defaulted)
    assert not is_subset(desired, {"spec": {"ports": [{"port": 9000}], "type": "ClusterIP"}})
    assert not is_subset(desired, {"spec": {"ports": [], "type": "ClusterIP"}})


def test_conditions_keep_their_transition_time_until_status_changes() -> None:
    first = set_conditions([], [{"type": "Ready", "status": "False", "reason": "A"}])
    again = set_conditions(
        [{**first[0], "lastTransitionTime": "2000-01-01T00:00:00Z"}],
        [{"type": "Ready", "status": "False", "reason": "B"}],
    )
    assert again[0]["lastTransitionTime"] == "2000-01-01T00:00:00Z" and again[0]["reason"] == "B"
    flipped = set_conditions(again, [{"type": "Ready", "status": "True", "reason": "C"}])
    assert flipped[0]["lastTransitionTime"] != "2000-01-01T00:00:00Z"
    others = set_conditions([{"type": "Tuning", "status": "True"}], first)
    assert [c["type"] for c in others] == ["Tuning", "Ready"]


def test_a_rollout_never_takes_a_ready_pod_away() -> None:
    # GPU or not, auto or not: the replacement is ready before an old pod stops.
    for spec in ({}, {"server": {"device": "cuda", "gpus": 1}},
                 {"server": {"device": "cuda", "gpus": 1}, "batching": {"mode": "auto"}}):
        body = policy(replicas=1, **spec)
        strategy = builders.build_deployment(body, parse_spec(body["spec"]))["spec"]["strategy"]
        assert strategy == {
            "type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
        }, spec


def disruption_budget(**spec: Any) -> dict[str, Any] | None:
    body = policy(**spec)
    return builders.build_disruption_budget(body, parse_spec(body["spec"]))


def test_a_disruption_budget_only_from_two_replicas_one_pod_at_a_time() -> None:
    # One pod: any budget would block node drains for ever or protect nothing.
    assert disruption_budget(replicas=0) is None
    assert disruption_budget(replicas=1) is None
    body = policy(replicas=3)
    deployment = builders.build_deployment(body, parse_spec(body["spec"]))
    budget = disruption_budget(replicas=3)
    assert budget is not None
    assert (budget["apiVersion"], budget["kind"]) == ("policy/v1", "PodDisruptionBudget")
    assert budget["metadata"]["name"] == deployment["metadata"]["name"]
    assert budget["metadata"]["ownerReferences"] == deployment["metadata"]["ownerReferences"]
    assert budget["spec"] == {
        "maxUnavailable": 1, "selector": deployment["spec"]["selector"],
    }
    # An autoscaled policy that omits replicas starts at minReplicas, and has its budget.
    assert disruption_budget(autoscale={"minReplicas": 2, "maxReplicas": 4}) == budget
