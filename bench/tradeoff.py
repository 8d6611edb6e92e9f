"""The batching trade-off, measured: static, dynamic (ragged and padded) and
continuous batching across arrival rate x output-length spread x prompt length.

- map: every policy on every cell, batchpilot's schedulers under a virtual clock
  with step times measured on the model (bench/tradeoff_sim.py): throughput,
  p50/p99 latency, TTFT, hostage time, slot waste, device idle time, and which
  policy wins each cell at the SLO (docs/batching_map*.png).
- validate: cells of the map run again in real time through the real engine,
  against the simulation's figures.
- example: the README's example (max batch 8, timeout 10 ms; one request at t=0
  and three more within 10 ms, of 10/50/100/200 output tokens) over HTTP against
  a `batchpilot serve` per mode: each request's completion, the slot waste and
  the device idle time (from the server's metrics), and a timeline figure.

`--model tiny` (default) or `smollm2` (a smaller grid). Writes its sections of
docs/batching.md and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import hostage
import model_refs
import numpy as np
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.metric_names import BATCH_SLOT_STEPS_TOTAL, STEP_DURATION
from batchpilot_tools.demo.supervisor import stop_process
from batchpilot_tools.prometheus_local import free_port
from sections import replace_section
from serve import _wait_ready
from tradeoff_sim import (
    BLOCK,
    MEAN_OUTPUT,
    POLICIES,
    SPREADS,
    Figures,
    Policy,
    StepCost,
    arrivals,
    simulate,
)

DOCS = Path(__file__).resolve().parent.parent / "docs"
CONFIG = BatchingConfig(max_batch_size=8, batch_timeout_ms=10.0, max_queue_size=100_000)
# a request meets the SLO when its latency per output token is within this many
# decode steps of a full batch (queueing and batching delays included)
SLO_STEPS_PER_TOKEN = 4.0
# static mode's safety valve in the HTTP example: without one, four requests never
# fill a batch of 8 and never complete
EXAMPLE_STATIC_WAIT_MS = 500.0


@dataclass(frozen=True)
class Grid:
    loads: tuple[float, ...]  # arrival rate as a share of continuous capacity
    prompt_lens: tuple[int, ...]
    window_s: float  # virtual seconds of arrivals per run, in units of one full batch's time
    validate_cells: int  # map cells rerun in real time
    validate_s: float  # their seconds of arrivals


GRIDS = {
    ("tiny", False): Grid((0.1, 0.3, 0.6, 0.9, 1.2), (16, 256), 400.0, 2, 10.0),
    ("tiny", True): Grid((0.1, 0.6, 1.2), (16, 256), 120.0, 1, 4.0),
    ("smollm2", False): Grid((0.1, 0.5, 0.9, 1.2), (16, 128), 100.0, 0, 0.0),
    ("smollm2", True): Grid((0.1, 0.9), (16,), 60.0, 0, 0.0),
}


def calibrate(source: str, prompt_lens: tuple[int, ...]) -> StepCost:
    longest = max(prompt_lens) * 3 // 2
    rectangles = ((1, 16), (CONFIG.max_batch_size, 16), (4, longest // 2), (8, longest))
    return StepCost.measure(source, (1, 2, 4, 8, 16), rectangles, MEAN_OUTPUT + 32)


def capacity_rps(cost: StepCost, prompt_len: int) -> float:
    """Requests/s continuous batching serves at max_batch_size: a full batch's steps."""
    batch = CONFIG.max_batch_size
    per_request = cost.decode(batch) * MEAN_OUTPUT / batch + cost.prefill(prompt_len)
    return 1.0 / per_request


