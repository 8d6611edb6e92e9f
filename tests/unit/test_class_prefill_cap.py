"""Continuous mode: in a step that decodes a higher class's requests, the lower classes'
prompts compute at most `lower_class_prefill_tokens` together (their chunks would lengthen
the step every higher-class decode row waits for), never none, and an aged request is not
held to it; with one class nothing changes.

The real scheduler (built by `new_scheduler`, as the engine and the simulator build it)
and real sequences, under a virtual clock; no model."""

from __future__ import annotations

from dataclasses import replace

import pytest
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.scheduler import QueueScheduler
from batchpilot_server.engine.scheduler_continuous import ContinuousScheduler
from batchpilot_server.engine.scheduler_policies import PolicyOptions, new_scheduler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import LOWER_CLASS_PREFILL_TOKENS, SamplingParams
from batchpilot_server.serve_options import UsageError, batching_config, engine_options, parser
from batchpilot_tools.simulator import SimOptions

from tests.support.scheduler_steps import BLOCK, CONFIG, EOS, run

LOW, MID, HIGH = -5, 0, 10
CAP = 8


def scheduler(*, cap: int = CAP, budget: int = 2048, max_wait_s: float = 30.0) -> QueueScheduler:
    config = replace(CONFIG, max_batch_size=8, prefill_token_budget=budget)
    options = PolicyOptions(class_max_wait_s=max_wait_s, lower_class_prefill_tokens=cap)
    return new_scheduler("continuous", BlockPool(256, BLOCK), config, frozenset({EOS}), options)


def request(name: str, priority: int, arrival: float, prompt: int = 10) -> Sequence:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    return Sequence(name, [1] * prompt, params, arrival, None, None, priority=priority)


def decoding(sched: QueueScheduler, name: str, priority: int, arrival: float) -> Sequence:
    """A request of `priority` past its prompt: the next step decodes it."""
    seq = request(name, priority, arrival)
    sched.add(seq)
    plan, _ = run(sched, arrival + 0.1)
    assert plan.prefill == [seq] and seq.num_output == 1
    return seq


def chunks(plan: StepPlan) -> list[tuple[str, int]]:
    return [
        (seq.request_id, size) for seq, size in zip(plan.prefill, plan.chunk_sizes(), strict=True)
    ]


def test_lower_class_prompts_beside_a_higher_class_decode_share_the_cap() -> None:
    """Every class below the decoding one shares the cap, in rank order; one the cap left
    nothing for is not admitted (it would hold blocks and compute nothing); each step the
    cap goes on, so the lower class's prompt still progresses."""
    sched = scheduler()
    high = decoding(sched, "high", HIGH, 0.0)
    for seq in (request("mid", MID, 1.0, prompt=5), request("low", LOW, 1.0, prompt=100)):
        sched.add(seq)
    plan, _ = run(sched, 2.0)
    assert plan.decode == [high] and chunks(plan) == [("mid", 5), ("low", 3)]
    for step in range(3):
        plan, _ = run(sched, 3.0 + step)
        assert chunks(plan) == [("low", CAP)]
    sched.add(request("low2", LOW, 6.0, prompt=100))
    plan, _ = run(sched, 7.0)
    assert chunks(plan) == [("low", CAP)] and [s.request_id for s in sched.waiting] == ["low2"]


def test_a_higher_class_prompt_takes_the_budget_first_and_is_not_capped() -> None:
    sched = scheduler(budget=64)
    decoding(sched, "high", HIGH, 0.0)
    sched.add(request("low", LOW, 1.0, prompt=100))
    sched.add(request("high2", HIGH, 1.0, prompt=60))
    plan, _ = run(sched, 2.0)
    assert chunks(plan) == [("high2", 60), ("low", 4)]  # the budget bounds it below the cap


@pytest.mark.parametrize(
    "beside", [None, LOW, HIGH], ids=["alone", "its own class decoding", "a lower class decoding"]
)
def test_a_prompt_not_below_the_decoding_classes_gets_the_whole_budget(
    beside: int | None,
) -> None:
    sched = scheduler(budget=64)
    priority = HIGH if beside == LOW else LOW
    if beside is not None:
        other = LOW if beside == LOW else priority
        decoding(sched, "other", other, 0.0)
    sched.add(request("prompt", priority, 1.0, prompt=100))
    plan, _ = run(sched, 2.0)
    assert chunks(plan) == [("prompt", 64)]
    assert len(plan.decode) == (beside is not None)


def test_an_aged_prompt_is_not_capped() -> None:
    """A request `class_max_wait_s` old ranks above every class (the age bound): its
    prompt is computed at the budget's pace whatever decodes beside it."""
    sched = scheduler(budget=64, max_wait_s=5.0)
    decoding(sched, "high", HIGH, 0.0)
    low = request("low", LOW, 1.0, prompt=200)
    sched.add(low)
    plan, _ = run(sched, 2.0)
    assert chunks(plan) == [("low", CAP)]
    plan, _ = run(sched, 6.0)  # low arrived 5 s ago
    assert chunks(plan) == [("low", 64)] and low.num_computed == CAP + 64


def _plans(cap: int) -> list[tuple[list[tuple[str, int]], list[str]]]:
    """One class throughout: long and short prompts arriving while others decode."""
    sched = scheduler(cap=cap, budget=48)
    out = []
    for step in range(40):
        if step % 3 == 0:
            sched.add(request(f"r{step}", MID, step * 0.1, prompt=10 + 37 * (step % 4)))
        plan, _ = run(sched, step * 0.1 + 0.05)
        out.append((chunks(plan), [seq.request_id for seq in plan.decode]))
    return out


def test_with_one_class_the_plans_are_the_uncapped_ones() -> None:
    plans = _plans(1)
    assert any(c and d for c, d in plans)  # prompt chunks beside decode rows
    assert plans == _plans(10**9)


def test_the_flag_reaches_the_engine_and_the_simulator_defaults_to_the_server() -> None:
    args = parser().parse_args([])
    assert engine_options(args, batching_config(args)).lower_class_prefill_tokens == 32
    assert LOWER_CLASS_PREFILL_TOKENS == 32
    args = parser().parse_args(["--lower-class-prefill-tokens", "128"])
    assert engine_options(args, batching_config(args)).lower_class_prefill_tokens == 128
    assert SimOptions.__dataclass_fields__["lower_class_prefill_tokens"].default == 32


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_cap_below_one_is_refused(value: str) -> None:
    """None would stop a lower class's prompt while a higher class decodes."""
    args = parser().parse_args(["--lower-class-prefill-tokens", value])
    with pytest.raises(UsageError, match="--lower-class-prefill-tokens must be at least 1"):
        engine_options(args, batching_config(args))
    with pytest.raises(ValueError, match="lower_class_prefill_tokens"):
        ContinuousScheduler(BlockPool(4, BLOCK), CONFIG, frozenset(), 30.0, int(value))
