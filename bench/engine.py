"""Engine benchmark, no HTTP: what batching costs and buys on this machine.

- raw: the bare model generate loop (one batched prefill, then greedy decode
  steps over contiguous K/V tensors, no scheduler, no streams) per batch size:
  the ceiling. Its seconds per decode step go to docs/step_times.json (the
  tuner's simulator reads them).
- continuous: the engine at saturation doing the same work (two waves of
  `batch` requests through `max_batch_size = batch`), every token streamed;
  at batch 32 also with the torch decode attention instead of the C kernel.
- hostage_example: DESIGN's 4 requests of 10/50/100/200 tokens, per mode.
- mixed: Poisson arrivals at about 70% of the continuous capacity, log-normal
  output lengths, the same trace through each mode.
- gather_512: one decode step at context 512 (batch 32) over contiguous K/V,
  over the paged pool as the engine reads it (in place: the C kernel, and the
  torch fallback), and over the pool gathered into contiguous tensors with
  index_select (the naive way).

Both sides of every ratio run in this process, one after the other, so the
ratios hold even though the 2-core machine's absolute speed varies. Prints a
table, writes docs/benchmarks.md (section `engine`) and docs/step_times.json,
and prints one JSON line last.
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

import numpy as np
import torch
import torch.nn.functional as F
from batchpilot_server.batching import MODES, BatchingConfig, Mode
from batchpilot_server.engine import Engine, RequestStream
from batchpilot_server.engine_api import AttentionBackend, EngineOptions, SamplingParams
from batchpilot_server.kv_cache import KVCache
from batchpilot_server.model_runner import ModelRunner
from batchpilot_server.models import Decoder, ModelSpec, build_model
from batchpilot_server.sequence import Sequence
from sections import replace_section

DOCS = Path(__file__).resolve().parent.parent / "docs"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_TOKENS = 16
STEP_CONTEXT = 80  # the step-time curve's context: mid-way through a typical request
HOSTAGE_LENGTHS = (10, 50, 100, 200)
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


@dataclass(frozen=True)
class Rate:
    tokens: int
    wall_s: float
    cpu_s: float  # this process's CPU time: less disturbed by other load than wall time

    @property
    def per_s(self) -> float:
        return self.tokens / self.wall_s

    @property
    def per_cpu_s(self) -> float:
        return self.tokens / self.cpu_s


class ContiguousKV:
    """The raw loop's cache: [layers, batch, heads, capacity, head_dim] per K and V."""

    def __init__(self, spec: ModelSpec, batch: int, capacity: int) -> None:
        shape = (spec.n_layers, batch, spec.n_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape)
        self.v = torch.zeros(shape)
        self.length = 0  # tokens cached before the current forward

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        end = self.length + q.shape[1]
        self.k[layer, :, :, self.length : end] = k.transpose(1, 2)
        self.v[layer, :, :, self.length : end] = v.transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            self.k[layer, :, :, :end],
            self.v[layer, :, :, :end],
            is_causal=q.shape[1] > 1,  # prefill starts at 0, so plain causal is right
        )
        return out.transpose(1, 2)


class IndexSelectAttention:
    """The naive paged read DESIGN measured: copy every sequence's blocks into
    contiguous K/V with index_select each step. It reads a token-major copy of the
    pool ([blocks, block_size, heads, head_dim]) so that the gather is the only copy."""

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
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=self.mask)
        return out.transpose(1, 2)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[256, *rng.integers(0, 256, length - 1).tolist()] for _ in range(count)]


@torch.inference_mode()
def raw_generate(model: Decoder, batch: int, tokens: int) -> Rate:
    """The bare loop: one batched prefill, then greedy decode steps."""
    cache = ContiguousKV(model.spec, batch, PROMPT_TOKENS + tokens)
    ids = torch.tensor(prompts(batch, PROMPT_TOKENS, seed=batch))
    positions = torch.arange(PROMPT_TOKENS).expand(batch, -1)
    start, cpu = time.perf_counter(), time.process_time()
    next_ids = model.logits(model.hidden(ids, positions, cache)[:, -1]).argmax(-1)
    cache.length = PROMPT_TOKENS
    for _ in range(tokens - 1):
        next_ids = decode_step(model, cache, next_ids)
    return Rate(batch * tokens, time.perf_counter() - start, time.process_time() - cpu)