def kv_blocks_for(prompt_len: int) -> int:
    """Room for a full batch of the longest requests a trace draws, twice over."""
    return 2 * CONFIG.max_batch_size * -(-(prompt_len * 3 // 2 + 8 * MEAN_OUTPUT) // BLOCK)


def run_map(cost: StepCost, grid: Grid) -> list[dict[str, Any]]:
    cells = []
    full_batch_s = cost.decode(CONFIG.max_batch_size) * MEAN_OUTPUT
    slo = SLO_STEPS_PER_TOKEN * cost.decode(CONFIG.max_batch_size)
    for prompt_len in grid.prompt_lens:
        capacity = capacity_rps(cost, prompt_len)
        for spread in SPREADS:
            for load in grid.loads:
                rate = load * capacity
                window = grid.window_s * full_batch_s
                figures = {
                    p.name: Figures.of(
                        simulate(
                            p,
                            arrivals(rate, spread, prompt_len, seed=7),
                            window,
                            CONFIG,
                            cost,
                            kv_blocks_for(prompt_len),
                        )
                    )
                    for p in POLICIES
                }
                winner, reason = pick_winner(figures, slo)
                cells.append(
                    {
                        "prompt_len": prompt_len,
                        "spread": spread,
                        "load": load,
                        "rate_rps": rate,
                        "winner": winner,
                        "reason": reason,
                        "figures": {name: asdict(f) for name, f in figures.items()},
                    }
                )
                print(
                    f"  prompt {prompt_len:>3} {spread:>7} load {load:.1f}: {winner}",
                    file=sys.stderr,
                )
    return cells


def pick_winner(figures: dict[str, Figures], slo_s_per_token: float) -> tuple[str, str]:
    """Among the policies whose p99 latency per output token meets the SLO, the one of
    the highest throughput; within 2% of it, the one of the lowest p99 latency."""
    meeting = {n: f for n, f in figures.items() if f.per_token_p99_s <= slo_s_per_token}
    if not meeting:
        best = min(figures, key=lambda n: figures[n].per_token_p99_s)
        return best, "none meets the SLO; lowest p99"
    top = max(f.tokens_per_s for f in meeting.values())
    close = {n: f for n, f in meeting.items() if f.tokens_per_s >= 0.98 * top}
    best = min(close, key=lambda n: close[n].p99_s)
    return best, "lowest p99" if len(close) > 1 else "highest throughput"


# --- validation: the same traces through the real engine in real time ------------------


async def real_run(
    source: str, policy: Policy, rate: float, spread: str, prompt_len: int, window_s: float
) -> dict[str, float]:
    """The trace in real time against an in-process engine; figures of the requests
    arriving within `window_s` (later arrivals keep a static batch filling)."""
    from batchpilot_server.engine.core import Engine
    from batchpilot_server.engine_api import EngineOptions, SamplingParams

    engine = Engine(
        EngineOptions(
            mode=policy.mode,
            config=CONFIG,
            model=source,
            device="cpu",
            threads=1,
            kv_cache_mb=128,
            dynamic_execution="padded" if policy.padded else "ragged",
        )
    )
    await engine.start()
    vocab = engine.tokenizer.vocab_size
    latencies: list[tuple[float, int]] = []
    measured_done = asyncio.Event()
    expected = 0
    start = time.perf_counter()

    async def one(prompt: list[int], tokens: int, measured: bool) -> None:
        submitted = time.perf_counter()
        stream = engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True))
        count = sum([1 async for _ in stream])
        if measured:
            latencies.append((time.perf_counter() - submitted, count))
            if len(latencies) == expected:
                measured_done.set()

    tasks = []
    rng = np.random.default_rng(3)
    for arrival in arrivals(rate, spread, prompt_len, seed=7):
        if arrival.at_s >= window_s and measured_done.is_set():
            break
        await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
        measured = arrival.at_s < window_s
        expected += measured
        prompt = rng.integers(1, min(vocab, 250), arrival.prompt_len).tolist()
        tasks.append(asyncio.create_task(one(prompt, arrival.output_len, measured)))
    elapsed = time.perf_counter() - start
    engine.abort("benchmark over")
    await asyncio.gather(*tasks, return_exceptions=True)
    await engine.shutdown()
    latency = np.array([t for t, _ in latencies])
    return {
        "tokens_per_s": sum(n for _, n in latencies) / elapsed,
        "p50_s": float(np.percentile(latency, 50)),
        "p99_s": float(np.percentile(latency, 99)),
    }


