"""A Prometheus process on 127.0.0.1 scraping fixed targets: for the demo and the tests.

Torch-free. It writes a static scrape config (one group per target, so each
target can carry its own labels, the way Kubernetes relabelling would give a
pod its `policy`, `namespace` and `pod`), starts Debian's `prometheus` binary
on a free port, and answers instant queries over the HTTP API.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

DEFAULT_BINARY = "prometheus"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
# How many fresh ports to try when the one picked was taken before Prometheus bound it.
PORT_ATTEMPTS = 3


class PrometheusError(RuntimeError):
    """Prometheus could not be started, did not answer, or rejected a query."""


def find_binary() -> str | None:
    """Path of the Prometheus binary (`$PROMETHEUS_BIN` or `prometheus` on PATH), or None."""
    return shutil.which(os.environ.get("PROMETHEUS_BIN", DEFAULT_BINARY))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def scrape_config(
    targets: Sequence[str],
    *,
    scrape_interval: str = "1s",
    rule_files: Sequence[str | Path] = (),
    labels: Mapping[str, str] | None = None,
    target_labels: Mapping[str, Mapping[str, str]] | None = None,
    job: str = "batchpilot",
) -> dict[str, Any]:
    """A Prometheus config scraping `targets` (host:port) at `/metrics`.

    `labels` go on every target; `target_labels[target]` add to or override
    them for one target.
    """
    per_target = target_labels or {}
    unknown = sorted(set(per_target) - set(targets))
    if unknown:
        raise ValueError(f"target_labels name targets that are not scraped: {', '.join(unknown)}")
    groups = [
        {"targets": [target], "labels": {**(labels or {}), **per_target.get(target, {})}}
        for target in targets
    ]
    return {
        "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
        "rule_files": [str(Path(path).resolve()) for path in rule_files],
        "scrape_configs": [
            {
                "job_name": job,
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "metrics_path": "/metrics",
                "static_configs": groups,
            }
        ],
    }


class LocalPrometheus:
    """One Prometheus process; `stop()` then `start()` brings it back on the same port and data."""

    def __init__(
        self,
        workdir: Path,
        config: Mapping[str, Any],
        *,
        binary: str | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
    ) -> None:
        found = binary or find_binary()
        if found is None:
            raise PrometheusError(
                "prometheus binary not found: install it with "
                "'apt-get install -y --no-install-recommends prometheus' or set PROMETHEUS_BIN"
            )
        self.binary = found
        self.workdir = Path(workdir)
        self.config_path = self.workdir / "prometheus.yml"
        self.data_dir = self.workdir / "data"
        self.log_path = self.workdir / "prometheus.log"
        self.ready_timeout_s = ready_timeout_s
        self.port: int | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._write_config(config)

    @property
    def url(self) -> str:
        if self.port is None:
            raise PrometheusError("prometheus has not been started")
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> None:
        """Start (on a free port the first time, the same port after) and wait until ready."""
        if self.running():
            return
        if self.port is not None:
            self._launch(self.port)
            self._wait_ready()
            return
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            self._launch(self.port)
            try:
                self._wait_ready()
                return
            except PrometheusError:
                lost_port_race = "address already in use" in self._log_tail()
                self.stop()
                if not lost_port_race or attempt == PORT_ATTEMPTS - 1:
                    self.port = None
                    raise

    def stop(self) -> None:
        """Terminate gracefully (the WAL is kept, so a restart keeps the data); kill if stuck."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def reload(self) -> None:
        """Re-read the config and rule files (needs `--web.enable-lifecycle`, which we pass)."""
        self._request("/-/reload", method="POST")

    def reconfigure(self, config: Mapping[str, Any]) -> None:
        """Replace the config (new targets, say) and have the running process re-read it."""
        self._write_config(config)
        self.reload()

    def _write_config(self, config: Mapping[str, Any]) -> None:
        self.config_path.write_text(yaml.safe_dump(dict(config), sort_keys=False))

    def query(self, promql: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query, now or at Unix time `at`: the `result` list of the HTTP API
        (empty when there is no data)."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        body = self._request("/api/v1/query?" + urllib.parse.urlencode(params))
        payload = json.loads(body)
        if payload.get("status") != "success":
            raise PrometheusError(f"query {promql!r} failed: {payload.get('error', payload)}")
        return list(payload["data"]["result"])

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets as the HTTP API reports them."""
        payload = json.loads(self._request("/api/v1/targets?state=active"))
        return list(payload["data"]["activeTargets"])

    def wait_for_targets_up(self, timeout_s: float = 30.0) -> None:
        """Block until every configured target has been scraped successfully."""
        deadline = time.monotonic() + timeout_s
        while True:
            active = self.targets()
            if active and all(target["health"] == "up" for target in active):
                return
            if time.monotonic() > deadline:
                states = {t["scrapeUrl"]: (t["health"], t.get("lastError", "")) for t in active}
                raise PrometheusError(f"targets not up within {timeout_s:.0f}s: {states}")
            time.sleep(0.2)

    def wait_for_data(self, promql: str, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Poll `promql` until it returns at least one series; return that result."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(promql)
            if result:
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"no data for {promql!r} within {timeout_s:.0f}s")
            time.sleep(0.25)

    def wait_for_value(self, promql: str, at_least: float, timeout_s: float = 30.0) -> float:
        """Poll the single-series `promql` until its value reaches `at_least` (a counter
        catching up with what a test sent); return it, or fail with the last value seen."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(promql)
            value = float(result[0]["value"][1]) if result else None
            if value is not None and value >= at_least:
                return value
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"{promql!r} never reached {at_least:g} within {timeout_s:.0f}s; "
                    f"last value: {'no data' if value is None else f'{value:g}'}"
                )
            time.sleep(0.25)

    def wait_for_scrapes_after(self, moment: float, timeout_s: float = 30.0) -> None:
        """Block until every active target was last scraped after Unix time `moment`: a
        query evaluated at `moment` then sees every sample taken up to it (a scrape that
        began before `moment` stores its samples only once it is done)."""
        deadline = time.monotonic() + timeout_s
        while True:
            scraped = {t["scrapeUrl"]: _unix_time(t["lastScrape"]) for t in self.targets()}
            if scraped and min(scraped.values()) > moment:
                return
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"not every target was scraped within {timeout_s:.0f}s after {moment:.3f}: "
                    f"last scrapes {scraped}"
                )
            time.sleep(0.2)

    def __enter__(self) -> LocalPrometheus:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _launch(self, port: int) -> None:
        command = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.data_dir}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ]
        with self.log_path.open("ab") as log:
            # Own session: a terminal's Ctrl-C reaches the demo, which then stops us in order.
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if not self.running():
                raise PrometheusError(f"prometheus exited during start:\n{self._log_tail()}")
            try:
                self._request("/-/ready")
                return
            except PrometheusError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise PrometheusError(
                        f"prometheus not ready within {self.ready_timeout_s:.0f}s:\n"
                        f"{self._log_tail()}"
                    ) from None
                time.sleep(0.1)

    def _request(self, path: str, method: str = "GET") -> bytes:
        request = urllib.request.Request(self.url + path, method=method)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return bytes(response.read())
        except urllib.error.HTTPError as error:
            detail = error.read().decode(errors="replace")
            raise PrometheusError(f"{method} {path}: HTTP {error.code}: {detail}") from error
        except (urllib.error.URLError, OSError) as error:
            raise PrometheusError(f"{method} {path}: {error}") from error

    def _log_tail(self, lines: int = 20) -> str:
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


def _unix_time(rfc3339: str) -> float:
    """Prometheus's RFC 3339 time stamp (nanoseconds, `Z`) as Unix seconds."""
    head, _, fraction = rfc3339.removesuffix("Z").partition(".")
    whole = datetime.fromisoformat(head).replace(tzinfo=UTC).timestamp()
    return whole + (float(f"0.{fraction}") if fraction else 0.0)
