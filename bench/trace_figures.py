"""The figures bench/planners.py's production-trace scenario takes from a published trace.

Reads one CSV of the Azure LLM inference trace 2023 (Azure/AzurePublicDataset,
`data/AzureLLMInferenceTrace_code.csv` or `_conv.csv`: TIMESTAMP, ContextTokens,
GeneratedTokens; the data of Splitwise, Patel et al., ISCA 2024) and prints, as one JSON
line, the prompt and output token percentiles and means, the inter-arrival gaps'
coefficient of variation (1 for Poisson arrivals), and the arrivals per 30-s window
(a tuning round) over their mean: median, p90, max, and the shares of windows at twice
the mean or more and of empty windows. Standard library only; the trace is not in the
repository (download it from the dataset's page).

    python3 bench/trace_figures.py AzureLLMInferenceTrace_code.csv
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from datetime import datetime
from itertools import pairwise
from typing import Any

WINDOW_S = 30.0


def _quantile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def figures(path: str) -> dict[str, Any]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    times = [
        datetime.strptime(r["TIMESTAMP"][:26], "%Y-%m-%d %H:%M:%S.%f").timestamp() for r in rows
    ]
    gaps = [b - a for a, b in pairwise(times)]
    counts = [0] * int((times[-1] - times[0]) // WINDOW_S)  # whole windows only
    for t in times:
        at = int((t - times[0]) // WINDOW_S)
        if at < len(counts):
            counts[at] += 1
    mean = statistics.mean(counts)
    out: dict[str, Any] = {"requests": len(rows), "minutes": round((times[-1] - times[0]) / 60, 1)}
    for name, field in (("prompt", "ContextTokens"), ("output", "GeneratedTokens")):
        values = [int(r[field]) for r in rows]
        out[name] = {
            **{f"p{round(q * 100)}": _quantile(values, q) for q in (0.1, 0.5, 0.9, 0.99)},
            "mean": round(statistics.mean(values)),
        }
    out["gap_cv"] = round(statistics.pstdev(gaps) / statistics.mean(gaps), 2)
    out["window_30s_over_mean"] = {
        "median": round(statistics.median(counts) / mean, 2),
        "p90": round(_quantile(counts, 0.9) / mean, 2),
        "max": round(max(counts) / mean, 2),
        "share_2x": round(sum(c >= 2 * mean for c in counts) / len(counts), 3),
        "share_empty": round(sum(c == 0 for c in counts) / len(counts), 3),
    }
    return out


if __name__ == "__main__":
    print(json.dumps(figures(sys.argv[1])))
