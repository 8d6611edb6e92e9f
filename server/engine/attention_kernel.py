"""Decode attention through the native C kernel (`csrc/paged_attention.c`, built
and loaded by `attention_kernel_build`): one call per layer, its rows shared among the
engine thread's OpenMP team when a step is long enough, and the choice between this
path and the torch one (`model_runner.PagedDecodeAttention`)."""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import torch
from batchpilot_server.engine.attention_kernel_build import (
    KernelUnavailableError,
    paged_decode_kernel,
)
from batchpilot_server.engine.block_pool import KVAccountingError
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import ATTENTION_BACKENDS, AttentionBackend

log = logging.getLogger(__name__)

# the K/V pool dtypes the kernel reads (it computes in float32 over either)
KERNEL_POOL_DTYPES = (torch.float32, torch.bfloat16)


class NativeKernel:
    """The C function, where each layer's K and V pools start (they never move), and
    the threads a step's rows may share: the kernel runs them on the calling thread's
    OpenMP team (torch's own, where the library links torch's libgomp:
    `attention_kernel_build.shares_torch_openmp`)."""

    def __init__(self, function: ctypes._CFuncPtr, cache: KVCache, threads: int = 1) -> None:
        self.function = function
        self.block_size = cache.block_size
        self.layers = [(k.data_ptr(), v.data_ptr()) for k, v in zip(cache.k, cache.v, strict=True)]
        self.pool_dtype = cache.k.dtype
        self.pool_bf16 = self.pool_dtype == torch.bfloat16  # the C call's flag, read per layer
        self.threads = threads


class NativeDecodeAttention:
    """The same step as `PagedDecodeAttention` in one C call per layer (csrc/paged_attention.c):
    store the new K/V, then each row's queries read its own blocks in place, each KV
    head once for the query heads that share it."""

    def __init__(self, kernel: NativeKernel, seqs: list[Sequence]) -> None:
        # built every step from Python lists in two np.array calls: half the cost of
        # filling a zeroed array row by row at batch 1, where this is per-step overhead
        tables = [seq.block_table for seq in seqs]
        lengths = [seq.num_tokens for seq in seqs]
        # C trusts its indices: a short table would read outside the pool
        size = kernel.block_size
        if any(len(table) * size < length for table, length in zip(tables, lengths, strict=True)):
            raise KVAccountingError("a decoding sequence holds fewer blocks than its tokens need")
        width = max(map(len, tables))
        self.tables = np.array([table + [0] * (width - len(table)) for table in tables], np.int64)
        self.lengths = np.array(lengths, np.int64)
        self.kernel = kernel
        # addresses read once per step, not once per layer
        self.tables_at, self.lengths_at = self.tables.ctypes.data, self.lengths.ctypes.data

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """q [batch, 1, heads, head_dim], k and v [batch, 1, kv_heads, head_dim] in the
        model's dtype; the kernel computes in float32 and stores k and v in the pool's
        dtype (float32, or bfloat16 for a bfloat16 model, whose k and v it holds exactly)."""
        batch, _, heads, head_dim = q.shape
        kv_heads = k.shape[2]
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads do not split into {kv_heads} KV groups")
        kernel, pool = self.kernel, self.kernel.pool_dtype
        # `.to` only where the dtype differs: a same-dtype `.to` returns its tensor but
        # still costs a dispatch, four per layer of a step otherwise
        query = q if q.dtype == torch.float32 else q.to(torch.float32)
        key = k if k.dtype == pool else k.to(pool)
        value = v if v.dtype == pool else v.to(pool)
        # C reads rows `stride(0)` apart, heads and dims packed; k and v share a stride
        if query.stride()[2:] != (head_dim, 1):
            query = query.contiguous()
        if key.stride() != value.stride() or key.stride()[2:] != (head_dim, 1):
            key, value = key.contiguous(), value.contiguous()
        out = query.new_empty(batch, 1, heads, head_dim)
        k_pool, v_pool = kernel.layers[layer]
        status = kernel.function(
            query.data_ptr(), key.data_ptr(), value.data_ptr(), query.stride(0), key.stride(0),
            k_pool, v_pool, kernel.pool_bf16, self.tables_at, self.tables.shape[1],
            self.lengths_at, batch, heads, kv_heads, head_dim, kernel.block_size,
            head_dim**-0.5, out.data_ptr(), kernel.threads,
        )  # fmt: skip
        if status != 0:
            raise MemoryError("the attention kernel could not allocate its scratch weights")
        return out if q.dtype == torch.float32 else out.to(q.dtype)


def native_kernel_for(
    backend: AttentionBackend, cache: KVCache, threads: int = 1
) -> NativeKernel | None:
    """The kernel decode attention should use; None means the torch path."""
    if backend not in ATTENTION_BACKENDS:
        choices = ", ".join(ATTENTION_BACKENDS)
        raise ValueError(f"attention must be one of {choices}, got {backend!r}")
    if backend == "torch":
        return None
    if cache.k.device.type != "cpu" or cache.k.dtype not in KERNEL_POOL_DTYPES:
        if backend == "native":
            raise ValueError(
                f"the native attention kernel runs on the CPU over a float32 or bfloat16 "
                f"cache; this cache is {cache.k.device.type} {cache.k.dtype} (use "
                f"attention auto or torch)"
            )
        return None
    try:
        return NativeKernel(paged_decode_kernel(), cache, threads)
    except KernelUnavailableError as exc:
        if backend == "native":
            raise
        log.warning("native attention kernel unavailable, using the slower torch path: %s", exc)
        return None
