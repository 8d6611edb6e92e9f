"""The batching policies under a virtual clock: batchpilot's own schedulers
(`scheduler_policies.new_scheduler`) driven through a request trace, each step
costing what the same forward measured on the real model (`StepCost.measure`).

The grid of bench/tradeoff.py needs hundreds of policy x workload runs of
thousands of steps each; in real time that is hours on a shared 2-core machine,
and one run's noise would decide a cell. Here a run takes a second, the
scheduling decisions are the engine's own, and only the step times are a model:
a decode forward's time by its row count and a prefill forward's by its
rectangle (rows x longest row), both measured here on the real model. Real-clock
runs of the same traces through the real engine check the model
(bench/tradeoff.py `validate`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.scheduler_policies import PolicyOptions, new_scheduler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import SamplingParams

BLOCK = 16


@dataclass(frozen=True)
class Policy:
    name: str  # as tables and the map show it
    mode: Mode
    padded: bool = False


POLICIES = (
    Policy("static", "static"),
    Policy("dynamic", "dynamic"),
    Policy("dynamic-padded", "dynamic", padded=True),
    Policy("continuous", "continuous"),
)


@dataclass(frozen=True)
class Arrival:
    at_s: float
    prompt_len: int
    output_len: int


# output-length spreads, every one of mean about MEAN_OUTPUT tokens
MEAN_OUTPUT = 64
SPREADS = ("equal", "uniform", "heavy")


def output_length(spread: str, rng: np.random.Generator) -> int:
    if spread == "equal":
        return MEAN_OUTPUT
    if spread == "uniform":
        return int(rng.integers(MEAN_OUTPUT // 4, MEAN_OUTPUT * 7 // 4 + 1))
    # log-normal, sigma 1: a median of 39 tokens, one request in 20 past 200
    return int(np.clip(rng.lognormal(np.log(MEAN_OUTPUT * 0.61), 1.0), 2, 8 * MEAN_OUTPUT))


def arrivals(rate: float, spread: str, prompt_len: int, seed: int) -> Iterator[Arrival]:
    """Poisson arrivals without end; prompts uniform in [prompt_len/2, 3 prompt_len/2]."""
    rng = np.random.default_rng(seed)
    now = 0.0
    while True:
        now += rng.exponential(1.0 / rate)
        prompt = int(rng.integers(max(1, prompt_len // 2), prompt_len * 3 // 2 + 1))
        yield Arrival(now, prompt, output_length(spread, rng))


@dataclass(frozen=True)
class StepCost:
    """Seconds per forward on the real model: decode by rows (piecewise linear between
    measured batch sizes), prefill by rectangle positions (a least-squares line)."""

    decode_rows: tuple[int, ...]
    decode_s: tuple[float, ...]
    prefill_base_s: float
    prefill_per_token_s: float
    kv_bytes_per_token: int  # the model's K and V for one token in the engine's CPU cache

    def decode(self, rows: int) -> float:
        return float(np.interp(rows, self.decode_rows, self.decode_s, right=None))

    def prefill(self, positions: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * positions

    def step(self, plan: StepPlan) -> float:
        seconds = 0.0
        if plan.prefill:
            widths = plan.chunks or [seq.num_uncomputed for seq in plan.prefill]
            seconds += self.prefill(len(widths) * max(widths))
        if plan.decode or plan.pad:
            seconds += self.decode(len(plan.decode) + len(plan.pad))
        return seconds

    @classmethod
    def measure(
        cls,
        source: str,
        rows: tuple[int, ...],
        rectangles: tuple[tuple[int, int], ...],
        context: int,
    ) -> StepCost:
        """Best of a few forwards per shape through the engine's ModelRunner and paged
        cache, interleaved over rounds (the machine is shared: load only slows a run)."""
        import torch
        from batchpilot_server.engine.kv_cache import KVCache, bytes_per_block
        from batchpilot_server.engine.model_runner import ModelRunner
        from batchpilot_server.engine.weights import load_model

        loaded = load_model(source, device="cpu", dtype="float32")
        width = max(max(w for _, w in rectangles), context + 1)
        seqs_needed = max(max(rows), max(r for r, _ in rectangles))
        cache = KVCache(loaded.spec, seqs_needed * (-(-width // BLOCK)) + 1, BLOCK, "cpu")
        runner = ModelRunner(loaded.model, cache, threads=torch.get_num_threads())

        def seqs(count: int, length: int) -> list[Sequence]:
            made = [
                Sequence(str(n), [1] * length, SamplingParams(1), 0.0, None, None)
                for n in range(count)
            ]
            for seq in made:
                cache.pool.grow(seq.block_table, length)
            return made

        def timed(run: object) -> float:
            start = time.perf_counter()
            run()  # type: ignore[operator]
            return time.perf_counter() - start

        best_decode = dict.fromkeys(rows, float("inf"))
        best_prefill = dict.fromkeys(rectangles, float("inf"))
        for _ in range(3):
            for count in rows:
                batch = seqs(count, context)
                runner.step(StepPlan(decode=batch))
                best_decode[count] = min(
                    best_decode[count], timed(lambda b=batch: runner.step(StepPlan(decode=b)))
                )
                for seq in batch:
                    cache.pool.release(seq.block_table)
            for count, length in rectangles:
                batch = seqs(count, length)
                best_prefill[(count, length)] = min(
                    best_prefill[(count, length)],
                    timed(lambda b=batch: runner.step(StepPlan(prefill=b))),
                )
                for seq in batch:
                    cache.pool.release(seq.block_table)
        positions = np.array([c * w for c, w in rectangles], float)
        slope, base = np.polyfit(positions, [best_prefill[r] for r in rectangles], 1)
        return cls(
            tuple(rows),
            tuple(best_decode[r] for r in rows),
            max(float(base), 0.0),
            float(slope),
            bytes_per_block(loaded.spec, BLOCK, torch.float32) // BLOCK,
        )


@dataclass
class Record:
    arrival_s: float
    output_len: int
    first_token_s: float | None = None
    done_s: float | None = None
    held_s: float = 0.0


@dataclass
class RunResult:
    records: list[Record]
    busy_s: float
    span_s: float
    slot_steps: dict[str, int] = field(default_factory=dict)
    peak_kv_blocks: int = 0


def simulate(
    policy: Policy,
    trace: Iterator[Arrival],
    window_s: float,
    config: BatchingConfig,
    cost: StepCost,
    kv_blocks: int,
    prefill_budget: int = 2048,
) -> RunResult:
    """Run until every request arriving in [0, window_s) completed; requests keep
    arriving meanwhile (a static batch fills with later arrivals, as it would)."""
    pool = BlockPool(kv_blocks, BLOCK)
    options = PolicyOptions(padded=policy.padded)
    config = replace(config, prefill_token_budget=prefill_budget)
    scheduler = new_scheduler(policy.mode, pool, config, frozenset(), options)
    records: dict[Sequence, Record] = {}
    measured: list[Record] = []
    slots = {"active": 0, "finished": 0, "padding": 0}
    now = busy = 0.0
    peak = 0
    pending = next(trace)
    for n in itertools.count():
        if measured and all(r.done_s is not None for r in measured) and pending.at_s >= window_s:
            break
        while pending.at_s <= now:
            seq = Sequence(
                str(n),
                [1] * pending.prompt_len,
                SamplingParams(pending.output_len, ignore_eos=True),
                pending.at_s,
                None,
                None,
            )
            records[seq] = Record(pending.at_s, pending.output_len)
            if pending.at_s < window_s:
                measured.append(records[seq])
            scheduler.add(seq)
            pending = next(trace)
        plan = scheduler.schedule(now)
        if not plan.size:
            wake = scheduler.wake_at()
            now = max(now, min(pending.at_s, wake if wake is not None else pending.at_s))
            continue
        counted = plan.slot_steps()
        for state in slots:
            slots[state] += getattr(counted, state)
        peak = max(peak, pool.num_used)
        seconds = cost.step(plan)
        now += seconds
        busy += seconds
        rows = plan.sampling()
        for output in scheduler.postprocess(plan, [7] * len(rows), [0.0] * len(rows), now):
            record = records[output.seq]
            if record.first_token_s is None:
                record.first_token_s = now
            if output.final:
                record.done_s = now
                record.held_s = output.held_s or 0.0
                del records[output.seq]
    first = min(r.arrival_s for r in measured)
    span = max(r.done_s or 0.0 for r in measured) - first
    return RunResult(measured, busy, span, slots, peak)


@dataclass(frozen=True)
class Figures:
    """What a run gives a cell of the map."""

    tokens_per_s: float
    p50_s: float
    p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    per_token_p99_s: float  # latency / output tokens: the SLO's measure
    hostage_mean_s: float
    hostage_p99_s: float
    slot_waste: float  # finished + padding over all slot-steps
    padding_share: float
    idle_share: float  # time no step ran, over the span
    peak_kv_blocks: int

    @classmethod
    def of(cls, run: RunResult) -> Figures:
        records = run.records
        latency = np.array([r.done_s - r.arrival_s for r in records])  # type: ignore[operator]
        ttft = np.array([r.first_token_s - r.arrival_s for r in records])  # type: ignore[operator]
        tokens = np.array([r.output_len for r in records])
        held = np.array([r.held_s for r in records])
        total = sum(run.slot_steps.values()) or 1
        return cls(
            tokens_per_s=float(tokens.sum() / run.span_s),
            p50_s=float(np.percentile(latency, 50)),
            p99_s=float(np.percentile(latency, 99)),
            ttft_p50_s=float(np.percentile(ttft, 50)),
            ttft_p99_s=float(np.percentile(ttft, 99)),
            per_token_p99_s=float(np.percentile(latency / tokens, 99)),
            hostage_mean_s=float(held.mean()),
            hostage_p99_s=float(np.percentile(held, 99)),
            slot_waste=(run.slot_steps["finished"] + run.slot_steps["padding"]) / total,
            padding_share=run.slot_steps["padding"] / total,
            idle_share=max(0.0, 1.0 - run.busy_s / run.span_s),
            peak_kv_blocks=run.peak_kv_blocks,
        )