async def validate(source: str, cost: StepCost, grid: Grid) -> list[dict[str, Any]]:
    """Real-clock runs of cells at moderate load (a short window of an overloaded cell
    measures its queue's growth, not the policy) against the simulation."""
    prompt_len = min(grid.prompt_lens)
    capacity = capacity_rps(cost, prompt_len)
    chosen = [("uniform", 0.6), ("heavy", 0.3)][: grid.validate_cells]
    rows = []
    for spread, load in chosen:
        rate = load * capacity
        for policy in POLICIES:
            real = await real_run(source, policy, rate, spread, prompt_len, grid.validate_s)
            sim = Figures.of(
                simulate(
                    policy,
                    arrivals(rate, spread, prompt_len, seed=7),
                    grid.validate_s,
                    CONFIG,
                    cost,
                    kv_blocks_for(prompt_len),
                )
            )
            rows.append(
                {
                    "spread": spread,
                    "load": load,
                    "policy": policy.name,
                    "real": real,
                    "simulated": {k: getattr(sim, k) for k in real},
                }
            )
            print(f"  validate {spread} {load}: {policy.name} real {real}", file=sys.stderr)
    return rows


# --- the README example over HTTP -------------------------------------------------------


@dataclass(frozen=True)
class Served:
    name: str
    flags: tuple[str, ...]


EXAMPLE_SERVERS = (
    Served("static", ("--mode", "static", "--max-wait-ms", f"{EXAMPLE_STATIC_WAIT_MS:g}")),
    Served("dynamic", ("--mode", "dynamic")),
    Served("dynamic-padded", ("--mode", "dynamic", "--dynamic-execution", "padded")),
    Served("continuous", ("--mode", "continuous")),
)


