"""Quality of each weight mode against float32, as llama.cpp's `perplexity --kl-divergence`
reports its quantizations: over a fixed text (bench/data/public_domain.txt: the US
Declaration of Independence and the Gettysburg Address, public domain), in windows of
WINDOW tokens, every position's next-token distribution is compared with float32's.

Per mode: mean and 99th-percentile KL(float32 || mode) of the next-token distribution
in nats, top-1 agreement (the same argmax as float32), and perplexity of the text.
The reference is float32 through plain nn.Linear (the path checked token for token
against transformers); `float32` here is the engine's own float32 kernels.

    bench/quality.py [--model smollm2] [--tokens N]

Writes its section of docs/benchmarks.md and prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import cast

import model_refs
import torch
from batchpilot_server.engine.linear_kernels import RowLimits, swap_linear_kernels
from batchpilot_server.engine.weight_quality import BOUND, Quality, compare
from batchpilot_server.engine.weights import KernelChoice, LoadedModel, load_model
from batchpilot_server.engine_api import DTypeName, Quantization
from sections import replace_section

ROOT = Path(__file__).resolve().parent.parent
TEXT = Path(__file__).resolve().parent / "data" / "public_domain.txt"
DOCS = ROOT / "docs"
WINDOW = 512  # tokens per forward; each window starts fresh (BOS, no earlier context)
# (label, dtype, quantization): the modes `batchpilot serve` offers on the CPU
MODES: tuple[tuple[str, DTypeName, Quantization], ...] = (
    ("float32", "float32", "none"),
    ("bfloat16", "bfloat16", "none"),
    ("int8 (bfloat16 activations)", "bfloat16", "int8"),
    ("int4, prefill's bfloat16 copy (more than 8 rows)", "bfloat16", "int4"),
)
# the few-row kernels, each measured with every row through it (the windows are
# prefills of many rows, which their dense copies compute)
FEW_ROWS: tuple[tuple[str, Quantization, RowLimits], ...] = (
    ("bfloat16, the float16-weight kernel (decode: up to 4 rows)", "none", RowLimits(fp16=None)),
    ("int4, the 4-bit kernel (decode: up to 8 rows)", "int4", RowLimits(int4=None)),
)


def text_windows(loaded: LoadedModel, tokens: int) -> list[list[int]]:
    """The text's first `tokens` token ids in windows of WINDOW, each led by BOS."""
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)[:tokens]
    head = [] if tokenizer.bos_id is None else [tokenizer.bos_id]
    step = WINDOW - len(head)
    return [head + ids[i : i + step] for i in range(0, len(ids), step)]


@torch.inference_mode()
def log_probs(loaded: LoadedModel, windows: list[list[int]]) -> list[torch.Tensor]:
    """float32 log-softmax [positions, vocab] of every window."""
    return [torch.log_softmax(loaded.model.full_logits(w).float(), -1) for w in windows]


def positions(
    log_probs: list[torch.Tensor], windows: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every window's predictions but the last (nothing follows it) and their targets."""
    predicted = torch.cat([lp[:-1] for lp in log_probs])
    return predicted, torch.tensor([t for w in windows for t in w[1:]])


def measure(source: str, tokens: int) -> tuple[int, dict[str, Quality]]:
    """(positions compared, quality per mode) of the model at `source`."""
    reference = load_model(source, device="cpu", dtype="float32", kernels="plain")
    windows = text_windows(reference, tokens)
    ref, targets = positions(log_probs(reference, windows), windows)
    del reference
    results = {"float32 (plain nn.Linear, the reference)": compare(ref, ref, targets)}
    for label, dtype, quantization in MODES:
        kernels = cast(KernelChoice, "fast")
        loaded = load_model(
            source, device="cpu", dtype=dtype, quantization=quantization, kernels=kernels
        )
        ours, _ = positions(log_probs(loaded, windows), windows)
        results[label] = compare(ref, ours, targets)
        print(f"  {label}: {results[label]}", file=sys.stderr)
    for label, quantization, limits in FEW_ROWS:
        loaded = load_model(source, device="cpu", dtype="bfloat16", kernels="plain")
        swap_linear_kernels(loaded.model, quantization, limits)
        results[label] = compare(ref, positions(log_probs(loaded, windows), windows)[0], targets)
        print(f"  {label}: {results[label]}", file=sys.stderr)
    return sum(len(w) - 1 for w in windows), results


def render(title: str, positions: int, results: dict[str, Quality]) -> str:
    lines = [
        "### Quality per weight mode (bench/quality.py)",
        "",
        f"{title}, {positions} next-token predictions over bench/data/public_domain.txt "
        f"(windows of {WINDOW} tokens). KL: KL(float32 || mode) of the next-token "
        "distribution in nats; top-1: the same most likely token as float32. "
        f"`--dtype auto` may pick a mode over float32 only within mean KL <= "
        f"{BOUND['mean_kl']} nats and top-1 >= {BOUND['top1']:.0%}.",
        "",
        "| mode | mean KL | p99 KL | top-1 agreement | perplexity | within the bound |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for label, q in results.items():
        lines.append(
            f"| {label} | {q.mean_kl:.5f} | {q.p99_kl:.4f} | {q.top1:.2%} | "
            f"{q.perplexity:.3f} | {'yes' if q.within_bound() else 'no'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=model_refs.SMOLLM2)
    parser.add_argument("--tokens", type=int, default=2048, help="text tokens compared")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    ref = model_refs.resolve(args.model)
    positions, results = measure(ref.source, args.tokens)
    replace_section(
        DOCS / "benchmarks.md", ref.section("quality"), render(ref.title, positions, results)
    )
    print(
        json.dumps(
            {"positions": positions, "bound": BOUND} | {k: asdict(q) for k, q in results.items()}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
