"""The reasons' wording: the small phrases every part of the rule shares, so that a
decision reads the same in the status, the Events, the demo and the simulator."""

from __future__ import annotations

import math

from batchpilot_server.batching_config import BatchingConfig


def ms(seconds: float) -> str:
    return "never" if math.isinf(seconds) else f"{seconds * 1000:.0f} ms"


def knob_change(before: BatchingConfig, after: BatchingConfig) -> str:
    """`batch 8 -> 16, budget 2048 -> 1024, k 4 -> 2`: the knobs that moved."""
    parts = []
    if before.max_batch_size != after.max_batch_size:
        parts.append(f"batch {before.max_batch_size} -> {after.max_batch_size}")
    if before.batch_timeout_ms != after.batch_timeout_ms:
        parts.append(f"timeout {before.batch_timeout_ms:g} -> {after.batch_timeout_ms:g} ms")
    if before.prefill_token_budget != after.prefill_token_budget:
        parts.append(f"budget {before.prefill_token_budget} -> {after.prefill_token_budget}")
    if before.num_speculative_tokens != after.num_speculative_tokens:
        parts.append(f"k {before.num_speculative_tokens} -> {after.num_speculative_tokens}")
    return ", ".join(parts) or "no knob moves"


def action_of(before: BatchingConfig, after: BatchingConfig) -> str:
    """The action name of a change, by the knob it moved first (batch, timeout, budget,
    k)."""
    if after.max_batch_size > before.max_batch_size:
        return "grow_batch"
    if after.max_batch_size < before.max_batch_size:
        return "backoff_batch"
    if after.batch_timeout_ms < before.batch_timeout_ms:
        return "shrink_timeout"
    if after.batch_timeout_ms > before.batch_timeout_ms:
        return "grow_timeout"
    if after.prefill_token_budget != before.prefill_token_budget:
        return "set_budget"
    if after.num_speculative_tokens != before.num_speculative_tokens:
        return "set_speculation"
    return "hold"


def targets(stated: dict[str, float]) -> str:
    return ", ".join(f"{name} {ms(value)}" for name, value in stated.items())
