"""Desired owned objects: pure functions of the policy."""

from __future__ import annotations

import json
from typing import Any

from batchpilot_operator import builders
from batchpilot_operator.reconcile import is_subset, set_conditions
from batchpilot_operator.spec import parse_spec
from batchpilot_server.batching import FIELDS, BatchingConfig

from tests.policies import policy_object


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
    args = container["args"]
    flags = dict(zip(args[1::2], args[2::2], strict=True))
    assert args[0] == "serve"
    assert flags == {
        "--model": "tiny", "--mode": "dynamic", "--port": str(builders.SERVER_PORT),
        "--host": "0.0.0.0", "--device": "cpu", "--kv-cache-mb": "64",
        "--admin-token-file": f"{builders.TOKEN_DIR}/{builders.TOKEN_KEY}",
        "--config-file": f"{builders.CONFIG_DIR}/{builders.CONFIG_KEY}",
    }
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert flags["--config-file"].startswith(mounts["batching"])
    assert flags["--admin-token-file"].startswith(mounts["admin-token"])


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
