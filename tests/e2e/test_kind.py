"""End to end on a real cluster (kind): run by tests/e2e/run-kind.sh (`make e2e-kind`).

Skipped unless BATCHPILOT_E2E_KUBECONFIG points at a cluster where manifests/
is applied and the operator runs. Not run in this repository's CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from batchpilot_tools.prometheus_local import free_port

KUBECONFIG = os.environ.get("BATCHPILOT_E2E_KUBECONFIG", "")
ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "batchpilot-e2e"
NAME = "e2e"
OWNED = (("deployment", NAME), ("service", NAME), ("configmap", f"{NAME}-batching"),
         ("secret", f"{NAME}-admin"))
T = TypeVar("T")

pytestmark = [
    pytest.mark.e2e_kind,
    pytest.mark.skipif(not KUBECONFIG, reason="set BATCHPILOT_E2E_KUBECONFIG (make e2e-kind)"),
    pytest.mark.timeout(900),
]


def kubectl(*args: str, stdin: str | None = None, check: bool = True) -> str:
    result = subprocess.run(
        ["kubectl", "--kubeconfig", KUBECONFIG, *args],
        input=stdin, capture_output=True, text=True, timeout=300,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"kubectl {' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout


def poll(probe: Callable[[], T | None], what: str, timeout: float) -> T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = probe()
        if found:
            return found
        time.sleep(2)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def policy() -> dict[str, Any]:
    body = yaml.safe_load((ROOT / "manifests" / "examples" / "cpu-policy.yaml").read_text())
    body["metadata"] = {"name": NAME, "namespace": NAMESPACE}
    spec = body["spec"]
    spec.pop("autoscale")  # one fixed pod: a kind node has room for little more
    spec["replicas"] = 1
    if "BATCHPILOT_IMAGE" in os.environ:  # else the CRD's default, set by manifests/base
        spec["server"]["image"] = os.environ["BATCHPILOT_IMAGE"]
    spec["server"]["resources"] = {"requests": {"cpu": "500m", "memory": "512Mi"}}
    spec["autotune"].update({"intervalSeconds": 5, "windowSeconds": 10})
    return body


@contextmanager
def port_forward(service: str, remote: int) -> Iterator[str]:
    local = free_port()
    process = subprocess.Popen(
        ["kubectl", "--kubeconfig", KUBECONFIG, "-n", NAMESPACE, "port-forward",
         f"service/{service}", f"{local}:{remote}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{local}"
    try:
        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=2) as response:
                    return response.status == 200
            except (urllib.error.URLError, ConnectionError):
                return False

        poll(ready, f"{url}/readyz through port-forward", 60)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)


def get_policy() -> dict[str, Any]:
    return dict(json.loads(kubectl("-n", NAMESPACE, "get", "bp", NAME, "-o", "json")))


def test_policy_runs_tunes_and_cleans_up() -> None:
    kubectl("create", "namespace", NAMESPACE, check=False)
    kubectl("apply", "-f", "-", stdin=yaml.safe_dump(policy()))
    try:
        for kind, name in OWNED:
            kubectl("-n", NAMESPACE, "get", kind, name)
        kubectl("-n", NAMESPACE, "wait", "--for=condition=Ready", f"bp/{NAME}", "--timeout=600s")

        with port_forward(NAME, 8000) as url:
            load = subprocess.Popen(
                [sys.executable, "-m", "batchpilot_server.cli", "loadgen", "--url", url,
                 "--arrival", "concurrency", "--concurrency", "16", "--duration", "240",
                 "--output-len", "fixed:64", "--no-progress"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            )
            try:
                decided = poll(
                    lambda: (get_policy().get("status") or {}).get("lastDecision"),
                    "a tuning decision in status.lastDecision", 240,
                )
            finally:
                load.terminate()
                load.wait(timeout=30)
        assert decided["action"] and decided["reason"]
    finally:
        kubectl("-n", NAMESPACE, "delete", "bp", NAME, "--wait=true", "--timeout=120s",
                check=False)

    def all_gone() -> bool:
        return all(
            not kubectl("-n", NAMESPACE, "get", kind, name, "--ignore-not-found", "-o", "name")
            for kind, name in OWNED
        )

    poll(all_gone, "the owned objects to be garbage-collected", 120)
