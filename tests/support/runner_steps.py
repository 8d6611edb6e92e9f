"""Driving the model runner alone, as the engine's step does without the sampler: one
forward over a plan, then `StepPlan.record_computed`, which records what it
computed through each row's `Sequence.advance` (the tests append the tokens they
feed next themselves)."""

from __future__ import annotations

import torch
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan


def step(
    runner: ModelRunner,
    prefill: list[Sequence],
    decode: list[Sequence],
    chunks: list[int] | None = None,
) -> torch.Tensor:
    """The logits of one forward: the prefill rows it completes, then the decode rows."""
    plan = StepPlan(prefill=prefill, decode=decode, chunks=chunks)
    logits = runner.step(plan)
    plan.record_computed()
    return logits


def prefill(
    runner: ModelRunner, seqs: list[Sequence], chunks: list[int] | None = None
) -> torch.Tensor:
    """`step` with prefill rows only: the logits of the rows it completes."""
    return step(runner, seqs, [], chunks)


def decode(runner: ModelRunner, seqs: list[Sequence]) -> torch.Tensor:
    """`step` with decode rows only: logits [len(seqs), vocab]."""
    return step(runner, [], seqs)
