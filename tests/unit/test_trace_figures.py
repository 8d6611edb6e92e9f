"""bench/trace_figures.py: the figures the production-trace scenario takes, on a tiny CSV
in the Azure LLM inference trace's schema."""

from __future__ import annotations

import sys
from pathlib import Path

# bench/ is scripts, not a package: its modules import each other by bare name
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import trace_figures


def test_figures_of_a_small_trace(tmp_path: Path) -> None:
    # 4 requests in the first 30-s window, none in the second, 1 in the third (at 60 s)
    rows = [("00.0000000", 100, 10), ("01.0000000", 200, 20), ("02.0000000", 300, 30),
            ("03.0000000", 400, 40), ("60.0000000", 500, 50)]  # fmt: skip
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for at, prompt, output in rows:
        seconds = float(at)
        stamp = f"2023-11-16 18:{int(seconds // 60):02d}:{seconds % 60:010.7f}"
        lines.append(f"{stamp},{prompt},{output}")
    path = tmp_path / "trace.csv"
    path.write_text("\n".join(lines) + "\n")
    out = trace_figures.figures(str(path))
    assert out["requests"] == 5
    assert out["prompt"] == {"p10": 100, "p50": 300, "p90": 400, "p99": 400, "mean": 300}
    assert out["output"]["mean"] == 30
    windows = out["window_30s_over_mean"]  # two whole windows: 4 and 0 requests, mean 2
    assert windows["max"] == 2.0 and windows["share_empty"] == 0.5 and windows["share_2x"] == 0.5
    assert out["gap_cv"] > 1.0  # four quick gaps, then a long one: burstier than Poisson
