"""Sampler benchmark: what the sampling processors add to a decode step at batch 32.

One decode step as the engine runs it (the paged forward, then the sampler over its
32 rows), for two sets of 32 sequences with the same prompts: every row greedy
(the argmax fast path), and every row with the processors on: temperature, top_k,
top_p, min_p, repetition, frequency and presence penalties, three logit_bias
entries and min_tokens still holding EOS back. A third set adds the 5 top
log-probabilities per token. The sets' steps alternate, so load on the shared
machine falls on each alike; the median step of each is kept. The sampler's own
time per step is measured apart as well.

Prints a table, writes the "sampler" section of docs/benchmarks.md and prints one
JSON line last. Target: a processed step within 10% of a greedy one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import model_refs
import torch
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.sampling import Sampler, make_generator
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine.weights import LoadedModel, load_model
from batchpilot_server.engine_api import SamplingParams
from measure import Prompts
from sections import replace_section

DOCS = Path(__file__).resolve().parent.parent / "docs"
BATCH, PROMPT, BLOCK = 32, 64, 16
TARGET = 0.10  # a processed step at most 10% over a greedy one


def processed(vocab: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=1024,
        temperature=0.8,
        top_p=0.95,
        top_k=50,
        min_p=0.05,
        seed=1,
        repetition_penalty=1.1,
        frequency_penalty=0.3,
        presence_penalty=0.3,
        logit_bias=((vocab // 3, 2.0), (vocab // 2, -2.0), (vocab - 2, -100.0)),
        min_tokens=1024,
    )


@dataclass(frozen=True)
class Plan:
    steps: int  # decode steps per set


FULL, QUICK = Plan(steps=48), Plan(steps=12)


class Decoding:
    """A set of sequences decoding one step at a time, as the engine steps them."""

    def __init__(self, loaded: LoadedModel, params: SamplingParams, prompts: list[list[int]]):
        spec = loaded.spec
        blocks = len(prompts) * -(-(PROMPT + FULL.steps + 1) // BLOCK)
        self.cache = KVCache(spec, blocks, BLOCK, "cpu")
        self.runner = ModelRunner(loaded.model, self.cache, "auto", torch.get_num_threads())
        self.sampler = Sampler(spec.vocab_size, loaded.tokenizer.eos_ids, "cpu")
        self.seqs = [
            Sequence(str(n), p, params, 0.0, None, make_generator(params, "cpu"))
            for n, p in enumerate(prompts)
        ]
        for seq in self.seqs:
            assert self.cache.pool.grow(seq.block_table, PROMPT + FULL.steps + 1)
        prefill = StepPlan(prefill=self.seqs)
        prefill.advance(self.sampler.sample(self.runner.step(prefill), self.seqs).tokens)
        self.step_s: list[float] = []
        self.sample_s: list[float] = []

    def step(self) -> None:
        began = time.thread_time()
        plan = StepPlan(decode=self.seqs)
        logits = self.runner.step(plan)
        sampling = time.thread_time()
        tokens = self.sampler.sample(logits, self.seqs).tokens
        done = time.thread_time()
        plan.advance(tokens)
        self.step_s.append(done - began)
        self.sample_s.append(done - sampling)


def measure(ref: model_refs.ModelRef, plan: Plan) -> dict[str, Any]:
    loaded = load_model(ref.source, device="cpu", dtype="float32")
    vocab = loaded.spec.vocab_size
    prompts = Prompts(length=PROMPT, vocab=min(vocab, 256), first=None).draw(BATCH, seed=1)
    sets = {
        "greedy": SamplingParams(max_tokens=1024, ignore_eos=True),
        "processed": processed(vocab),
        "processed + top-5 logprobs": SamplingParams(
            **{**processed(vocab).__dict__, "logprobs": 5}
        ),
    }
    runs = {name: Decoding(loaded, params, prompts) for name, params in sets.items()}
    with torch.inference_mode():
        for _ in range(plan.steps):
            for run in runs.values():
                run.step()
    greedy = statistics.median(runs["greedy"].step_s)
    rows = {
        name: {
            "step_ms": round(statistics.median(run.step_s) * 1e3, 3),
            "sampler_ms": round(statistics.median(run.sample_s) * 1e3, 3),
            "vs_greedy": round(statistics.median(run.step_s) / greedy - 1, 4),
        }
        for name, run in runs.items()
    }
    return {"title": ref.title, "vocab": vocab, "rows": rows}


def render(results: dict[str, dict[str, Any]], plan: Plan, threads: int) -> str:
    lines = [
        "## Sampler cost (bench/sampler.py)",
        "",
        f"One decode step at batch {BATCH} (prompts of {PROMPT} tokens, the paged forward "
        f"and the sampler), CPU, {threads} torch thread(s), in this thread's CPU time (the "
        "shared machine's load moves it less than wall time); median of "
        f"{plan.steps} steps per set, the sets' steps alternating. `processed`: every row "
        "with temperature 0.8, top_k 50, top_p 0.95, min_p 0.05, repetition 1.1, "
        "frequency and presence 0.3, three logit_bias entries and min_tokens holding EOS "
        "back. Target: within "
        f"{TARGET:.0%} of the greedy step.",
        "",
        "| model | rows | step ms | sampler ms | vs greedy step |",
        "|---|---|---|---|---|",
    ]
    for result in results.values():
        for name, row in result["rows"].items():
            lines.append(
                f"| {result['title']} (vocab {result['vocab']}) | {name} | {row['step_ms']:.2f} "
                f"| {row['sampler_ms']:.2f} | {row['vs_greedy']:+.1%} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        action="append",
        help="tiny, smollm2, a model directory or a .gguf file (repeatable; "
        "default: tiny and smollm2)",
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK.steps} steps per set")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where to write the results")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    plan = QUICK if args.quick else FULL
    refs = [model_refs.resolve(name) for name in args.model or ["tiny", model_refs.SMOLLM2]]
    results = {ref.key: measure(ref, plan) for ref in refs}
    text = render(results, plan, args.threads)
    print(text)
    if not args.no_write:
        replace_section(args.docs / "benchmarks.md", "sampler", text)
    overhead = {key: r["rows"]["processed"]["vs_greedy"] for key, r in results.items()}
    summary = {
        "bench": "sampler",
        "batch": BATCH,
        "steps": plan.steps,
        "results": results,
        "processed_vs_greedy": overhead,
        "target": TARGET,
        "met": all(value <= TARGET for value in overhead.values()),
    }
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
