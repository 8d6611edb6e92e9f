"""Structured output's cost on SmolLM2-135M's vocabulary (49152 tokens), no HTTP.

- compile_s: compiling the nested schema of tests/integration/test_structured_output.py
  (first time; the cache serves it after);
- a step of 32 rows: the sampler's processing (`Sampler.sample`) of greedy rows with no
  grammar against the same rows each with its grammar (one bitmask filled by xgrammar
  and applied at once); `mask_ratio` is the second over the first.

Both sides run in this process, interleaved, so the ratio holds on a loaded machine.
Prints one JSON line last.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import torch
from batchpilot_server.engine.sampling import Sampler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine.weights import load_model
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.http.grammar_compiler import GrammarCompiler
from batchpilot_server.http.grammar_request import GrammarRequest
from prometheus_client import Histogram

ROOT = Path(__file__).resolve().parent.parent
# appended, not prepended: the repository's `operator` folder would shadow the stdlib's
sys.path.append(str(ROOT))
from tests.integration.test_structured_output import NESTED  # noqa: E402
from tests.support.smollm2 import hf_directory  # noqa: E402

ROWS = 32
STEPS = 30


def main() -> None:
    tokenizer = load_model(str(hf_directory()), device="cpu").tokenizer
    compile_seconds = Histogram("compile", "", registry=None)
    mask_seconds = Histogram("mask", "", registry=None)
    structured = GrammarCompiler(tokenizer, compile_seconds, mask_seconds)
    began = time.perf_counter()
    grammar = asyncio.run(structured.compile(GrammarRequest(NESTED, "response_format")))
    compile_s = time.perf_counter() - began
    vocab = tokenizer.vocab_size
    sampler = Sampler(vocab, tokenizer.eos_ids, "cpu")

    def rows(constrained: bool) -> list[Sequence]:
        params = SamplingParams(max_tokens=4096, grammar=grammar if constrained else None)
        return [Sequence(f"r{i}", [1, 2, 3], params, 0.0, None, None) for i in range(ROWS)]

    plain_s, masked_s = 0.0, 0.0
    plain, masked = rows(False), rows(True)
    for _ in range(STEPS):
        logits = torch.randn(ROWS, vocab)
        began = time.perf_counter()
        sampler.sample(logits.clone(), plain)
        plain_s += time.perf_counter() - began
        began = time.perf_counter()
        sampled = sampler.sample(logits.clone(), masked)
        # timed with the step's advance: the matchers accept their tokens there
        StepPlan(decode=masked).advance(sampled.tokens)
        masked_s += time.perf_counter() - began
    structured.close()
    print(
        json.dumps(
            {
                "bench": "structured_output",
                "rows": ROWS,
                "compile_s": round(compile_s, 4),
                "plain_step_ms": round(1000 * plain_s / STEPS, 3),
                "masked_step_ms": round(1000 * masked_s / STEPS, 3),
                "mask_ratio": round(masked_s / plain_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
