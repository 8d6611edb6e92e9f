"""Desired owned objects of a BatchingPolicy: pure functions, no I/O.

Tuned batching values live only in the ConfigMap (read by the server at start
and pushed live by the tuner); the pod template never carries them, so a
tuning decision never restarts a pod. The batching mode in force is recorded
in the ConfigMap too (key `mode`) and becomes the pods' `--mode`: a change of
mode (`batching.mode: auto`) changes the template, and Kubernetes replaces
the pods one drained pod at a time.
"""

from __future__ import annotations

import base64
import json
import math
import secrets
from collections.abc import Mapping
from typing import Any

from batchpilot_operator.spec import (
    DEFAULT_MODE,
    ApiKeySecret,
    ModelReference,
    PolicySpec,
    ServerSpec,
)
from batchpilot_server.batching_config import MODES, BatchingConfig, Mode

GROUP = "batchpilot.io"
VERSION = "v1alpha1"
KIND = "BatchingPolicy"
PLURAL = "batchingpolicies"

SERVER_PORT = 8000
APP_LABEL = "app.kubernetes.io/name"
APP_NAME = "batchpilot-server"
POLICY_LABEL = "batchpilot.io/policy"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGER = "batchpilot-operator"

CONFIG_KEY = "batching.json"
MODE_KEY = "mode"
TOKEN_KEY = "token"
CONFIG_DIR = "/etc/batchpilot/batching"
TOKEN_DIR = "/etc/batchpilot/admin"
# server.apiKeySecret's key is mounted here as API_KEY_FILE, whatever its key is named
API_KEY_DIR = "/etc/batchpilot/api-key"
API_KEY_FILE = "api-key"
API_KEY_VOLUME = "api-key"
# A model reference's volume (or its subPath) is mounted here, read-only.
MODEL_DIR = "/models"
MODEL_VOLUME = "model"
STARTUP_PROBE_PERIOD_SECONDS = 5
GPU_RESOURCE = "nvidia.com/gpu"
# The server drains in-flight requests on SIGTERM; the preStop pause lets the
# endpoints controller take the pod out of the Service before that starts.
PRESTOP_SLEEP_SECONDS = 5
TERMINATION_GRACE_SECONDS = 60
NON_ROOT_UID = 10001


def config_map_name(policy_name: str) -> str:
    return f"{policy_name}-batching"


def secret_name(policy_name: str) -> str:
    return f"{policy_name}-admin"


def selector_labels(policy_name: str) -> dict[str, str]:
    """The labels that select a policy's server pods (also for the tuner's pod listing)."""
    return {APP_LABEL: APP_NAME, POLICY_LABEL: policy_name}


def owned_labels(policy_name: str) -> dict[str, str]:
    return {**selector_labels(policy_name), MANAGED_BY_LABEL: MANAGER}


def owner_reference(policy: Mapping[str, Any]) -> dict[str, Any]:
    meta = policy["metadata"]
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(policy: Mapping[str, Any], name: str) -> dict[str, Any]:
    meta = policy["metadata"]
    return {
        "name": name,
        "namespace": meta["namespace"],
        "labels": owned_labels(meta["name"]),
        "ownerReferences": [owner_reference(policy)],
    }


def config_data(config: BatchingConfig) -> dict[str, str]:
    """ConfigMap data holding `config` as the server's --config-file JSON."""
    return {CONFIG_KEY: json.dumps(config.to_dict(), sort_keys=True)}


def mode_data(mode: Mode) -> dict[str, str]:
    """ConfigMap data recording the batching mode in force."""
    return {MODE_KEY: mode}


def parse_mode_data(data: Mapping[str, str] | None) -> Mode | None:
    """The mode a ConfigMap records, or None when it records none (or no valid one)."""
    mode = (data or {}).get(MODE_KEY)
    return next((m for m in MODES if m == mode), None)


def serving_mode(spec: PolicySpec, recorded: Mode | None) -> Mode:
    """The mode the pods run: the spec's, or for auto the recorded choice (else the default)."""
    if spec.batching.mode == "auto":
        return recorded or DEFAULT_MODE
    return spec.batching.mode


def parse_config_data(data: Mapping[str, str] | None) -> BatchingConfig | None:
    """The config a ConfigMap holds, or None when it is missing or unreadable."""
    try:
        return BatchingConfig.from_dict(json.loads((data or {})[CONFIG_KEY]))
    except (KeyError, ValueError, TypeError):
        return None