def scrape(url: str) -> dict[str, float]:
    """The slot-step counters and the step-duration sum of a server's /metrics."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(BATCH_SLOT_STEPS_TOTAL):
            state = line.split('state="')[1].split('"')[0]
            values[state] = float(line.split()[-1])
        elif line.startswith(f"{STEP_DURATION}_sum"):
            values["busy_s"] = float(line.split()[-1])
    return values


async def stream_times(
    session: aiohttp.ClientSession, url: str, tokens: int, t0: float, at_s: float
) -> list[float]:
    """Seconds from t0 at which each token event of one streamed request arrived; the
    first entry is when it was sent."""
    await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
    sent = time.monotonic() - t0
    body = {
        "prompt": f"request of {tokens}",
        "max_tokens": tokens,
        "ignore_eos": True,
        "stream": True,
    }
    times = [sent]
    async with session.post(f"{url}/v1/completions", json=body) as response:
        async for raw in response.content:
            line = raw.strip()
            if line.startswith(b"data:") and line != b"data: [DONE]" and b'"text"' in line:
                times.append(time.monotonic() - t0)
    if len(times) - 1 != tokens:
        raise RuntimeError(f"asked for {tokens} tokens, got {len(times) - 1} events")
    return times


async def example_run(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session:
        warm = time.monotonic()
        await asyncio.gather(*(stream_times(session, url, 2, warm, 0.0) for _ in range(8)))
        before = scrape(url)
        t0 = time.monotonic()
        requests = zip(hostage.LENGTHS, hostage.OFFSETS_S, strict=True)
        events = await asyncio.gather(
            *(stream_times(session, url, n, t0, at) for n, at in requests)
        )
        after = scrape(url)
    span = max(times[-1] for times in events)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    slots = {k: delta.get(k, 0.0) for k in ("active", "finished", "padding")}
    rows = []
    for times in events:
        gaps = np.diff(times[1:-1]) if len(times) > 3 else np.array([0.0])
        # the final token was computed one step after the one before it; a held final
        # event arrives later than that
        generated = times[-2] + float(np.median(gaps)) if len(times) > 2 else times[-1]
        rows.append(
            {
                "sent_s": times[0],
                "first_token_s": times[1],
                "generated_s": min(generated, times[-1]),
                "completed_s": times[-1],
            }
        )
    return {
        "requests": rows,
        "span_s": span,
        "busy_s": delta.get("busy_s", 0.0),
        "idle_s": max(0.0, span - delta.get("busy_s", 0.0)),
        "slot_steps": slots,
        "slot_waste": (slots["finished"] + slots["padding"]) / (sum(slots.values()) or 1),
    }


async def example(source: str) -> dict[str, Any]:
    results = {}
    for served in EXAMPLE_SERVERS:
        port = free_port()
        cmd = [
            sys.executable,
            "-m",
            "batchpilot_server.cli",
            "serve",
            "--model",
            source,
            *served.flags,
            "--max-batch-size",
            str(hostage.MAX_BATCH),
            "--batch-timeout-ms",
            str(hostage.TIMEOUT_MS),
            "--port",
            str(port),
            "--device",
            "cpu",
            "--threads",
            "1",
            "--attention",
            "auto",
        ]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        url = f"http://127.0.0.1:{port}"
        try:
            await asyncio.to_thread(_wait_ready, url, proc)
            results[served.name] = await example_run(url)
        finally:
            stop_process(proc)
        print(f"  example {served.name}: done", file=sys.stderr)
    return results


# --- plots and docs ----------------------------------------------------------------------

COLORS = {
    "static": "#9e9e9e",
    "dynamic": "#1f77b4",
    "dynamic-padded": "#aec7e8",
    "continuous": "#2ca02c",
}


def plot_map(cells: list[dict[str, Any]], grid: Grid, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, axes = plt.subplots(
        1, len(grid.prompt_lens), figsize=(5.2 * len(grid.prompt_lens), 3.6), squeeze=False
    )
    for ax, prompt_len in zip(axes[0], grid.prompt_lens, strict=True):
        for cell in (c for c in cells if c["prompt_len"] == prompt_len):
            x, y = grid.loads.index(cell["load"]), SPREADS.index(cell["spread"])
            missed = cell["reason"].startswith("none")
            ax.add_patch(
                plt.Rectangle(
                    (x - 0.5, y - 0.5),
                    1,
                    1,
                    color=COLORS[cell["winner"]],
                    alpha=0.35 if missed else 1.0,
                )
            )
            p99 = cell["figures"][cell["winner"]]["p99_s"]
            label = f"{cell['winner']}\np99 {p99:.2f}s" + ("\n(SLO missed)" if missed else "")
            ax.text(x, y, label, ha="center", va="center", fontsize=7)
        ax.set_xlim(-0.5, len(grid.loads) - 0.5)
        ax.set_ylim(-0.5, len(SPREADS) - 0.5)
        ax.set_xticks(range(len(grid.loads)), [f"{load:.0%}" for load in grid.loads])
        ax.set_yticks(range(len(SPREADS)), SPREADS)
        ax.set_xlabel("arrival rate (share of continuous capacity)")
        ax.set_ylabel("output-length spread")
        ax.set_title(f"prompts ~{prompt_len} tokens")
    fig.legend(
        handles=[Patch(color=c, label=n) for n, c in COLORS.items()],
        loc="lower center",
        ncol=4,
        fontsize=8,
    )
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.32 * 5 * len(runs) + 1))
    labels, y = [], 0
    for name, run in runs.items():
        for length, r in zip(hostage.LENGTHS, run["requests"], strict=True):
            spans = (
                (r["sent_s"], r["first_token_s"], "#dddddd", "waiting"),
                (r["first_token_s"], r["generated_s"], COLORS[name], "generating"),
                (r["generated_s"], r["completed_s"], "#d62728", "held"),
            )
            for start, end, color, _ in spans:
                ax.barh(y, max(end - start, 0.0), left=start, color=color, height=0.7)
            labels.append(f"{name}: {length} tok")
            y += 1
        y += 0.6
    ticks = [i + 0.6 * (i // 4) for i in range(len(labels))]
    ax.set_yticks(ticks, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the first request")
    ax.set_title(
        "README example over HTTP: grey waiting, colour generating, red held "
        "(finished, waiting for its batch)",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_map(
    ref: model_refs.ModelRef, cost: StepCost, grid: Grid, cells: list[dict[str, Any]], image: str
) -> str:
    slo_ms = SLO_STEPS_PER_TOKEN * cost.decode(CONFIG.max_batch_size) * 1e3
    lines = [
        f"### Map: {ref.title}",
        "",
        "Step times measured here (1 torch thread, CPU): decode "
        + ", ".join(
            f"{r} rows {s * 1e3:.1f} ms"
            for r, s in zip(cost.decode_rows, cost.decode_s, strict=True)
        )
        + f"; prefill {cost.prefill_base_s * 1e3:.1f} ms + {cost.prefill_per_token_s * 1e6:.0f} µs "
        "per position of its rectangle. max_batch_size 8, batch_timeout_ms 10 (static: no "
        f"timeout). SLO: p99 latency per output token within {slo_ms:.1f} ms "
        f"({SLO_STEPS_PER_TOKEN:g} full-batch decode steps). Outputs of mean {MEAN_OUTPUT} "
        "tokens: equal (all 64), uniform (16..112), heavy (log-normal, sigma 1, 2..512); "
        "prompts uniform in [L/2, 3L/2].",
        "",
        f"![which policy wins where]({image})",
        "",
        "| prompt | spread | load | winner | "
        + " | ".join(
            f"{p.name} tok/s, p50/p99 s, TTFT p50 s, hostage p99 s, waste" for p in POLICIES
        )
        + " |",
        "|---|---|---|---|" + "---|" * len(POLICIES),
    ]
    for cell in cells:
        figs = cell["figures"]
        parts = [
            f"{f['tokens_per_s']:.0f}, {f['p50_s']:.2f}/{f['p99_s']:.2f}, {f['ttft_p50_s']:.3f}, "
            f"{f['hostage_p99_s']:.2f}, {f['slot_waste']:.0%}"
            for f in (figs[p.name] for p in POLICIES)
        ]
        lines.append(
            f"| {cell['prompt_len']} | {cell['spread']} | {cell['load']:.0%} | "
            f"**{cell['winner']}** ({cell['reason']}) | " + " | ".join(parts) + " |"
        )
    return "\n".join(lines)


def render_kv(cost: StepCost, grid: Grid, cells: list[dict[str, Any]]) -> str:
    """Peak KV cache in use per policy, from the pool's blocks in the simulated runs."""
    mib = BLOCK * cost.kv_bytes_per_token / 2**20
    lines = [
        "### KV cache in use",
        "",
        f"One token's K and V take {cost.kv_bytes_per_token / 1024:.1f} KiB "
        f"(a {BLOCK}-token block {mib * 1024:.0f} KiB). Peak MiB of the KV pool in use during "
        "each run, uniform output spread (static and dynamic reserve prompt + max_tokens for "
        "every member when a batch fires; continuous holds the prompt and grows a block at a "
        "time):",
        "",
        "| prompt | load | " + " | ".join(p.name for p in POLICIES) + " |",
        "|---|---|" + "---|" * len(POLICIES),
    ]
    for cell in (c for c in cells if c["spread"] == "uniform"):
        peaks = [cell["figures"][p.name]["peak_kv_blocks"] * mib for p in POLICIES]
        lines.append(
            f"| {cell['prompt_len']} | {cell['load']:.0%} | "
            + " | ".join(f"{v:.1f}" for v in peaks)
            + " |"
        )
    return "\n".join(lines)


