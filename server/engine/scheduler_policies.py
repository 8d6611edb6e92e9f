"""The scheduler a batching mode names, with the options each policy takes.

Torch-free: the engine and the simulator (tools/simulator.py) build their schedulers here."""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.ngram_proposer import Proposer, propose
from batchpilot_server.engine.scheduler import QueueScheduler
from batchpilot_server.engine.scheduler_continuous import ContinuousScheduler
from batchpilot_server.engine.scheduler_dynamic import DynamicScheduler, StaticScheduler
from batchpilot_server.engine_api import CLASS_MAX_WAIT_S, LOWER_CLASS_PREFILL_TOKENS


@dataclass(frozen=True)
class PolicyOptions:
    padded: bool = False  # static and dynamic: padded execution instead of ragged
    max_wait_s: float | None = None  # static: the safety valve (None: off)
    # every mode: a request this old ranks above every SLO class (scheduler.class_rank)
    class_max_wait_s: float = CLASS_MAX_WAIT_S
    # continuous: the lower classes' prompt tokens in a step that decodes a higher class
    lower_class_prefill_tokens: int = LOWER_CLASS_PREFILL_TOKENS
    # continuous: speculative decoding's drafts (n-gram prompt lookup; the simulator's stand-in)
    proposer: Proposer = propose


def new_scheduler(
    mode: Mode,
    pool: BlockPool,
    config: BatchingConfig,
    eos_ids: frozenset[int],
    options: PolicyOptions = PolicyOptions(),
) -> QueueScheduler:
    wait = options.class_max_wait_s
    if mode == "static":
        return StaticScheduler(pool, config, eos_ids, options.padded, options.max_wait_s, wait)
    if mode == "dynamic":
        return DynamicScheduler(pool, config, eos_ids, options.padded, wait)
    if mode == "continuous":
        return ContinuousScheduler(
            pool, config, eos_ids, wait, options.lower_class_prefill_tokens, options.proposer
        )
    raise ValueError(f"mode must be one of static, dynamic, continuous; got {mode!r}")
