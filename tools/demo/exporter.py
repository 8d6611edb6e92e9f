"""The SLO and KV watermark gauges the operator would publish for the demo's policy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from batchpilot_operator.policy_metrics import PolicyMetrics
from batchpilot_operator.slo import KV_HIGH_WATERMARK
from batchpilot_tools.demo.options import NAMESPACE, POLICY, DemoOptions


@contextlib.contextmanager
def policy_exporter(options: DemoOptions) -> Iterator[str]:
    """Serves the gauges on a free port while the block runs; yields host:port."""
    metrics = PolicyMetrics()
    if options.slo_p99_ms is not None:  # the gauge holds the end-to-end target only
        metrics.publish(
            NAMESPACE, POLICY, slo_p99_ms=options.slo_p99_ms, kv_high_watermark=KV_HIGH_WATERMARK
        )
    http, thread = metrics.serve(0, addr="127.0.0.1")
    try:
        yield f"127.0.0.1:{http.server_port}"
    finally:
        http.shutdown()
        thread.join(timeout=5)
