"""bench/slo_classes.py in a short test mode: it plays every run and prints its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_and_prints_its_json() -> None:
    out = subprocess.run(
        [sys.executable, "bench/slo_classes.py", "--duration-s", "180", "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["bench"] == "slo_classes"
    assert summary["replica_seconds_ratio"] > 0
    assert summary["burst_batch_none_lost"] is True
    # the burst's count starts at the burst (a third in): a part of the whole run's
    missed = summary["burst_interactive_windows_missed"]
    assert 0 <= missed <= summary["burst_interactive_windows_missed_whole_run"]