def render_validation(rows: list[dict[str, Any]]) -> str:
    lines = [
        "### Simulation against the real engine",
        "",
        "The same traces in real time through the engine in this process (prompts ~16 tokens), "
        "against the virtual-clock run of the same schedulers.",
        "",
        "| cell | policy | real tok/s | simulated tok/s | real p50 / p99 s "
        "| simulated p50 / p99 s |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        real, sim = row["real"], row["simulated"]
        lines.append(
            f"| {row['spread']}, load {row['load']:.0%} | {row['policy']} | "
            f"{real['tokens_per_s']:.0f} | {sim['tokens_per_s']:.0f} | "
            f"{real['p50_s']:.2f} / {real['p99_s']:.2f} | {sim['p50_s']:.2f} / {sim['p99_s']:.2f} |"
        )
    return "\n".join(lines)


def render_example(ref: model_refs.ModelRef, runs: dict[str, Any], image: str) -> str:
    lines = [
        f"### README example over HTTP: {ref.title}",
        "",
        f"{hostage.describe()}; one `batchpilot serve` per row, streamed requests. Static "
        f"runs with `--max-wait-ms {EXAMPLE_STATIC_WAIT_MS:g}`: without the valve four requests "
        "never fill a batch of 8 and never complete. Seconds from the first request to each "
        "completion; slot steps and busy time are the deltas of the server's "
        "`batchpilot_batch_slot_steps_total` and `batchpilot_step_duration_seconds_sum`; idle = "
        "span - busy.",
        "",
        "| server | "
        + " | ".join(f"{n} tok done s" for n in hostage.LENGTHS)
        + " | active | finished | padding | waste | busy s | idle s |",
        "|---|" + "---|" * (len(hostage.LENGTHS) + 6),
    ]
    for name, run in runs.items():
        slots = run["slot_steps"]
        lines.append(
            f"| {name} | "
            + " | ".join(f"{r['completed_s']:.3f}" for r in run["requests"])
            + f" | {slots['active']:.0f} | {slots['finished']:.0f} | {slots['padding']:.0f} | "
            f"{run['slot_waste']:.0%} | {run['busy_s']:.3f} | {run['idle_s']:.3f} |"
        )
    lines += ["", f"![timeline of the example]({image})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=("tiny", model_refs.SMOLLM2))
    parser.add_argument("--quick", action="store_true", help="a smaller grid (about 2 minutes)")
    parser.add_argument("--no-example", action="store_true", help="skip the HTTP example")
    parser.add_argument("--docs", type=Path, default=DOCS)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    ref = model_refs.resolve(args.model)
    grid = GRIDS[(args.model, args.quick)]
    suffix = "" if args.model == "tiny" else f"-{ref.key}"
    began = time.perf_counter()
    print("measuring step times", file=sys.stderr)
    cost = calibrate(ref.source, grid.prompt_lens)
    print("the map", file=sys.stderr)
    cells = run_map(cost, grid)
    validation = asyncio.run(validate(ref.source, cost, grid)) if grid.validate_cells else []
    runs = {} if args.no_example else asyncio.run(example(ref.source))
    map_image, timeline_image = f"batching_map{suffix}.png", f"batching_example{suffix}.png"
    text_map = render_map(ref, cost, grid, cells, map_image)
    print(text_map)
    doc = args.docs / "batching.md"
    if not args.no_write:
        plot_map(cells, grid, f"{ref.title}: the winner at the SLO", args.docs / map_image)
        replace_section(doc, f"tradeoff-map{suffix}", text_map)
        replace_section(doc, f"tradeoff-kv{suffix}", render_kv(cost, grid, cells))
        if validation:
            replace_section(doc, f"tradeoff-validation{suffix}", render_validation(validation))
        if runs:
            plot_timeline(runs, args.docs / timeline_image)
            replace_section(
                doc, f"tradeoff-example{suffix}", render_example(ref, runs, timeline_image)
            )
    summary = {
        "benchmark": "tradeoff",
        "model": ref.key,
        "quick": args.quick,
        "seconds": round(time.perf_counter() - began, 1),
        "step_cost": asdict(cost),
        "slo_s_per_token": SLO_STEPS_PER_TOKEN * cost.decode(CONFIG.max_batch_size),
        "winners": {f"{c['prompt_len']}/{c['spread']}/{c['load']}": c["winner"] for c in cells},
        "cells": cells,
        "validation": validation,
        "example": runs,
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
