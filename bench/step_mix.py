"""What a step that mixes a prompt chunk with decode rows costs on the real engine, against
the simulator's step-time model.

The engine runs a step's prompt tokens and decode rows as one forward
(`ModelRunner.step`); the simulator times a step from the engine benchmark's decode curve.
This measures, on the `tiny` preset (continuous, one torch thread, prefix caching off so
a prompt computes every token), the median seconds of:

- decode-only steps at several row counts (the curve),
- prefill-only steps of P prompt tokens, and
- mixed steps of r decode rows and a P-token prompt,

and compares each mixed step with the two models a simulator could use, both read from
the engine's own decode curve: one forward (a decode step of r + P rows) and two forwards
(a decode step of r rows plus one of P). Prints a table and a final JSON line; `--write`
puts the table in docs/benchmarks.md.

Usage: bench/step_mix.py [--write]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
from pathlib import Path

import numpy as np
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine.request_stream import RequestStream
from batchpilot_server.engine.sampling import SamplingParams
from batchpilot_server.engine_api import EngineOptions, NullObserver
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent

DECODE_ROWS = (1, 8, 16, 24, 40, 64, 88)
MIXED_ROWS = (0, 1, 8, 24)
PROMPT_TOKENS = (16, 64)
PROMPTS_PER_POINT = 24
SECTION = "step-mix"


class StepTimes(NullObserver):
    """Each step's seconds by its (decode rows, prompt tokens)."""

    def __init__(self) -> None:
        self.shape: tuple[int, int] | None = None
        self.seconds: dict[tuple[int, int], list[float]] = collections.defaultdict(list)

    def on_step_work(self, decode_rows: int, prefill_tokens: int, kv_tokens: int) -> None:
        self.shape = (decode_rows, prefill_tokens)

    def on_step(self, batch_size: int, duration_s: float) -> None:
        if self.shape is not None:
            self.seconds[self.shape].append(duration_s)

    def median(self, rows: int, tokens: int) -> float | None:
        seen = self.seconds.get((rows, tokens), [])
        return statistics.median(seen) if len(seen) >= 5 else None


async def measure() -> StepTimes:
    times = StepTimes()
    config = BatchingConfig(max_batch_size=128, prefill_token_budget=2048)
    options = EngineOptions(
        mode="continuous", config=config, device="cpu", kv_cache_mb=96, threads=1,
        prefix_caching=False, model="tiny",
    )  # fmt: skip
    engine = Engine(options, times)
    await engine.start()
    decode = SamplingParams(max_tokens=600, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        for rows in sorted(set(DECODE_ROWS) | set(MIXED_ROWS)):
            streams = [engine.submit([3 + i % 200, 7, 11], decode) for i in range(rows)]
            await asyncio.sleep(0.2 + 0.01 * rows)  # every row past its prompt
            if rows in MIXED_ROWS:
                for n in range(PROMPTS_PER_POINT * len(PROMPT_TOKENS)):
                    tokens = PROMPT_TOKENS[n % len(PROMPT_TOKENS)]
                    await _drain(engine.submit([5 + (n + i) % 250 for i in range(tokens)], one))
                    await asyncio.sleep(0.005)  # a few decode-only steps between prompts
            else:
                await asyncio.sleep(0.5)
            for stream in streams:
                stream.cancel()
            await asyncio.sleep(0.2)
    finally:
        await engine.shutdown()
    return times


async def _drain(stream: RequestStream) -> None:
    async for _ in stream:
        pass


def compare(times: StepTimes) -> dict:
    curve = {r: times.median(r, 0) for r in DECODE_ROWS}
    xs = [r for r, s in curve.items() if s is not None]
    ys = [curve[r] for r in xs]

    def decode_s(rows: int) -> float:
        if rows <= 0:
            return 0.0
        if rows >= xs[-1]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (rows - xs[-1])
        return float(np.interp(rows, xs, ys))

    points = []
    for rows in MIXED_ROWS:
        for tokens in PROMPT_TOKENS:
            measured = times.median(rows, tokens)
            if measured is None:
                continue
            one, two = decode_s(rows + tokens), decode_s(rows) + decode_s(tokens)
            points.append({
                "rows": rows, "prompt_tokens": tokens, "measured_ms": round(measured * 1e3, 3),
                "one_forward_ms": round(one * 1e3, 3), "two_forwards_ms": round(two * 1e3, 3),
                "one_forward_err": round(one / measured - 1, 3),
                "two_forwards_err": round(two / measured - 1, 3),
            })  # fmt: skip
    return {
        "decode_ms": {r: round(s * 1e3, 3) for r, s in zip(xs, ys, strict=True)},
        "points": points,
        "mean_abs_err": {
            model: round(statistics.mean(abs(p[f"{model}_err"]) for p in points), 3)
            for model in ("one_forward", "two_forwards")
        } if points else {},
    }  # fmt: skip


def table(result: dict) -> str:
    rows = [
        "## A mixed step's cost (bench/step_mix.py)",
        "",
        "Real engine, `tiny` preset, continuous, one torch thread, prefix caching off; median "
        "step seconds over the steps of each shape. Decode curve (ms by rows): "
        + ", ".join(f"{r}: {s}" for r, s in result["decode_ms"].items())
        + ". Each mixed step against a decode step of r + P rows (one forward, what the "
        "simulator charges) and a decode step of r rows plus one of P (two forwards).",
        "",
        "| decode rows r | prompt tokens P | measured ms | one forward ms (err) | "
        "two forwards ms (err) |",
        "|---|---|---|---|---|",
    ]
    for p in result["points"]:
        rows.append(
            f"| {p['rows']} | {p['prompt_tokens']} | {p['measured_ms']} | "
            f"{p['one_forward_ms']} ({p['one_forward_err']:+.0%}) | "
            f"{p['two_forwards_ms']} ({p['two_forwards_err']:+.0%}) |"
        )
    err = result["mean_abs_err"]
    rows += [
        "",
        f"Mean absolute error: one forward {err['one_forward']:.0%}, two forwards "
        f"{err['two_forwards']:.0%}.",
    ]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help="write the table to docs/benchmarks.md")
    args = ap.parse_args()
    result = compare(asyncio.run(measure()))
    text = table(result)
    print(text)
    if args.write:
        replace_section(ROOT / "docs" / "benchmarks.md", SECTION, text)
    print(json.dumps({"bench": "step_mix", **result}))


if __name__ == "__main__":
    main()