def decode_step(model: Decoder, cache: ContiguousKV, ids: torch.Tensor) -> torch.Tensor:
    position = torch.full((ids.shape[0], 1), cache.length)
    hidden = model.hidden(ids[:, None], position, cache)
    cache.length += 1
    return model.logits(hidden[:, 0]).argmax(-1)


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


async def count_tokens(stream: RequestStream) -> int:
    return sum([1 async for _ in stream])


async def saturated(engine: Engine, batch: int, tokens: int, waves: int = 2) -> Rate:
    """The engine's rate with `waves * batch` requests queued at once."""
    config = engine.config
    engine.reconfigure(BatchingConfig(batch, 0.0, max(config.max_queue_size, waves * batch)))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start, cpu = time.perf_counter(), time.process_time()
    streams = [engine.submit(p, params) for p in prompts(waves * batch, PROMPT_TOKENS, batch)]
    produced = sum(await asyncio.gather(*(count_tokens(s) for s in streams)))
    return Rate(produced, time.perf_counter() - start, time.process_time() - cpu)


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
        await saturated(engine, 4, 8)  # warm-up: first calls allocate
        await saturated(fallback, 4, 8)
        raw_generate(model, 4, 8)
        for _ in range(plan.rounds):
            for batch in BATCHES:
                raw = raw_generate(model, batch, plan.decode_tokens)
                ours = await saturated(engine, batch, plan.decode_tokens)
                curves.raw[batch] = max(curves.raw[batch], raw.per_s)
                curves.raw_cpu[batch] = max(curves.raw_cpu[batch], raw.per_cpu_s)
                curves.engine[batch] = max(curves.engine[batch], ours.per_s)
                curves.engine_cpu[batch] = max(curves.engine_cpu[batch], ours.per_cpu_s)
            torch_32 = await saturated(fallback, 32, plan.decode_tokens)
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
    """Seconds from submit to completion of each of the four requests."""
    engine = Engine(engine_options(mode, BatchingConfig(8, 20.0, 64), threads))
    await engine.start()
    try:
        start = time.perf_counter()

        async def complete(stream: RequestStream) -> float:
            await count_tokens(stream)
            return time.perf_counter() - start

        streams = [
            engine.submit(p, SamplingParams(max_tokens=n, ignore_eos=True))
            for p, n in zip(prompts(4, PROMPT_TOKENS, 7), HOSTAGE_LENGTHS, strict=True)
        ]
        return list(await asyncio.gather(*(complete(s) for s in streams)))
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
        "paged": lambda: runner.decode(seqs),
        "paged_torch": lambda: fallback.decode(seqs),
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
    runner.close()
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
        f"CPU, {setup['threads']} torch thread(s), tiny model, prompts of {PROMPT_TOKENS} "
        f"tokens, {setup['decode_tokens']} generated tokens per request. The machine is shared "
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
    hostage = results["hostage_example"]
    lines += [
        "",
        "Hostage example (seconds from submit to completion, requests of "
        + "/".join(map(str, HOSTAGE_LENGTHS))
        + " tokens):",
        "",
        "| mode | " + " | ".join(f"{n} tokens" for n in HOSTAGE_LENGTHS) + " |",
        "|---|" + "---|" * len(HOSTAGE_LENGTHS),
    ]
    for mode in MODES:
        lines.append(f"| {mode} | " + " | ".join(f"{t:.3f}" for t in hostage[mode]) + " |")
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
        "one C call per layer (`server/csrc/paged_attention.c`, built on first use with "
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


async def run(plan: Plan, threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model = build_model("tiny", "cpu")
    print("throughput by batch size", file=sys.stderr)
    curves = await throughput_curves(model, plan, threads)
    print("hostage example", file=sys.stderr)
    hostage = {mode: await hostage_example(mode, threads) for mode in MODES}
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
        "hostage_example": hostage,
        "mixed": mixed,
        "gather_512": gather,
    }
    results["targets"] = verdict(results)
    return results


def write_docs(results: dict[str, Any], docs: Path) -> None:
    replace_section(docs / "benchmarks.md", "engine", render(results))
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
    parser.add_argument("--quick", action="store_true", help="a ~30 s version")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--docs", type=Path, default=DOCS, help="where to write the results")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    results = asyncio.run(run(QUICK if args.quick else FULL, args.threads))
    print(render(results))
    if not args.no_write:
        write_docs(results, args.docs)
    print(json.dumps(results, separators=(",", ":")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
