"""Serving benchmark over HTTP: the hostage example per mode, and what HTTP costs.

1. The 10/50/100/200 example through real `batchpilot serve` processes: four
   requests forced to 10, 50, 100 and 200 tokens arrive together; the time
   each one completes, per mode.
2. Served tokens/s at batch 32 (32 concurrent clients through the load
   generator) against the engine alone at batch 32, measured in the same run
   with the same threads and lengths. Target: HTTP costs at most 20%.

Prints tables and a final JSON line; writes its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from batchpilot_operator.prometheus_local import free_port
from batchpilot_server.batching import MODES, BatchingConfig, Mode
from batchpilot_server.engine_api import EngineOptions, NullObserver, SamplingParams
from batchpilot_server.loadgen import LengthDist, LoadSpec, run_load
from sections import replace_section

if TYPE_CHECKING:
    from batchpilot_server.engine import Engine

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
HOSTAGE_LENGTHS = (10, 50, 100, 200)
BATCH = 32
TARGET_RATIO = 0.8


@contextmanager
def server(mode: Mode, args: argparse.Namespace) -> Iterator[str]:
    """A real `batchpilot serve` process; always stopped."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "batchpilot_server.cli", "serve", "--mode", mode,
        "--max-batch-size", str(BATCH), "--batch-timeout-ms", str(args.batch_timeout_ms),
        "--max-queue-size", "4096", "--port", str(port), "--device", args.device,
        "--threads", str(args.threads), "--kv-cache-mb", str(args.kv_cache_mb),
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_ready(url: str, proc: subprocess.Popen[bytes], deadline_s: float = 120) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            stderr = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"server exited with {proc.returncode}:\n{stderr[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2):
                return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(0.1)
    raise TimeoutError(f"{url} not ready after {deadline_s}s")


async def hostage_example(url: str) -> list[float]:
    """Seconds from sending to completion of each of the 10/50/100/200-token requests."""

    async def one(session: aiohttp.ClientSession, tokens: int, t0: float) -> float:
        body = {"prompt": f"request of {tokens}", "max_tokens": tokens, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            answer = await response.json()
        assert answer["usage"]["completion_tokens"] == tokens, answer
        return time.monotonic() - t0

    async with aiohttp.ClientSession() as session:
        await one(session, 4, time.monotonic())  # warm-up
        t0 = time.monotonic()
        return list(await asyncio.gather(*(one(session, n, t0) for n in HOSTAGE_LENGTHS)))


def load_spec(url: str, args: argparse.Namespace, stream: bool) -> LoadSpec:
    return LoadSpec(
        urls=[url],
        arrival="concurrency",
        concurrency=BATCH,
        num_requests=args.requests,
        prompt_len=LengthDist("fixed", args.prompt_len),
        output_len=LengthDist("fixed", args.output_len),
        stream=stream,
        seed=1,
    )


async def served_tokens_per_s(url: str, args: argparse.Namespace, stream: bool) -> float:
    """Generated tokens/s through HTTP with 32 closed-loop clients."""
    report = await run_load(load_spec(url, args, stream))
    if report.ok != report.sent:
        raise RuntimeError(f"{report.sent - report.ok} failed: {report.errors_by_status}")
    return report.tokens_per_s


@asynccontextmanager
async def engine_alone(mode: Mode, args: argparse.Namespace) -> AsyncIterator[Engine]:
    """An engine in this process, configured like the served one."""
    from batchpilot_server.engine import Engine  # torch

    options = EngineOptions(
        mode=mode,
        config=BatchingConfig(BATCH, args.batch_timeout_ms, 4096),
        device=args.device,
        kv_cache_mb=args.kv_cache_mb,
        threads=args.threads,
    )
    engine = Engine(options, NullObserver())
    await engine.start()
    try:
        yield engine
    finally:
        await engine.shutdown()


async def engine_tokens_per_s(engine: Engine, args: argparse.Namespace, requests: int) -> float:
    """The same closed loop of 32 clients straight on the engine: no HTTP, no JSON."""
    prompt = engine.tokenizer.encode("a" * args.prompt_len)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    remaining, generated = requests, 0

    async def client() -> None:
        nonlocal remaining, generated
        while remaining > 0:
            remaining -= 1
            async for _ in engine.submit(prompt, params):
                generated += 1

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(BATCH)))
    return generated / (time.monotonic() - t0)


