"""bench/engine.py on a real model: what the engine costs against the bare model
loop, what it gains against transformers' own `generate`, and how long loading takes.

Per weight dtype (float32 and the one `--dtype auto` picks: once when they agree):

- load seconds: batchpilot from the model as given (a GGUF file: read and
  dequantize), batchpilot from the Hugging Face directory with the same weights,
  and transformers' `from_pretrained` from that directory;
- tokens/s at batch 1, 8 and 32 of the raw loop (bench/measure.py), of the engine
  at saturation (continuous mode, two waves of `batch` requests through
  `max_batch_size = batch`, every token streamed) and, at batch 1 and 32, of
  transformers' greedy `generate` on the same prompts, for the same number of
  new tokens (EOS ignored on every side), in the same process and threads;
- whether the engine's greedy tokens equal transformers' for one prompt.

Every round runs each side once per batch size, one right after the other, and
each figure is its best round: load from elsewhere on the shared machine only
ever slows a run down, and hits both sides of a ratio alike.
"""

from __future__ import annotations

import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from operator import attrgetter
from pathlib import Path
from typing import Any, TypeVar, cast

import torch
import transformers
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.core import Engine
from batchpilot_server.engine.kv_cache import bytes_per_block
from batchpilot_server.engine.models import ModelSpec
from batchpilot_server.engine.weights import LoadedModel, load_model, resolve_dtype
from batchpilot_server.engine_api import DTypeName, EngineOptions, SamplingParams
from measure import Prompts, Rate, Timer, raw_generate, saturated
from model_refs import ModelRef
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

BATCHES = (1, 8, 32)
TRANSFORMERS_BATCHES = (1, 32)
PROMPT_TOKENS = 16
BLOCK_SIZE = 16
TARGETS = {"engine_over_raw_32": 0.9, "over_transformers_1": 1.0, "over_transformers_32": 2.0}

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    decode_tokens: int  # generated per request
    rounds: int  # interleaved rounds of every side, best kept
    load_rounds: int  # loads of each kind, fastest kept


FULL = Plan(decode_tokens=64, rounds=3, load_rounds=2)
QUICK = Plan(decode_tokens=8, rounds=1, load_rounds=1)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- loading ----------------------------------------------------------------


def fastest(load: Callable[[], T], rounds: int) -> tuple[T, float]:
    """The last of `rounds` loads and the fastest one's seconds; the file is in the
    page cache after the first, so one cold read does not decide the figure."""
    best, value = float("inf"), None
    for _ in range(rounds):
        value = None  # let the previous copy go before loading the next
        gc.collect()
        began = time.perf_counter()
        value = load()
        best = min(best, time.perf_counter() - began)
    assert value is not None
    return value, best


def load_transformers(directory: Path, dtype: torch.dtype) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).eval()
    # never stop at EOS, like the engine's ignore_eos: every side makes as many tokens
    # (a None passed to generate() would fall back to this config's EOS)
    model.generation_config.eos_token_id = None
    return model


@dataclass
class Sides:
    ours: LoadedModel  # the raw loop's model, loaded as the engine loads it
    reference: PreTrainedModel | None  # transformers', where a HF directory exists
    load_s: dict[str, float]


def source_kind(ref: ModelRef) -> str:
    if ref.source.endswith(".gguf"):
        return "gguf"
    return "preset" if ref.is_preset else "hf_directory"


def load_sides(ref: ModelRef, dtype: torch.dtype, rounds: int) -> Sides:
    name = cast(DTypeName, dtype_name(dtype))

    def ours(source: str) -> Callable[[], LoadedModel]:
        return lambda: load_model(source, device="cpu", dtype=name)

    loaded, seconds = fastest(ours(ref.source), rounds)
    load_s = {f"batchpilot_{source_kind(ref)}": seconds}
    reference = None
    if ref.reference is not None:
        if source_kind(ref) != "hf_directory":
            _, load_s["batchpilot_hf_directory"] = fastest(ours(str(ref.reference)), rounds)
        directory = ref.reference
        reference, load_s["transformers_hf_directory"] = fastest(
            lambda: load_transformers(directory, dtype), rounds
        )
    return Sides(loaded, reference, load_s)


# ---- the sides ---------------------------------------------------------------


@torch.inference_mode()
def transformers_tokens(
    model: PreTrainedModel, prompts: Prompts, batch: int, tokens: int
) -> tuple[Rate, torch.Tensor]:
    """transformers' greedy `generate` on the raw loop's prompts; the rate and the new ids."""
    ids = torch.tensor(prompts.draw(batch, seed=batch))
    config = GenerationConfig(max_new_tokens=tokens, do_sample=False, pad_token_id=0)
    timer = Timer()
    mask = torch.ones_like(ids)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    rate = timer.rate(batch * tokens)
    if out.shape[1] != prompts.length + tokens:
        raise RuntimeError(f"generate made {out.shape[1] - prompts.length} tokens, not {tokens}")
    return rate, out[:, prompts.length :]


