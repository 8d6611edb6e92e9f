"""A newcomer's install: `pip install .` into a fresh virtualenv, without the dev extras,
from exactly what the Dockerfile copies; then `batchpilot serve` answers a request and a
short `batchpilot demo` runs to its plot and summary, both from that virtualenv."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
from batchpilot_tools.prometheus_local import free_port

from tests.support import ROOT
from tests.support.servers import ServerProcess, wait_ready

TORCH_SPEC = "torch==2.13.0"  # the pin the Makefile and the Dockerfile install
INSTALL_DEADLINE_S = 900  # torch and the dependencies from pip's cache, on two busy cores
# A first start imports torch without bytecode (`--no-compile`): slower than the fixtures'.
START_DEADLINE_S = 180.0
DEMO_DEADLINE_S = 300
DEV_ONLY = ("pytest", "openai", "kmock", "hypothesis")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.timeout(INSTALL_DEADLINE_S + DEMO_DEADLINE_S)


def dockerfile_sources() -> list[str]:
    """What the Dockerfile's build stage copies into its source folder."""
    sources = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not words[1].startswith("--from"):
            sources += words[1:-1]
    return sources


def run(command: Sequence[str | Path], cwd: Path, timeout_s: float) -> str:
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, capture_output=True, text=True, timeout=timeout_s
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done.stdout


@dataclass(frozen=True)
class Install:
    venv: Path
    clone: Path  # the sources it was installed from, where a newcomer then runs commands

    @property
    def batchpilot(self) -> str:
        return str(self.venv / "bin" / "batchpilot")


@pytest.fixture(scope="module")
def install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    root = tmp_path_factory.mktemp("install")
    source = root / "src"
    source.mkdir()
    for name in dockerfile_sources():
        path = ROOT / name
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy(path, source / name)
    env = root / "venv"
    run([sys.executable, "-m", "venv", env], root, 120)
    # One resolve for both; the package without extras, as a user installs it. No bytecode
    # compiled up front: only what the commands import is compiled, as they import it.
    pip = [env / "bin" / "pip", "install", "--quiet", "--no-compile"]
    run([*pip, TORCH_SPEC, source], root, INSTALL_DEADLINE_S)
    return Install(env, source)


def test_the_copied_sources_are_what_pip_install_needs() -> None:
    assert sorted(dockerfile_sources()) == sorted(
        ["pyproject.toml", "README.md", "server", "operator", "tools"]
    )


def test_the_install_has_no_dev_extras(install: Install, tmp_path: Path) -> None:
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    python = install.venv / "bin" / "python"
    out = run([python, "-c", probe, *DEV_ONLY, "matplotlib"], tmp_path, 60)
    assert out.strip() == "['matplotlib']"


def test_serve_from_the_fresh_install_answers_a_completion(
    install: Install, tmp_path: Path
) -> None:
    port = free_port()
    command = [
        install.batchpilot, "serve", "--model", "tiny", "--port", str(port),
        "--device", "cpu", "--threads", "1",
    ]  # fmt: skip
    stderr_path = tmp_path / "serve.stderr"
    with stderr_path.open("wb") as stderr:
        # from the clone's root, as the README runs it (its `operator/` folder beside)
        proc = subprocess.Popen(
            command, cwd=install.clone, stdout=subprocess.DEVNULL, stderr=stderr
        )
    server = ServerProcess(f"http://127.0.0.1:{port}", port, None, proc, stderr_path)
    try:
        wait_ready(server, START_DEADLINE_S)
        request = urllib.request.Request(
            f"{server.url}/v1/completions",
            data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            body = json.load(response)
        assert body["object"] == "text_completion" and body["choices"][0]["text"] is not None
        assert 1 <= body["usage"]["completion_tokens"] <= 4
        assert server.terminate() == 0, server.stderr_tail()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_short_demo_from_the_fresh_install_runs_to_its_plot_and_summary(
    install: Install, tmp_path: Path
) -> None:
    out = tmp_path / "demo.png"
    # The shortest demo it allows: four tuner intervals.
    command = [
        install.batchpilot, "demo", "--duration", "4", "--interval", "1",
        "--out", str(out),
    ]  # fmt: skip
    # its own session, so that a demo past its deadline is killed with every server it
    # started; from the clone's root, where the README runs it: the servers it starts must
    # not import the clone's `operator/` folder as the standard library's `operator`
    proc = subprocess.Popen(
        command, cwd=install.clone, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=DEMO_DEADLINE_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-4000:]
    assert "batchpilot demo summary" in output, output[-4000:]
    assert f"plot: {out}" in output
    assert out.read_bytes().startswith(PNG_MAGIC)
