"""The shared Prometheus fixture: a real process scraping a real metrics endpoint."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from wsgiref.simple_server import WSGIServer

import pytest
from batchpilot_tools.prometheus_local import LocalPrometheus, scrape_config
from prometheus_client import CollectorRegistry, Gauge, start_http_server

from tests.support.prometheus import PrometheusError, requires_prometheus, run_prometheus

pytestmark = requires_prometheus


@pytest.fixture
def exporter() -> Iterator[tuple[str, Gauge]]:
    """A real prometheus_client HTTP exporter with one gauge; yields (host:port, gauge)."""
    registry = CollectorRegistry()
    gauge = Gauge("fixture_probe_value", "probe", registry=registry)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    assert isinstance(server, WSGIServer)
    try:
        yield f"127.0.0.1:{server.server_port}", gauge
    finally:
        server.shutdown()
        thread.join(timeout=5)


def _port_is_open(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_scrapes_with_labels_and_survives_restart(
    tmp_path: Path, exporter: tuple[str, Gauge]
) -> None:
    target, gauge = exporter
    gauge.set(42)
    with run_prometheus(
        tmp_path, [target], labels={"policy": "demo"}, target_labels={target: {"pod": "p0"}}
    ) as prom:
        prom.wait_for_targets_up()
        first = prom.wait_for_data('fixture_probe_value{policy="demo", pod="p0"}')
        assert float(first[0]["value"][1]) == 42.0
        port = prom.port
        assert port is not None

        prom.stop()
        assert not _port_is_open(port)
        with pytest.raises(PrometheusError):
            prom.query("up")

        prom.start()
        assert prom.port == port
        # Samples scraped before the restart are still there (same data dir).
        kept = prom.query("max_over_time(fixture_probe_value[10m])")
        assert float(kept[0]["value"][1]) == 42.0
    assert not prom.running()
    assert not _port_is_open(port)


def test_bad_query_reports_prometheus_error(tmp_path: Path, exporter: tuple[str, Gauge]) -> None:
    target, _ = exporter
    with run_prometheus(tmp_path, [target]) as prom, pytest.raises(
        PrometheusError, match="parse error"
    ):
        prom.query("rate(fixture_probe_value[")


def test_missing_binary_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PROMETHEUS_BIN", str(tmp_path / "no-such-prometheus"))
    with pytest.raises(PrometheusError, match="prometheus binary not found"):
        LocalPrometheus(tmp_path, scrape_config(["127.0.0.1:1"]))


def test_labels_for_unknown_target_rejected() -> None:
    with pytest.raises(ValueError, match=r"not scraped: 10\.0\.0\.9:80"):
        scrape_config(["127.0.0.1:1"], target_labels={"10.0.0.9:80": {"pod": "x"}})