def build_config_map(
    policy: Mapping[str, Any], config: BatchingConfig, mode: Mode = DEFAULT_MODE
) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(policy, config_map_name(policy["metadata"]["name"])),
        "data": {**config_data(config), **mode_data(mode)},
    }


def new_admin_token() -> str:
    return secrets.token_urlsafe(32)


def build_secret(policy: Mapping[str, Any], token: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(policy, secret_name(policy["metadata"]["name"])),
        "type": "Opaque",
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_service(policy: Mapping[str, Any]) -> dict[str, Any]:
    name = policy["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(policy, name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(name),
            "ports": [
                {"name": "http", "port": SERVER_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }


def build_deployment(
    policy: Mapping[str, Any], spec: PolicySpec, mode: Mode | None = None
) -> dict[str, Any]:
    """The Deployment serving `mode` (default: what `serving_mode` gives with no record)."""
    name = policy["metadata"]["name"]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(policy, name),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(name)},
            "strategy": _rollout_strategy(),
            "template": {
                "metadata": {
                    "labels": owned_labels(name),
                    "annotations": {
                        "prometheus.io/scrape": "true",
                        "prometheus.io/port": str(SERVER_PORT),
                        "prometheus.io/path": "/metrics",
                    },
                },
                "spec": _pod_spec(name, spec, mode or serving_mode(spec, None)),
            },
        },
    }


def _rollout_strategy() -> dict[str, Any]:
    # A rollout never takes a ready pod away before its replacement is ready: with
    # one replica that pod is the whole service, and a fleet the replica rule sized
    # for the demand breaks the SLO one pod short. The price, with GPUs: the surge
    # pod needs a free GPU, and on a full node the rollout waits (the Deployment
    # reports ProgressDeadlineExceeded, the old pods keep serving, and a pending pod
    # is what a cluster autoscaler adds a node for). A stalled rollout is safe; a
    # rollout that drops the only pod is an outage.
    return {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}


# A budget allows evictions one pod at a time. Below 2 replicas there is none: with
# one pod, any budget either blocks node drains for ever or protects nothing.
DISRUPTION_BUDGET_MIN_REPLICAS = 2


def build_disruption_budget(policy: Mapping[str, Any], spec: PolicySpec) -> dict[str, Any] | None:
    """The PodDisruptionBudget `<name>`, or None when the policy runs fewer than 2 replicas.

    maxUnavailable 1 rather than minAvailable 1: a drain evicts one pod at a time
    however many the replica rule runs (minAvailable 1 would let it take all but
    one), and a pod that is already unready spends the budget, so the last ready
    pod is never evicted.
    """
    if spec.replicas < DISRUPTION_BUDGET_MIN_REPLICAS:
        return None
    name = policy["metadata"]["name"]
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(policy, name),
        "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector_labels(name)}},
    }


def server_args(spec: PolicySpec, mode: Mode) -> list[str]:
    """`batchpilot serve` flags; the batching knobs come from the mounted config file."""
    return [
        "serve",
        "--model", model_argument(spec.server),
        "--mode", mode,
        "--port", str(SERVER_PORT),
        "--host", "0.0.0.0",
        "--device", spec.server.device,
        "--kv-cache-mb", str(spec.server.kv_cache_mb),
        "--admin-token-file", f"{TOKEN_DIR}/{TOKEN_KEY}",
        "--config-file", f"{CONFIG_DIR}/{CONFIG_KEY}",
        *_model_flags(spec.server),
    ]


def model_argument(server: ServerSpec) -> str:
    """`--model`: the preset's name, or the reference's path under the mounted volume."""
    if isinstance(server.model, ModelReference):
        return f"{MODEL_DIR}/{server.model.path}"
    return server.model


def _model_flags(server: ServerSpec) -> list[str]:
    # Only flags that differ from the server's defaults: a policy that sets none
    # keeps the pod template it had, so an operator upgrade restarts no pods for them.
    flags = []
    if server.dtype != "auto":
        flags += ["--dtype", server.dtype]
    if server.max_model_len is not None:
        flags += ["--max-model-len", str(server.max_model_len)]
    if server.served_model_name is not None:
        flags += ["--served-model-name", server.served_model_name]
    if server.api_key_secret is not None:
        flags += ["--api-key-file", f"{API_KEY_DIR}/{API_KEY_FILE}"]
    return flags