async def greedy_agreement(
    engine: Engine, reference: PreTrainedModel, prompts: Prompts, tokens: int
) -> dict[str, Any]:
    """The engine's and transformers' greedy tokens for batch 1's prompt, compared."""
    _, theirs = transformers_tokens(reference, prompts, 1, tokens)  # draws with seed 1
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    ours = [event.token_id async for event in engine.submit(prompts.draw(1, seed=1)[0], params)]
    differ = [i for i, (a, b) in enumerate(zip(ours, theirs[0].tolist(), strict=True)) if a != b]
    first = differ[0] if differ else None
    return {"tokens": tokens, "equal": not differ, "first_difference": first}


def kv_cache_mb(spec: ModelSpec, tokens: int) -> float:
    """Room for the largest batch of requests of PROMPT_TOKENS + `tokens`, sized for a
    float32 cache (a bfloat16 model's cache holds twice the tokens in it: room to spare)."""
    blocks = -(-(PROMPT_TOKENS + tokens) // BLOCK_SIZE) + 1
    return max(BATCHES) * blocks * bytes_per_block(spec, BLOCK_SIZE, torch.float32) / 2**20


async def compare(ref: ModelRef, dtype: torch.dtype, plan: Plan, threads: int) -> dict[str, Any]:
    name = dtype_name(dtype)
    print(f"{name}: loading", file=sys.stderr)
    sides = load_sides(ref, dtype, plan.load_rounds)
    model, spec, reference = sides.ours.model, sides.ours.spec, sides.reference
    prompts = Prompts(PROMPT_TOKENS, spec.vocab_size, sides.ours.tokenizer.bos_id)
    options = EngineOptions(
        mode="continuous",
        config=BatchingConfig(1, 0.0, 256),
        model=ref.source,
        device="cpu",
        kv_cache_mb=kv_cache_mb(spec, plan.decode_tokens),
        threads=threads,
        dtype=cast(DTypeName, name),
        block_size=BLOCK_SIZE,
    )
    engine = Engine(options)
    await engine.start()
    best: dict[str, dict[int, Rate]] = {"raw": {}, "engine": {}, "transformers": {}}
    try:
        # warm-up: first calls allocate, the native kernel loads
        await saturated(engine, prompts, 4, 4)
        raw_generate(model, prompts, 4, 4)
        agreement = None
        if reference is not None:
            transformers_tokens(reference, prompts, 4, 4)
            agreement = await greedy_agreement(engine, reference, prompts, plan.decode_tokens)
        for round_ in range(plan.rounds):
            for batch in BATCHES:
                rates = {
                    "raw": raw_generate(model, prompts, batch, plan.decode_tokens),
                    "engine": await saturated(engine, prompts, batch, plan.decode_tokens),
                }
                if reference is not None and batch in TRANSFORMERS_BATCHES:
                    rates["transformers"], _ = transformers_tokens(
                        reference, prompts, batch, plan.decode_tokens
                    )
                for side, rate in rates.items():
                    if batch not in best[side] or rate.per_s > best[side][batch].per_s:
                        best[side][batch] = rate
                print(
                    f"  round {round_ + 1} batch {batch:>2}: "
                    + "  ".join(f"{side} {rate.per_s:7.1f} tok/s" for side, rate in rates.items()),
                    file=sys.stderr,
                )
        attention = engine.attention
    finally:
        await engine.shutdown()
    return {
        "dtype": name,
        "attention": attention,
        "load_s": sides.load_s,
        "greedy_agreement": agreement,
        **figures(best),
    }


def figures(best: dict[str, dict[int, Rate]]) -> dict[str, Any]:
    raw, ours, theirs = best["raw"], best["engine"], best["transformers"]
    return {
        "tokens_per_s": {
            side: {str(b): round(rate.per_s, 1) for b, rate in rates.items()}
            for side, rates in best.items()
        },
        "tokens_per_cpu_s": {
            side: {str(b): round(rate.per_cpu_s, 1) for b, rate in rates.items()}
            for side, rates in best.items()
        },
        "engine_over_raw": ratios(ours, raw, attrgetter("per_s")),
        "engine_over_transformers": ratios(ours, theirs, attrgetter("per_s")),
        "engine_over_raw_per_cpu_s": ratios(ours, raw, attrgetter("per_cpu_s")),
        "engine_over_transformers_per_cpu_s": ratios(ours, theirs, attrgetter("per_cpu_s")),
    }


def ratios(
    ours: dict[int, Rate], theirs: dict[int, Rate], rate: Callable[[Rate], float]
) -> dict[str, float]:
    """Ours over theirs at each batch size theirs was measured at."""
    return {str(b): round(rate(ours[b]) / rate(theirs[b]), 3) for b in theirs}


def verdict(by_dtype: dict[str, Any]) -> dict[str, bool]:
    targets = {}
    for name, result in by_dtype.items():
        targets[f"{name} engine/raw at 32"] = (
            result["engine_over_raw"]["32"] >= TARGETS["engine_over_raw_32"]
        )
        versus = result["engine_over_transformers"]
        for batch in TRANSFORMERS_BATCHES:
            if str(batch) in versus:
                targets[f"{name} engine/transformers at {batch}"] = (
                    versus[str(batch)] >= TARGETS[f"over_transformers_{batch}"]
                )
    return targets


async def run(ref: ModelRef, plan: Plan, dtypes: list[str], threads: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    resolved = list(dict.fromkeys(resolve_dtype(name, "cpu", source=ref.source) for name in dtypes))
    by_dtype = {}
    for dtype in resolved:
        by_dtype[dtype_name(dtype)] = await compare(ref, dtype, plan, threads)
        gc.collect()
    return {
        "setup": {
            "model": ref.title,
            "threads": threads,
            "device": "cpu",
            "auto_dtype": dtype_name(resolve_dtype("auto", "cpu", source=ref.source)),
            "prompt_tokens": PROMPT_TOKENS,
            "decode_tokens": plan.decode_tokens,
            "rounds": plan.rounds,
            "load_rounds": plan.load_rounds,
        },
        "by_dtype": by_dtype,
        "targets": verdict(by_dtype),
    }


# ---- the docs section ---------------------------------------------------------------

LOAD_COLUMNS = {
    "batchpilot_gguf": "batchpilot, GGUF file (read + dequantize)",
    "batchpilot_preset": "batchpilot, preset (random init)",
    "batchpilot_hf_directory": "batchpilot, HF directory (safetensors)",
    "transformers_hf_directory": "transformers `from_pretrained`, HF directory",
}


def render(ref: ModelRef, results: dict[str, Any]) -> str:
    setup, by_dtype = results["setup"], results["by_dtype"]
    auto = setup["auto_dtype"]
    lines = [
        f"### Engine (bench/engine.py --model {ref.key})",
        "",
        f"{setup['model']}, CPU, {setup['threads']} torch thread(s); `--dtype auto` loads "
        f"{auto} weights here. Prompts of {setup['prompt_tokens']} random token ids, "
        f"{setup['decode_tokens']} generated tokens per request, greedy, EOS ignored on "
        "every side; tokens/s count generated tokens over wall time, prompt included "
        "(`per CPU second`: over this process's CPU time instead, which other load "
        "disturbs less; the engine's event-loop thread counts against it). "
        "Raw loop: the model alone (one batched prefill, then decode steps over "
        "contiguous K/V tensors). Engine: continuous mode at saturation, two waves of "
        "`batch` requests through `max_batch_size = batch`, every token streamed. "
        "transformers: `generate` on the same weights (read from the Hugging Face "
        "directory written from the GGUF), the same prompts and threads. Best of "
        f"{setup['rounds']} rounds; in a round the sides run one after the other, so "
        "other load on the shared 2-core machine hits both sides of a ratio alike.",
        "",
        "| dtype | batch | raw loop tok/s | engine tok/s | engine / raw | same, per CPU "
        "second | transformers tok/s | engine / transformers | same, per CPU second |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in by_dtype.items():
        rates, label = result["tokens_per_s"], name + (" (auto)" if name == auto else "")
        for batch in map(str, BATCHES):
            cells = [
                rates["raw"][batch],
                rates["engine"][batch],
                result["engine_over_raw"][batch],
                result["engine_over_raw_per_cpu_s"][batch],
                rates["transformers"].get(batch),
                result["engine_over_transformers"].get(batch),
                result["engine_over_transformers_per_cpu_s"].get(batch),
            ]
            digits = (1, 1, 2, 2, 1, 2, 2)
            lines.append(
                f"| {label} | {batch} | "
                + " | ".join(
                    "-" if c is None else f"{c:.{d}f}" for c, d in zip(cells, digits, strict=True)
                )
                + " |"
            )
    lines += ["", *agreement_lines(by_dtype), "", *load_lines(by_dtype, setup["load_rounds"])]
    lines += [
        "",
        "Targets: "
        + ", ".join(f"{k} {'met' if ok else 'MISSED'}" for k, ok in results["targets"].items()),
    ]
    return "\n".join(lines)


def agreement_lines(by_dtype: dict[str, Any]) -> list[str]:
    lines = []
    for name, result in by_dtype.items():
        agreement = result["greedy_agreement"]
        if agreement is None:
            continue
        outcome = (
            "equal"
            if agreement["equal"]
            else f"first differ at token {agreement['first_difference']}"
        )
        lines.append(
            f"- {name}: the engine's {agreement['tokens']} greedy tokens for one prompt "
            f"and transformers': {outcome}."
        )
    return lines


def load_lines(by_dtype: dict[str, Any], rounds: int) -> list[str]:
    columns = [c for c in LOAD_COLUMNS if any(c in r["load_s"] for r in by_dtype.values())]
    lines = [
        f"Load seconds (fastest of {rounds}; the files in the page cache after the first):",
        "",
        "| dtype | " + " | ".join(LOAD_COLUMNS[c] for c in columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for name, result in by_dtype.items():
        cells = [result["load_s"].get(c) for c in columns]
        lines.append(
            f"| {name} | " + " | ".join("-" if s is None else f"{s:.2f}" for s in cells) + " |"
        )
    return lines
