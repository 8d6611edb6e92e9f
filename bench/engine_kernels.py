"""What the projection kernels (server/engine/linear_kernels.py) buy on a real model, and
where a decode step's time goes.

- curve: raw-loop decode tokens/s (bench/measure.py: one batched prefill, then
  greedy steps over contiguous K/V, no scheduler) per batch size 1..64 for each
  weight mode, before (plain nn.Linear: torch's MKL sgemm / per-call oneDNN) and
  after (the engine's kernels: oneDNN-prepacked weights, int8 or int4), all models
  loaded in this process and run one after the other in each round (best kept),
  so the machine's load hits every side alike.
- profile: torch.profiler over engine decode steps (ModelRunner.step on decode rows over the
  paged KV cache, then the greedy argmax) at batch 1 and 32, self CPU time per
  op summed into matmuls, attention, norms/RoPE/activations, sampling and the
  rest (copies, indexing, Python and dispatch: wall time the ops do not cover).

    bench/engine_kernels.py [--model smollm2] [--quick]

Writes its sections of docs/benchmarks.md and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import cast

import model_refs
import torch
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine.weights import KernelChoice, LoadedModel, load_model
from batchpilot_server.engine_api import DTypeName, Quantization, SamplingParams
from measure import Prompts, raw_generate
from sections import replace_section
from torch.profiler import ProfilerActivity, profile

DOCS = Path(__file__).resolve().parent.parent / "docs"
BATCHES = (1, 2, 4, 8, 16, 32, 64)
# (label, dtype, quantization, kernels)
MODES: tuple[tuple[str, DTypeName, Quantization, KernelChoice], ...] = (
    ("float32, plain", "float32", "none", "plain"),
    ("float32", "float32", "none", "fast"),
    ("bfloat16, plain", "bfloat16", "none", "plain"),
    ("bfloat16", "bfloat16", "none", "fast"),
    ("int8", "bfloat16", "int8", "fast"),
    ("int4", "bfloat16", "int4", "fast"),
)
PROFILED = ("float32, plain", "bfloat16")
PROMPT_TOKENS, CONTEXT = 16, 64
CATEGORIES = {
    "matmuls": ("linear", "mm", "matmul", "addmm", "weight_int8pack_mm", "weight_int4pack_mm"),
    "attention": ("paged_attention", "bmm", "softmax", "scaled_dot_product", "index_add"),
    "norms, RoPE, SiLU": ("rsqrt", "pow", "mean", "mul", "add", "silu", "cat", "neg"),
    "sampling (argmax)": ("argmax",),
}


def curve(models: dict[str, LoadedModel], tokens: int, rounds: int) -> dict[str, dict[int, float]]:
    prompts = Prompts(PROMPT_TOKENS, 49152, None)
    best: dict[str, dict[int, float]] = {label: dict.fromkeys(BATCHES, 0.0) for label in models}
    for _ in range(rounds):
        for batch in BATCHES:
            for label, loaded in models.items():
                rate = raw_generate(loaded.model, prompts, batch, tokens).per_s
                best[label][batch] = max(best[label][batch], rate)
        print(f"  round: {best}", file=sys.stderr)
    return best


def category(op: str) -> str:
    name = op.rpartition("::")[2].lstrip("_").lower()  # aten::, mkldnn::, quantized::
    for label, keys in CATEGORIES.items():
        if any(key == name or name.startswith(key) for key in keys):
            return label
    return "other ops (copies, indexing, embedding)"


@torch.inference_mode()
def step_profile(loaded: LoadedModel, batch: int, steps: int) -> dict[str, float]:
    """Milliseconds per engine decode step by category, and the step's wall time."""
    spec = loaded.spec
    blocks = batch * -(-(CONTEXT + steps + 2) // 16)
    cache = KVCache(spec, num_blocks=blocks, block_size=16, device="cpu")
    runner = ModelRunner(loaded.model, cache, "auto", torch.get_num_threads())
    per_row = cache.pool.blocks_for(CONTEXT + steps + 2)
    params = SamplingParams(max_tokens=steps + 2)
    seqs = []
    for row in range(batch):
        seq = Sequence(str(row), list(range(1, CONTEXT + 1)), params, 0.0, None, None)
        seq.block_table = list(range(row * per_row, (row + 1) * per_row))
        seqs.append(seq)
    prefill = StepPlan(prefill=seqs)
    prefill.advance(runner.step(prefill).argmax(-1).tolist())

    def step() -> None:
        decode = StepPlan(decode=seqs)
        decode.advance(runner.step(decode).argmax(-1).tolist())

    step()
    began = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    wall_ms = (time.perf_counter() - began) * 1e3 / steps
    sums: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        sums[category(event.key)] += event.self_cpu_time_total / 1e3 / steps
    ops = sum(sums.values())
    out = {k: round(v, 2) for k, v in sorted(sums.items(), key=lambda kv: -kv[1])}
    # profiled wall time beyond the ops' own time: Python, dispatch, the profiler itself
    out["Python and dispatch (wall - ops)"] = round(max(0.0, wall_ms - ops), 2)
    out["step wall ms"] = round(wall_ms, 2)
    return out


def render_curve(title: str, best: dict[str, dict[int, float]], tokens: int, threads: int) -> str:
    lines = [
        "### Small batches: decode tokens/s per batch size and kernel (bench/engine_kernels.py)",
        "",
        f"{title}, raw loop (the model alone over contiguous K/V), {PROMPT_TOKENS}-token "
        f"prompts, {tokens} greedy tokens per row, {threads} torch thread(s). `plain`: "
        "nn.Linear as before this change (float32 through MKL's sgemm, bfloat16 through "
        "oneDNN reordering the weight on every call); the others are the engine's kernels "
        "(oneDNN-prepacked weights, and for bfloat16 steps of up to 4 rows FBGEMM's "
        "float16-weight GEMM; int8: `_weight_int8pack_mm`; int4: "
        "`_weight_int4pack_mm_for_cpu` up to 8 rows, then the packed bfloat16 copy; "
        "both with bfloat16 activations). "
        "A memory-bound step costs about the same at 1-4 rows: tokens/s should grow with "
        "the batch.",
        "",
        "| mode | " + " | ".join(f"batch {b}" for b in BATCHES) + " |",
        "|---|" + "---:|" * len(BATCHES),
    ]
    for label, rates in best.items():
        lines.append(f"| {label} | " + " | ".join(f"{rates[b]:.1f}" for b in BATCHES) + " |")
    return "\n".join(lines)


def render_profile(title: str, profiles: dict[str, dict[int, dict[str, float]]]) -> str:
    lines = [
        "### Where a decode step's time goes (bench/engine_kernels.py)",
        "",
        f"{title}: one engine decode step (ModelRunner.step on decode rows over the paged cache at "
        f"context {CONTEXT}, the C attention kernel, then the greedy argmax), torch.profiler "
        "self CPU time per op in ms per step, by kind. `Python and dispatch`: the step's "
        "wall time that no torch op accounts for: Python, dispatch, the profiler's own "
        "cost, and the C attention kernel (a ctypes call, invisible to the profiler).",
        "",
    ]
    for label, by_batch in profiles.items():
        kinds = list(dict.fromkeys(k for p in by_batch.values() for k in p))
        lines += [
            f"{label}:",
            "",
            "| ms per step | " + " | ".join(f"batch {b}" for b in by_batch) + " |",
            "|---|" + "---:|" * len(by_batch),
        ]
        for kind in kinds:
            cells = " | ".join(f"{p.get(kind, 0.0):.2f}" for p in by_batch.values())
            lines.append(f"| {kind} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=model_refs.SMOLLM2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ref = model_refs.resolve(args.model)
    tokens, rounds, steps = (8, 1, 4) if args.quick else (24, 2, 16)
    models = {
        label: load_model(
            ref.source, device="cpu", dtype=dtype, quantization=quantization, kernels=kernels
        )
        for label, dtype, quantization, kernels in MODES
    }
    profiles = {
        label: {b: step_profile(models[label], b, steps) for b in (1, 32)} for label in PROFILED
    }
    best = curve(models, tokens, rounds)
    title = f"{ref.title}, CPU, {args.threads} torch thread(s)"
    docs = DOCS / "benchmarks.md"
    replace_section(docs, ref.section("kernels"), render_curve(title, best, tokens, args.threads))
    replace_section(docs, ref.section("step-profile"), render_profile(title, profiles))
    plain, fast = best["float32, plain"], best
    summary = {
        "threads": args.threads,
        "tokens_per_s": {
            label: {str(b): round(r, 1) for b, r in rates.items()} for label, rates in best.items()
        },
        "bf16_over_plain_f32_batch1": round(fast["bfloat16"][1] / plain[1], 2),
        "f32_over_plain_f32_batch32": round(fast["float32"][32] / plain[32], 2),
        "bf16_batch4_over_batch1_tokens": round(fast["bfloat16"][4] / fast["bfloat16"][1], 2),
        "profile_ms": {label: {str(b): p for b, p in by.items()} for label, by in profiles.items()},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(cast(int, main()))
