"""`batchpilot operator`: argument errors, no torch, and a real run against the emulator."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from batchpilot_operator import kube
from batchpilot_operator.main import main

from tests.support.commands import BATCHPILOT, DEADLINE_S
from tests.support.k8s_emulator import run_cluster
from tests.support.policies import policy_object
from tests.support.servers import free_port
from tests.support.usage import refused_usage


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        ([], "one of the arguments --namespace/-n --all-namespaces/-A is required"),
        (["-A", "-n", "x"], "not allowed with argument"),
        (["-n", "team-*"], "patterns are not supported"),
        (["-A", "--prometheus-url", "prometheus:9090"], "must be an http(s) URL"),
        (["-A", "--liveness-port", "70000"], "must be 0..65535"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert words in refused_usage(main, argv, capsys)


@pytest.mark.parametrize(
    ("kubeconfig", "words"),
    [
        ("/nonexistent/kubeconfig", "cannot read kubeconfig /nonexistent/kubeconfig: No such file"),
        (None, "no Kubernetes credentials: not in a pod, and neither $KUBECONFIG nor"),
    ],
)
def test_missing_credentials_exit_1_at_once_with_the_reason(
    tmp_path: Path, kubeconfig: str | None, words: str
) -> None:
    """Kopf would retry the startup every minute for ever; nothing here can change."""
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["HOME"] = str(tmp_path)  # no ~/.kube/config
    if kubeconfig is not None:
        env["KUBECONFIG"] = kubeconfig
    argv = ["operator", "-A", "--liveness-port", "0", "--metrics-port", "0"]
    exited = subprocess.run(
        [str(BATCHPILOT), *argv], env=env, capture_output=True, text=True, timeout=DEADLINE_S
    )
    assert exited.returncode == 1
    last = exited.stderr.strip().splitlines()[-1]
    assert last.startswith(f"batchpilot operator: error: {words}"), exited.stderr


def test_the_operator_never_imports_torch() -> None:
    code = (
        "import sys\n"
        "from batchpilot_operator.main import load_handlers\n"
        "load_handlers()\n"
        "loaded = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, cwd="/")


def wait_live(url: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert process.poll() is None, "the operator exited early"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} did not answer 200 within {DEADLINE_S:g}s")


async def test_operator_command_serves_liveness_reconciles_and_stops_on_sigterm(
    tmp_path: Path,
) -> None:
    port, metrics_port = free_port(), free_port()
    log = tmp_path / "operator.log"
    with run_cluster() as cluster, log.open("w") as sink:
        env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig)}
        process = subprocess.Popen(
            [str(BATCHPILOT), "operator", "--all-namespaces", "--liveness-port", str(port),
             "--metrics-port", str(metrics_port)],
            env=env, stdout=sink, stderr=subprocess.STDOUT, text=True,
        )
        try:
            wait_live(f"http://127.0.0.1:{port}/healthz", process)
            wait_live(f"http://127.0.0.1:{metrics_port}/metrics", process)
            await cluster.create(kube.POLICIES, policy_object("cli", "team", {}))
            await cluster.wait_for(kube.DEPLOYMENTS, "team", "cli", timeout=DEADLINE_S)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=DEADLINE_S) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    lines = [line for line in log.read_text().splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # structured: every line is JSON
    assert any(r.get("object", {}).get("name") == "cli" for r in records), lines[-5:]
