"""What the engine benchmarks measure on any model: the bare model loop (the
ceiling: one batched prefill, then greedy decode steps over contiguous K/V, no
scheduler, no streams) and the engine at saturation doing the same work."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.core import Engine, RequestStream
from batchpilot_server.engine.models import Decoder, ModelSpec
from batchpilot_server.engine_api import SamplingParams


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


class Timer:
    """Wall and process CPU time since creation, as a `Rate` of `tokens`."""

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def rate(self, tokens: int) -> Rate:
        return Rate(tokens, time.perf_counter() - self.wall, time.process_time() - self.cpu)


@dataclass(frozen=True)
class Prompts:
    """Random prompts of `length` tokens: `first` (a BOS), if any, then ids below `vocab`.
    Seeded, so every side of a comparison reads the same prompts."""

    length: int
    vocab: int
    first: int | None

    def draw(self, count: int, seed: int) -> list[list[int]]:
        rng = np.random.default_rng(seed)
        head = [] if self.first is None else [self.first]
        body = self.length - len(head)
        return [[*head, *rng.integers(0, self.vocab, body).tolist()] for _ in range(count)]


class ContiguousKV:
    """The raw loop's cache: [layers, batch, kv_heads, capacity, head_dim] per K and V,
    in the model's dtype; query head h reads KV head h // (n_heads // n_kv_heads)."""

    def __init__(
        self, spec: ModelSpec, batch: int, capacity: int, dtype: torch.dtype = torch.float32
    ) -> None:
        shape = (spec.n_layers, batch, spec.n_kv_heads, capacity, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.grouped = spec.n_heads != spec.n_kv_heads
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
            enable_gqa=self.grouped,
        )
        return out.transpose(1, 2)


def model_dtype(model: Decoder) -> torch.dtype:
    return model.dtype


@torch.inference_mode()
def raw_generate(model: Decoder, prompts: Prompts, batch: int, tokens: int) -> Rate:
    """The bare loop: one batched prefill, then greedy decode steps."""
    cache = ContiguousKV(model.spec, batch, prompts.length + tokens, model_dtype(model))
    ids = torch.tensor(prompts.draw(batch, seed=batch))
    positions = torch.arange(prompts.length).expand(batch, -1)
    timer = Timer()
    next_ids = model.logits(model.hidden(ids, positions, cache)[:, -1]).argmax(-1)
    cache.length = prompts.length
    for _ in range(tokens - 1):
        next_ids = decode_step(model, cache, next_ids)
    return timer.rate(batch * tokens)


def decode_step(model: Decoder, cache: ContiguousKV, ids: torch.Tensor) -> torch.Tensor:
    position = torch.full((ids.shape[0], 1), cache.length)
    hidden = model.hidden(ids[:, None], position, cache)
    cache.length += 1
    return model.logits(hidden[:, 0]).argmax(-1)


async def count_tokens(stream: RequestStream) -> int:
    return sum([1 async for _ in stream])


async def saturated(
    engine: Engine, prompts: Prompts, batch: int, tokens: int, waves: int = 2
) -> Rate:
    """The engine's rate with `waves * batch` requests queued at once, greedy."""
    config = engine.config
    engine.reconfigure(BatchingConfig(batch, 0.0, max(config.max_queue_size, waves * batch)))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    timer = Timer()
    streams = [engine.submit(p, params) for p in prompts.draw(waves * batch, seed=batch)]
    produced = sum(await asyncio.gather(*(count_tokens(s) for s in streams)))
    return timer.rate(produced)