async def measure_mode(mode: Mode, args: argparse.Namespace) -> tuple[list[float], dict[str, Any]]:
    """Rounds interleave the three throughput runs, so that load from elsewhere on the
    machine hits them alike; each figure is its best round."""
    rounds: dict[str, list[float]] = {"engine": [], "streamed": [], "not_streamed": []}
    hostage: list[list[float]] = []
    with server(mode, args) as url:
        async with engine_alone(mode, args) as engine:
            await engine_tokens_per_s(engine, args, BATCH)  # warm-up
            await served_tokens_per_s(url, args, stream=False)
            for _ in range(args.rounds):
                hostage.append(await hostage_example(url))
                rounds["engine"].append(await engine_tokens_per_s(engine, args, args.requests))
                rounds["streamed"].append(await served_tokens_per_s(url, args, stream=True))
                rounds["not_streamed"].append(await served_tokens_per_s(url, args, stream=False))
    best = {name: max(values) for name, values in rounds.items()}
    figures = {
        "engine_tokens_per_s": round(best["engine"], 1),
        "served_tokens_per_s": round(best["streamed"], 1),
        "served_not_streamed_tokens_per_s": round(best["not_streamed"], 1),
        "served_over_engine": round(best["streamed"] / best["engine"], 3),
        "not_streamed_over_engine": round(best["not_streamed"] / best["engine"], 3),
        "rounds": {name: [round(v) for v in values] for name, values in rounds.items()},
    }
    return [statistics.median(times) for times in zip(*hostage, strict=True)], figures


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"hostage_example_s": {}, "batch_32": {}}
    for mode in MODES:
        times, figures = await measure_mode(mode, args)
        results["hostage_example_s"][mode] = {
            str(n): round(t, 3) for n, t in zip(HOSTAGE_LENGTHS, times, strict=True)
        }
        results["batch_32"][mode] = figures
    return results


def tables(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        "Hostage example over HTTP: seconds from sending to completion of each request",
        f"(four requests of 10, 50, 100 and 200 tokens sent together; median of {args.rounds}).",
        "",
        "| mode | " + " | ".join(f"{n} tokens" for n in HOSTAGE_LENGTHS) + " |",
        "|---|" + "---:|" * len(HOSTAGE_LENGTHS),
    ]
    for mode, times in results["hostage_example_s"].items():
        lines.append(f"| {mode} | " + " | ".join(f"{t:.3f}" for t in times.values()) + " |")
    lines += [
        "",
        f"Generated tokens/s at batch {BATCH}: {BATCH} closed-loop clients, {args.requests} "
        f"requests of {args.prompt_len} prompt and {args.output_len} output tokens, "
        f"torch threads {args.threads}, best of {args.rounds} interleaved rounds. The engine "
        "alone runs in the benchmark process; served figures go through a `batchpilot serve` "
        "process and the load generator (another process's worth of CPU on the same cores).",
        "",
        "| mode | engine alone | HTTP streamed (SSE) | HTTP not streamed | streamed / engine "
        "| not streamed / engine |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for mode, row in results["batch_32"].items():
        lines.append(
            f"| {mode} | {row['engine_tokens_per_s']:.0f} | {row['served_tokens_per_s']:.0f} "
            f"| {row['served_not_streamed_tokens_per_s']:.0f} | {row['served_over_engine']:.2f} "
            f"| {row['not_streamed_over_engine']:.2f} |"
        )
    lines += ["", "Every round, tokens/s (the spread is other work on the same two cores):", ""]
    for mode, row in results["batch_32"].items():
        rounds = "; ".join(f"{name} {values}" for name, values in row["rounds"].items())
        lines.append(f"- {mode}: {rounds}")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=128, help="requests per throughput run")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best one counts")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch threads, server and engine")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--kv-cache-mb", type=float, default=64.0)
    p.add_argument("--batch-timeout-ms", type=float, default=50.0)
    p.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = asyncio.run(measure(args))
    text = tables(results, args)
    print(text)
    if not args.no_doc:
        replace_section(DOC, "serve", f"## Serving (bench/serve.py)\n\n{text}")
    ratio = results["batch_32"]["continuous"]["served_over_engine"]
    summary = {
        "benchmark": "serve",
        **results,
        "http_cost_continuous": round(1 - ratio, 3),
        "target_met": ratio >= TARGET_RATIO,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
