"""Prefix caching: time to first token of a chat workload whose requests share a
500-token system prompt, against a real server with the cache and without it.

Each request is a streamed chat completion: the shared system prompt and a question
of its own (about 20 tokens), 16 output tokens. `--concurrency` chat users (2) each
send their next request when their last one is answered: a closed loop, so that the
server without the cache, whose every prefill is the whole prompt, is measured at
the same offered work instead of falling ever further behind an open-loop rate it
cannot carry on a busy machine. The first request finds the cache cold (the warm-up
asks something else), so the p99 holds a miss. TTFT is the time to the first chunk
that carries text.

By default the benchmark starts `batchpilot serve` twice (continuous mode), with and
without `--no-prefix-caching`, one after the other in the same run, and reports the
ratio of the TTFT p50s (target: >= 3x lower with the cache) and the hit rate from
the server's own counters. `--base-url` points the same workload at any
OpenAI-compatible server instead (vLLM with and without `--enable-prefix-caching`,
say): one run, reported as is. The system prompt is sized with the model's own
tokenizer (SmolLM2's by default); each run reports the prompt tokens the server
counted. Prints a table, a final one-line JSON, and writes the "Prefix caching"
section of docs/benchmarks.md (not with --base-url).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import model_refs
import numpy as np
from batchpilot_server import metric_names as names
from prometheus_client.parser import text_string_to_metric_families
from sections import replace_section
from serve import serve_process
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "prefix-cache"
TARGET_RATIO = 3.0
RULES = (  # the system prompt's words, shuffled
    "the shop repairs bicycles brakes gears wheels chains and frames every customer "
    "gets a short clear answer with the tool needed and the time it takes prices are "
    "never invented opening hours are nine to six from monday to saturday a mechanic "
    "checks tyre pressure spokes bearings cables and pads before each ride"
)
TOPICS = ("flat tyre", "slipping chain", "squealing brakes", "loose headset", "bent rim")


def system_prompt(tokenizer: Tokenizer, tokens: int) -> str:
    """Seeded shop rules, cut to `tokens` tokens of `tokenizer`."""
    rng, words = random.Random(0), RULES.split()
    text = ""
    while len(tokenizer.encode(text).ids) < tokens:
        text += " ".join(rng.choices(words, k=12)) + ". "
    ids = tokenizer.encode(text).ids[:tokens]
    return tokenizer.decode(ids)


def question(n: int) -> str:
    return f"Customer {n} asks: my bike has a {TOPICS[n % len(TOPICS)]}, what should I do first?"


@dataclass(frozen=True)
class Chat:
    ttft_s: float
    prompt_tokens: int


async def chat(
    session: aiohttp.ClientSession, url: str, model: str, system: str, text: str, tokens: int
) -> Chat:
    """One streamed chat completion: its TTFT and the prompt tokens the server counted."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": text}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    began = time.perf_counter()
    ttft, prompt_tokens = None, 0
    async with session.post(f"{url}/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if ttft is None and any(c["delta"].get("content") for c in chunk["choices"]):
                ttft = time.perf_counter() - began
            if chunk.get("usage"):
                prompt_tokens = chunk["usage"]["prompt_tokens"]
    if ttft is None:
        raise RuntimeError(f"{url}: a completion without text")
    return Chat(ttft, prompt_tokens)


async def served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as response:
        return str((await response.json())["data"][0]["id"])


async def workload(url: str, system: str, args: argparse.Namespace) -> list[Chat]:
    """A warm-up on another prompt, then `args.requests` chats from `args.concurrency`
    users, each asking again once answered."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        model = await served_model(session, url)
        await chat(session, url, model, "Be brief.", "Hello!", args.max_tokens)
        numbers = iter(range(args.requests))
        chats: list[Chat] = []

        async def user() -> None:
            for n in numbers:
                chats.append(await chat(session, url, model, system, question(n), args.max_tokens))

        await asyncio.gather(*(user() for _ in range(args.concurrency)))
        return chats


async def hit_rate(url: str) -> float | None:
    """hits / queries from the server's counters (None: not a batchpilot server)."""
    async with aiohttp.ClientSession() as session, session.get(f"{url}/metrics") as response:
        text = await response.text()
    values = {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    queries = values.get(names.PREFIX_CACHE_QUERIES_TOTAL)
    if not queries:
        return None
    return values.get(names.PREFIX_CACHE_HITS_TOTAL, 0.0) / queries


def summary(chats: list[Chat], rate: float | None) -> dict[str, Any]:
    ttfts = [c.ttft_s for c in chats]
    return {
        "ttft_p50_s": round(float(np.percentile(ttfts, 50)), 4),
        "ttft_p99_s": round(float(np.percentile(ttfts, 99)), 4),
        "prompt_tokens": int(np.median([c.prompt_tokens for c in chats])),
        "hit_rate": None if rate is None else round(rate, 3),
    }


async def measure(url: str, system: str, args: argparse.Namespace) -> dict[str, Any]:
    chats = await workload(url, system, args)
    return summary(chats, await hit_rate(url))


@contextmanager
def batchpilot(args: argparse.Namespace, caching: bool) -> Iterator[str]:
    """A real `batchpilot serve` process, with the prefix cache or without; always stopped."""
    flags = [
        "--model", args.ref.source, "--mode", "continuous", "--device", "cpu",
        "--kv-cache-mb", str(args.kv_cache_mb), "--max-model-len", "2048",
        "--queue-timeout-s", "1800",
    ]  # fmt: skip
    if args.threads:
        flags += ["--threads", str(args.threads)]
    if not caching:
        flags.append("--no-prefix-caching")
    with serve_process(flags) as url:
        yield url


def render(results: dict[str, Any], args: argparse.Namespace) -> str:
    def row(side: str, r: dict[str, Any]) -> str:
        rate = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        return (
            f"| {side} | {r['ttft_p50_s'] * 1000:.0f} | {r['ttft_p99_s'] * 1000:.0f} | "
            f"{r['prompt_tokens']} | {rate} |"
        )

    rows = [row("with the cache", results["with"]), row("without", results["without"])]
    return "\n".join(
        [
            "## Prefix caching",
            "",
            f"`python bench/prefix_cache.py --model {args.model}`: {args.ref.title}, continuous "
            f"mode, {args.requests} streamed chats from {args.concurrency} users (closed "
            f"loop), each a {args.system_tokens}-token system prompt shared by all, a question "
            f"of its own and {args.max_tokens} output tokens; the first finds the cache cold. "
            "Both servers in one run, one after the other.",
            "",
            "| server | TTFT p50 (ms) | TTFT p99 (ms) | prompt tokens | hit rate |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"TTFT p50 {results['p50_ratio']:.1f}x lower with the cache (target >= "
            f"{TARGET_RATIO:g}x), p99 {results['p99_ratio']:.1f}x (with the cache the p99 is "
            "the cold first request's). A hit computes only the "
            "question and the last block of the system prompt: the last prompt token is "
            "always computed, for the logits the first token is sampled from. Load average "
            f"over the run's last 5 minutes: {results['load_average']:g} on "
            f"{os.cpu_count()} CPUs (absolute times scale with it).",
        ]
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=model_refs.SMOLLM2, help="smollm2 (default), a preset, ...")
    p.add_argument("--base-url", help="measure this OpenAI-compatible server only")
    p.add_argument("--requests", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=2, help="chat users (default 2)")
    p.add_argument("--system-tokens", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-mb", type=float, default=256)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--no-docs", action="store_true", help="do not write docs/benchmarks.md")
    return p


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    args.ref = model_refs.resolve(args.model)
    directory = args.ref.reference
    if directory is None:
        raise SystemExit(f"{args.model}: no tokenizer.json to size the system prompt with")
    system = system_prompt(
        Tokenizer.from_file(str(directory / "tokenizer.json")), args.system_tokens
    )
    if args.base_url:
        result = asyncio.run(measure(args.base_url.rstrip("/"), system, args))
        print(json.dumps({"bench": "prefix_cache", "base_url": args.base_url, **result}))
        return 0
    results: dict[str, Any] = {}
    for side, caching in (("with", True), ("without", False)):
        with batchpilot(args, caching) as url:
            results[side] = asyncio.run(measure(url, system, args))
        print(side, results[side], file=sys.stderr)
    with_, without = results["with"], results["without"]
    results["p50_ratio"] = round(without["ttft_p50_s"] / with_["ttft_p50_s"], 2)
    results["p99_ratio"] = round(without["ttft_p99_s"] / with_["ttft_p99_s"], 2)
    # the machine's other work moves absolute times (not the ratio much): say how busy
    results["load_average"] = round(os.getloadavg()[1], 1)
    text = render(results, args)
    print(text)
    if not args.no_docs:
        replace_section(DOC, SECTION, text)
    verdict = {"p50_ratio_ok": results["p50_ratio"] >= TARGET_RATIO}
    print(json.dumps({"bench": "prefix_cache", "model": args.ref.key, **results, **verdict}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
