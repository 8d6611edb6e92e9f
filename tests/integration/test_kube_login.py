"""How the operator and Kopf log in: the client's loaders, from kubeconfigs a test writes.

The exec plugin is a tiny script that prints an ExecCredential, as `aws eks
get-token`, `gke-gcloud-auth-plugin` or `kubelogin` do; the emulator records
the Authorization header of every request it gets.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import pytest
import yaml
from batchpilot_operator import kube
from kubernetes.config import incluster_config

from tests.support.k8s_emulator import Cluster, run_cluster, run_operator
from tests.support.policies import policy_object

EXEC_API = "client.authentication.k8s.io/v1"
# argv: the file of issued tokens, the token's prefix, and "expired" for a token that expires
# as it is issued (the client counts a token as expired 5 minutes early).
PLUGIN = """\
import datetime, json, pathlib, sys
issued = pathlib.Path(sys.argv[1])
before = issued.read_text().split() if issued.exists() else []
token = f"{sys.argv[2]}-{len(before) + 1}"
issued.write_text("\\n".join([*before, token]))
status = {"token": token}
if sys.argv[3:] == ["expired"]:
    status["expirationTimestamp"] = datetime.datetime.now(datetime.UTC).isoformat()
print(json.dumps({"apiVersion": "EXEC_API", "kind": "ExecCredential", "status": status}))
""".replace("EXEC_API", EXEC_API)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with run_cluster() as running:
        yield running


def write_kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any]) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "test", "cluster": cluster}],
                "users": [{"name": "test", "user": user}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
            }
        )
    )
    return path


def exec_kubeconfig(directory: Path, url: str, *plugin_args: str) -> tuple[Path, Path]:
    """A kubeconfig whose user is an exec plugin, and the file listing the tokens it issued."""
    plugin = directory / "plugin.py"
    plugin.write_text(PLUGIN)
    issued = directory / "issued"
    user = {
        "exec": {
            "apiVersion": EXEC_API,
            "command": sys.executable,
            "args": [str(plugin), str(issued), *plugin_args],
            "interactiveMode": "Never",
        }
    }
    return write_kubeconfig(directory / "kubeconfig", {"server": url}, user), issued


def authorizations(cluster: Cluster, user_agent: str) -> list[str]:
    """The Authorization header of each request the emulator got from `user_agent`."""
    headers = [
        {k.lower(): v for k, v in request.headers.items()} for request in cluster.emulator.requests
    ]
    return [
        h.get("authorization", "")
        for h in headers
        if h.get("user-agent", "").startswith(user_agent)
    ]


async def test_the_operator_and_kopf_log_in_through_an_exec_plugin(
    cluster: Cluster, tmp_path: Path
) -> None:
    kubeconfig, issued = exec_kubeconfig(tmp_path, cluster.url, "eks-token")
    with run_operator(dataclasses.replace(cluster, kubeconfig=kubeconfig)):
        await cluster.create(
            kube.POLICIES,
            policy_object("llm", "exec", {"replicas": 1, "autotune": {"enabled": False}}),
        )
        await cluster.wait_for(kube.DEPLOYMENTS, "exec", "llm")
    ours, kopfs = authorizations(cluster, kube.USER_AGENT), authorizations(cluster, "kopf/")
    assert ours and kopfs
    sent = set(ours) | set(kopfs)
    assert all(header.startswith("Bearer eks-token-") for header in sent), sent
    assert sent <= {f"Bearer {token}" for token in issued.read_text().split()}


async def test_an_expired_exec_token_is_fetched_again_before_the_next_call(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kubeconfig, issued = exec_kubeconfig(tmp_path, cluster.url, "short", "expired")
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    client = kube.Client.login(kopf.OperatorSettings())
    try:
        for _ in range(3):
            await client.get(kube.CONFIGMAPS, "expiring", "absent")
    finally:
        await client.close()
    sent = authorizations(cluster, kube.USER_AGENT)[-3:]
    assert len(set(sent)) == 3  # a fresh token each time: each one expired at once
    assert set(sent) <= {f"Bearer {token}" for token in issued.read_text().split()}


def test_kopf_gets_the_clusters_ca_and_the_users_client_certificate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca, cert, key = b"--- the CA ---", b"--- a client cert ---", b"--- its key ---"
    kubeconfig = write_kubeconfig(
        tmp_path / "kubeconfig",
        {
            "server": "https://api.example:6443",
            "certificate-authority-data": base64.b64encode(ca).decode(),
        },
        {
            "client-certificate-data": base64.b64encode(cert).decode(),
            "client-key-data": base64.b64encode(key).decode(),
        },
    )
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    info = kube.connection_info(kopf.OperatorSettings())
    assert (info.server, info.insecure, info.token) == ("https://api.example:6443", False, None)
    assert info.ca_path and Path(info.ca_path).read_bytes() == ca  # type: ignore[arg-type]
    assert info.certificate_path and Path(info.certificate_path).read_bytes() == cert  # type: ignore[arg-type]
    assert info.private_key_path and Path(info.private_key_path).read_bytes() == key  # type: ignore[arg-type]


def test_in_a_pod_the_service_account_comes_before_any_kubeconfig(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, ca = tmp_path / "token", tmp_path / "ca.crt"
    token.write_text("service-account-token")
    ca.write_text("--- the cluster CA ---")
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(token))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(ca))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    info = kube.connection_info(kopf.OperatorSettings())
    assert info.server == "https://127.0.0.1:6443"
    assert (str(info.scheme).lower(), info.token) == ("bearer", "service-account-token")
    assert info.ca_path == str(ca)


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (
            {"apiVersion": "v1", "kind": "Config", "clusters": [], "users": [], "contexts": []},
            "cannot log in with kubeconfig",
        ),
        ("not: [a, kubeconfig", "cannot log in with kubeconfig"),
    ],
    ids=["no-context", "not-yaml"],
)
def test_a_kubeconfig_the_client_cannot_use_is_a_permanent_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, content: Any, words: str
) -> None:
    """Permanent: Kopf would otherwise retry the login for ever."""
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(content if isinstance(content, str) else json.dumps(content))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    with pytest.raises(kopf.PermanentError, match=words):
        kube.connection_info(kopf.OperatorSettings())
