"""Does `torch.compile` of the decode step pay on this CPU? The 30 layers' math around
attention of SmolLM2-135M (RMSNorm, q/k/v, RoPE, o, residuals, RMSNorm, gate/up, SiLU,
down), eager against compiled by inductor (C++ backend, dynamic=False, one graph per
batch size), interleaved in one process, best of `--rounds`. Attention stays eager
between the two regions of a layer: the engine's C kernel is an opaque ctypes call.

Inductor cannot lower `mkldnn._linear_pointwise` over the engine's prepacked weights
(the opaque oneDNN tensor reaches it as a plain input buffer), so the compiled regions
call the same prepacked kernel through a `torch.library` custom op.

    bench/decode_compile.py [--rounds 20] [--dtypes bfloat16,float32]

Prints one line per (dtype, batch) and a final JSON line; docs/benchmarks.md
("Engine speed") records a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

import model_refs
import torch
import torch.nn.functional as F
from batchpilot_server.engine.linear_kernels import PackedLinear
from batchpilot_server.engine.models import Decoder, DecoderLayer, apply_rope
from batchpilot_server.engine.weights import load_model

BATCHES = (1, 32)
POSITION = 70
Layers = Callable[[Decoder, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


@torch.library.custom_op("batchpilot_bench::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


def project(linear: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The projection, opaque to inductor when it is a prepacked oneDNN one."""
    if isinstance(linear, PackedLinear) and linear.bias is None:
        return packed_linear(x, linear.packed, linear.out_features)
    return linear(x)


def before_attention(
    block: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    batch, tokens, _ = x.shape
    qkv = project(block.qkv_proj, block.input_layernorm(x))
    q, k, v = qkv.view(batch, tokens, -1, block.spec.head_dim).split(block.split, dim=2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def after_attention(block: DecoderLayer, x: torch.Tensor, mixed: torch.Tensor) -> torch.Tensor:
    x = x + project(block.o_proj, mixed.reshape(x.shape[0], x.shape[1], -1))
    gate, up = project(block.gate_up_proj, block.post_attention_layernorm(x)).chunk(2, dim=-1)
    return x + project(block.down_proj, F.silu(gate) * up)


def layers_with(before: Callable, after: Callable) -> Layers:
    def run(
        model: Decoder, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mixed: torch.Tensor
    ) -> None:
        for block in model.layers:
            before(block, x, cos, sin)
            after(block, x, mixed)

    return run


def inputs(model: Decoder, batch: int) -> tuple[torch.Tensor, ...]:
    positions = torch.full((batch, 1), POSITION)
    x = torch.randn(batch, 1, model.spec.d_model, dtype=model.dtype)
    cos, sin = model.rope_cos[positions][:, :, None], model.rope_sin[positions][:, :, None]
    heads = model.spec.n_heads
    mixed = torch.randn(batch, 1, heads, model.spec.head_dim, dtype=model.dtype)
    return x, cos, sin, mixed


@torch.inference_mode()
def measure(model: Decoder, rounds: int) -> dict[str, dict[str, float]]:
    eager = layers_with(before_attention, after_attention)
    compiled = layers_with(
        torch.compile(before_attention, dynamic=False),
        torch.compile(after_attention, dynamic=False),
    )
    out = {}
    for batch in BATCHES:
        args = inputs(model, batch)
        began = time.perf_counter()
        compiled(model, *args)
        compile_s = time.perf_counter() - began
        best = {"eager": float("inf"), "compiled": float("inf")}
        for _ in range(rounds):
            for name, run in (("eager", eager), ("compiled", compiled)):
                began = time.perf_counter()
                run(model, *args)
                best[name] = min(best[name], (time.perf_counter() - began) * 1e3)
        out[f"batch {batch}"] = {
            "eager_ms": round(best["eager"], 2),
            "compiled_ms": round(best["compiled"], 2),
            "compiled_over_eager": round(best["compiled"] / best["eager"], 3),
            "first_call_s": round(compile_s, 1),
        }
        print(f"  batch {batch}: {out[f'batch {batch}']}", flush=True)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch._dynamo.config.cache_size_limit = 64  # one graph per batch size and region
    results = {}
    for dtype in args.dtypes.split(","):
        print(dtype, flush=True)
        model = load_model(model_refs.smollm2().source, device="cpu", dtype=dtype).model
        results[dtype] = measure(model, args.rounds)
    print(json.dumps({"benchmark": "decode_compile", "threads": 1, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
