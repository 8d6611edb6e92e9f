"""What an engine steps: the model, its paged KV cache and the runner over both, built
once, on the engine thread (core.py says why that thread).

The KV pool is sized by `--kv-cache-mb` (or a share of free CUDA memory) in the dtype its
K/V are held in; the context a request may use is the model's, capped to what the whole
pool holds.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from batchpilot_server.engine.kv_cache import KVCache, bytes_per_block
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.weights import LoadedModel, load_model
from batchpilot_server.engine_api import EngineOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuiltModel:
    loaded: LoadedModel
    cache: KVCache
    runner: ModelRunner
    max_model_len: int  # tokens, prompt + output: the model's context capped to the pool


def build_model(options: EngineOptions, device: str, threads: int) -> BuiltModel:
    """Load the model, size its KV cache and put a runner over both."""
    loaded = load_model(
        options.model,
        device=device,
        dtype=options.dtype,
        quantization=options.quantization,
        seed=options.seed,
        max_model_len=options.max_model_len,
    )
    budget = options.kv_cache_mb * 2**20
    if device == "cuda" and options.gpu_memory_fraction is not None:
        free, _ = torch.cuda.mem_get_info()
        budget = free * options.gpu_memory_fraction
    dtype = kv_dtype(loaded, device)
    cache = KVCache.sized(loaded.spec, budget, options.block_size, device, dtype)
    runner = ModelRunner(loaded.model, cache, options.attention, threads)
    cache.pool.prefix_caching = options.prefix_caching and _may_share_blocks(runner)
    return BuiltModel(loaded, cache, runner, _context_length(loaded, cache, dtype))


def kv_dtype(loaded: LoadedModel, device: str) -> torch.dtype:
    """The model's K/V dtype where that is bfloat16 or on CUDA: a bfloat16 model's K/V are
    bfloat16 values, held exactly in half float32's bytes (twice the tokens per MiB, half
    the bytes decode attention reads); the native kernel computes in float32 over either.
    float16 on the CPU: float32, which the kernel reads."""
    if device == "cuda" or loaded.dtype == torch.bfloat16:
        return loaded.dtype
    return torch.float32


def _may_share_blocks(runner: ModelRunner) -> bool:
    """Whether decode attention reads blocks that several sequences share: the native
    kernel does; the torch path scores each pool block for one owner."""
    if runner.attention == "native":
        return True
    log.warning("prefix caching is off: the torch decode attention cannot share blocks")
    return False


def _context_length(loaded: LoadedModel, cache: KVCache, dtype: torch.dtype) -> int:
    """The model's context, or fewer tokens if the whole pool holds fewer: a longer
    request could never be scheduled (as vLLM, but a warning rather than an error, so
    that a small default pool still serves)."""
    context, size = loaded.spec.max_seq_len, cache.block_size
    pool_tokens = cache.pool.num_blocks * size
    if pool_tokens >= context:
        return context
    needed = cache.pool.blocks_for(context) * bytes_per_block(loaded.spec, size, dtype)
    log.warning(
        "the KV cache holds %d tokens, fewer than the model's context of %d: "
        "max_model_len is %d tokens (prompt + output). Raise --kv-cache-mb (%.0f MiB "
        "holds the whole context) or lower --max-model-len",
        pool_tokens,
        context,
        pool_tokens,
        needed / 2**20,
    )
    return pool_tokens