def startup_probe(server: ServerSpec) -> dict[str, Any]:
    """Holds off liveness and readiness until the model is loaded and the server answers.

    Without it a model that loads for minutes would be killed by the liveness probe
    and restarted for ever.
    """
    period = STARTUP_PROBE_PERIOD_SECONDS
    return {
        "httpGet": {"path": "/readyz", "port": "http"},
        "periodSeconds": period,
        "failureThreshold": math.ceil(server.startup_timeout_seconds / period),
    }


def _model_volume(server: ServerSpec) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volume mounts) that bring a model reference's weights in, read-only."""
    reference = server.model
    if not isinstance(reference, ModelReference):
        return [], []
    volume = {
        "name": MODEL_VOLUME,
        "persistentVolumeClaim": {"claimName": reference.claim_name, "readOnly": True},
    }
    mount: dict[str, Any] = {"name": MODEL_VOLUME, "mountPath": MODEL_DIR, "readOnly": True}
    if reference.sub_path:
        mount["subPath"] = reference.sub_path
    return [volume], [mount]


def _api_key_volume(
    secret: ApiKeySecret | None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, volume mounts) that bring the API key's Secret key in, read-only.

    The kubelet reads the Secret, not the operator: its value never passes through
    the operator's memory, logs or the policy's status. A Secret (or key) that does
    not exist holds the pod in ContainerCreating, which `kubectl describe pod` names.
    """
    if secret is None:
        return [], []
    volume = {
        "name": API_KEY_VOLUME,
        "secret": {
            "secretName": secret.name,
            "items": [{"key": secret.key, "path": API_KEY_FILE}],
            "defaultMode": 0o440,
        },
    }
    mount = {"name": API_KEY_VOLUME, "mountPath": API_KEY_DIR, "readOnly": True}
    return [volume], [mount]


def _resources(spec: PolicySpec) -> dict[str, Any]:
    # Quantities as strings, the form the API server answers with: an integer here
    # would read as drift ("2" != 2) and be patched on every reconcile.
    resources = {
        key: {name: _quantity(amount) for name, amount in value.items()}
        for key, value in spec.server.resources.items()
        if isinstance(value, dict)
    }
    if spec.server.gpus > 0:
        resources.setdefault("limits", {})[GPU_RESOURCE] = str(spec.server.gpus)
    return resources


def _quantity(amount: Any) -> Any:
    return str(amount) if isinstance(amount, int) and not isinstance(amount, bool) else amount


def _pod_spec(name: str, spec: PolicySpec, mode: Mode) -> dict[str, Any]:
    model_volumes, model_mounts = _model_volume(spec.server)
    key_volumes, key_mounts = _api_key_volume(spec.server.api_key_secret)
    container: dict[str, Any] = {
        "name": "server",
        "image": spec.server.image,
        "imagePullPolicy": "IfNotPresent",
        "args": server_args(spec, mode),
        "ports": [{"name": "http", "containerPort": SERVER_PORT, "protocol": "TCP"}],
        "env": [{"name": "HOME", "value": "/tmp"}],
        "startupProbe": startup_probe(spec.server),
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": "http"},
            "periodSeconds": 5,
            "failureThreshold": 2,
        },
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": "http"},
            "initialDelaySeconds": 10,
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRESTOP_SLEEP_SECONDS)]}}},
        "resources": _resources(spec),
        "securityContext": {
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "batching", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "admin-token", "mountPath": TOKEN_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
            *model_mounts,
            *key_mounts,
        ],
    }
    pod: dict[str, Any] = {
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": NON_ROOT_UID,
            "runAsGroup": NON_ROOT_UID,
            "fsGroup": NON_ROOT_UID,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "batching", "configMap": {"name": config_map_name(name)}},
            {
                "name": "admin-token",
                "secret": {"secretName": secret_name(name), "defaultMode": 0o440},
            },
            {"name": "tmp", "emptyDir": {}},
            *model_volumes,
            *key_volumes,
        ],
    }
    if spec.server.gpus > 0:
        pod["tolerations"] = [
            {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        ]
    return pod
