"""Discrete-event simulation of one server: the real schedulers under a virtual clock,
with the tuning loop in the loop.

The engine (`server/engine.py`) runs step after step: its scheduler plans a step
(`schedule(now)`), the model runs it, and the scheduler takes the sampled tokens
back (`postprocess`). The simulator does the same with the same schedulers
(`scheduler_policies.new_scheduler`, ragged execution) over the same
`BlockPool`; only the model is replaced, by a step-time model read from the
engine benchmark (`docs/step_times.json`: seconds per decode step by batch
size): a step's prefill forward over T prompt tokens takes what a decode step
of T rows takes, its decode forward over n rows what a decode step of n rows
takes. Requests are added to the scheduler at their arrival time, as
the engine's `submit` does while the model computes. Every `cadence.interval_s`
one round of the tuning loop runs, with the simulated server as its signal
source (the last window's signals, built like the scrape source builds them)
and actuator (`reconfigure`, as `PUT /admin/batching` does). Time advances from
event to event, so an hour of traffic plays in seconds.

Fast-forward: after a decode-only step in which no sequence finished, the steps
that follow are the same plan again until a sequence finishes, a request could
be admitted, the pool runs short or the interval ends; those steps are applied
together (each sequence's tokens and blocks advanced as the scheduler's decode
plan and `postprocess` would) and the real scheduler plans the next one. A test
replays traces with and without it and compares every completion.
Torch-free.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from batchpilot_operator.signals import (
    MIN_REQUESTS_PER_WINDOW,
    Signals,
    histogram_quantile,
    status_detail,
    traffic_status,
)
from batchpilot_operator.tuner import Cadence, Decision, Goal
from batchpilot_operator.tuning_loop import (
    ActuationReport,
    Applied,
    PlugPoints,
    TuneStep,
    TuningLoop,
)
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.block_pool import BlockPool
from batchpilot_server.engine_api import (
    EngineError,
    EngineOptions,
    QueueFullError,
    SamplingParams,
)
from batchpilot_server.metric_names import LATENCY_BUCKETS
from batchpilot_server.scheduler import Output, StepPlan
from batchpilot_server.scheduler_policies import PolicyOptions, new_scheduler
from batchpilot_server.sequence import Sequence

STEP_TIMES_FILE = Path(__file__).resolve().parent.parent / "docs" / "step_times.json"
BUCKET_BOUNDS = (*LATENCY_BUCKETS, math.inf)
# The engine's block size and prefill budget unless a simulation says otherwise.
ENGINE_DEFAULTS = EngineOptions(mode="continuous", config=BatchingConfig())

# The tiny model's CPU figures, ~0.7k tokens/s at batch 1 and ~6.5k at batch 64
# (a step of 1/700 s and 64/6500 s); used only where bench/engine.py has not
# written docs/step_times.json.
FALLBACK_CURVE = {1: 1 / 700, 64: 64 / 6500}


@dataclass(frozen=True)
class StepCurve:
    """Seconds per decode step by batch size, piecewise linear between points."""

    batch_sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    source: str = "fallback"

    def __post_init__(self) -> None:
        if len(self.batch_sizes) < 2 or len(self.batch_sizes) != len(self.seconds):
            raise ValueError("a step curve needs at least two (batch, seconds) points")

    def step_s(self, batch: int) -> float:
        return _step_s(self, batch)

    @property
    def per_token_s(self) -> float:
        """Marginal cost of one more sequence in a step."""
        xs, ys = self.batch_sizes, self.seconds
        return max(1e-6, (ys[-1] - ys[0]) / (xs[-1] - xs[0]))

    @classmethod
    def from_points(cls, points: dict[int, float], source: str) -> StepCurve:
        pairs = sorted((int(b), float(s)) for b, s in points.items())
        return cls(tuple(b for b, _ in pairs), tuple(s for _, s in pairs), source)

    @classmethod
    def load(cls, path: Path = STEP_TIMES_FILE) -> StepCurve:
        """The measured curve when the engine benchmark wrote one, else built-in figures."""
        if not path.exists():
            return cls.from_points(FALLBACK_CURVE, "fallback: built-in CPU figures")
        data = json.loads(path.read_text())
        return cls.from_points(_find_curve(data, path), f"measured: {path.name}")


@functools.lru_cache(maxsize=4096)
def _step_s(curve: StepCurve, batch: int) -> float:
    # Cached: a simulation asks for the same few batch sizes millions of times.
    xs, ys = curve.batch_sizes, curve.seconds
    if batch >= xs[-1]:  # extrapolate with the last segment's slope
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return ys[-1] + slope * (batch - xs[-1])
    return float(np.interp(batch, xs, ys))


def _find_curve(data: Any, path: Path) -> dict[int, float]:
    """The {batch: seconds} mapping in the file, at the top or one level down."""
    candidates = [data] + [v for v in data.values() if isinstance(v, dict)] if isinstance(
        data, dict
    ) else []
    for candidate in candidates:
        points = {k: v for k, v in candidate.items() if str(k).isdigit()}
        if len(points) >= 2 and all(isinstance(v, int | float) for v in points.values()):
            return {int(k): float(v) for k, v in points.items()}
    raise ValueError(f"{path} holds no {{batch size: seconds}} mapping")


ScenarioKind = Literal["steady", "step", "diurnal", "bursts", "longer_outputs"]


@dataclass(frozen=True)
class Scenario:
    """Traffic over time: Poisson arrivals at `rate(t)`, outputs around `output_mean(t)`."""

    name: ScenarioKind
    duration_s: float
    base_rate: float  # requests/s
    output_tokens: int = 64  # mean; uniform in [mean/4, 7*mean/4]
    prompt_tokens: tuple[int, int] = (16, 128)
    step_at_s: float | None = None  # 3x load step, longer outputs: when it happens

    def rate(self, t: float) -> float:
        if self.name == "step" and self.step_at_s is not None and t >= self.step_at_s:
            return 3.0 * self.base_rate
        if self.name == "diurnal":
            # One "day" per scenario: trough at the start, peak at 2.2x the base mid-way.
            return self.base_rate * (1.0 - 0.6 * math.cos(2 * math.pi * t / self.duration_s))
        if self.name == "bursts" and (t % 300.0) < 30.0:
            return 2.5 * self.base_rate  # 30 s bursts every 5 minutes
        return self.base_rate

    @property
    def rate_max(self) -> float:
        return {"step": 3.0, "diurnal": 1.6, "bursts": 2.5}.get(self.name, 1.0) * self.base_rate

    def output_mean(self, t: float) -> int:
        if self.name == "longer_outputs" and self.step_at_s is not None and t >= self.step_at_s:
            return round(1.5 * self.output_tokens)
        return self.output_tokens


@dataclass(frozen=True)
class Workload:
    arrivals: np.ndarray  # seconds, ascending
    prompts: np.ndarray  # tokens
    outputs: np.ndarray  # tokens


def make_workload(scenario: Scenario, seed: int) -> Workload:
    """Non-homogeneous Poisson arrivals by thinning; lengths drawn per request."""
    rng = np.random.default_rng(seed)
    n_max = int(scenario.rate_max * scenario.duration_s * 1.2) + 100
    gaps = rng.exponential(1.0 / scenario.rate_max, n_max)
    times = np.cumsum(gaps)
    times = times[times < scenario.duration_s]
    rates = np.array([scenario.rate(t) for t in times])
    times = times[rng.random(len(times)) < rates / scenario.rate_max]
    means = np.array([scenario.output_mean(t) for t in times])
    outputs = np.maximum(1, np.round(means * rng.uniform(0.25, 1.75, len(times)))).astype(int)
    low, high = scenario.prompt_tokens
    prompts = rng.integers(low, high + 1, len(times))
    return Workload(times, prompts, outputs)


@dataclass(frozen=True)
class SimOptions:
    mode: Mode
    config: BatchingConfig
    goal: Goal
    cadence: Cadence = field(default_factory=Cadence)
    kv_blocks: int = 4096
    block_size: int = ENGINE_DEFAULTS.block_size
    prefill_budget: int = ENGINE_DEFAULTS.prefill_token_budget
    tune: bool = True
    fast_forward: bool = True
    trace: bool = False  # keep every step's batch size and every completion's step


@dataclass
class Interval:
    """What one tuning interval saw, and what the tuner did at its end."""

    end_s: float
    completed: int = 0
    good: int = 0
    rejected: int = 0
    latencies: list[float] = field(default_factory=list)
    queue_waits: list[float] = field(default_factory=list)
    tokens: int = 0
    preemptions: int = 0
    batch_weighted: float = 0.0  # sum of the batch sizes the engine records (per step or batch)
    batch_count: float = 0.0
    kv_max: float = 0.0
    waiting_at_end: int = 0
    config: BatchingConfig | None = None  # in force during the interval
    p99_s: float | None = None
    decision: Decision | None = None


@dataclass(frozen=True)
class Completion:
    request: int  # index into the workload
    at_s: float
    step: int  # the engine step whose end completed it


@dataclass
class SimResult:
    intervals: list[Interval]
    completed: int
    good: int
    rejected: int
    arrived: int
    duration_s: float
    p99_s: float | None
    completions: list[Completion]  # in completion order (`trace` only)
    batch_sizes: list[int]  # what each recording step records (`trace` only)

    @property
    def goodput(self) -> float:
        """Requests per second that finished within the SLO."""
        return self.good / self.duration_s


SAMPLED_TOKEN = 0  # what the model "samples": never an EOS (the simulated server has none)


class SimulatedServer:
    """One server's scheduler and pool under a virtual clock; the tuning loop's signal
    source and actuator."""

    def __init__(self, work: Workload, options: SimOptions, curve: StepCurve) -> None:
        self.work = work
        self.opt = options
        self.curve = curve
        self.pool = BlockPool(options.kv_blocks, options.block_size)
        # The engine's policy for the mode; no EOS: requests end at max_tokens.
        policy = PolicyOptions(prefill_budget=options.prefill_budget)
        self.scheduler = new_scheduler(
            options.mode, self.pool, options.config, frozenset(), policy
        )
        self.now = 0.0
        self.next_arrival = 0
        self.sequences: dict[Sequence, int] = {}  # admitted -> request index
        self.intervals: list[Interval] = []
        self.current = Interval(end_s=options.cadence.interval_s, config=options.config)
        self.all_latencies: list[float] = []
        self.rejected = 0
        self.completions: list[Completion] = []
        self.batch_sizes: list[int] = []
        self.loop = TuningLoop(clock=lambda: self.now)
        self.plugs = PlugPoints(source=self, actuator=self, recorder=self.record)

    # -- the tuning loop's plug points --------------------------------------------

    async def read(self, window_s: float) -> Signals:
        """Signals over the last window, built like the scrape source builds them."""
        interval_s = self.opt.cadence.interval_s
        window = self.intervals[-max(1, round(window_s / interval_s)) :]
        window_s = len(window) * interval_s
        requests = sum(iv.completed for iv in window)
        waiting = float(window[-1].waiting_at_end)
        status = traffic_status(requests, waiting)
        if status != "ok":
            return Signals(
                status=status,
                window_s=window_s,
                requests=requests,
                waiting=waiting,
                detail=status_detail(status, requests, MIN_REQUESTS_PER_WINDOW),
            )
        batches = sum(iv.batch_count for iv in window)
        return Signals(
            status="ok",
            window_s=window_s,
            requests=requests,
            request_rate=requests / window_s,
            p99_latency_s=_bucket_p99([x for iv in window for x in iv.latencies]),
            queue_wait_p99_s=_bucket_p99([x for iv in window for x in iv.queue_waits]),
            kv_usage=max(iv.kv_max for iv in window),
            waiting=waiting,
            preemption_rate=sum(iv.preemptions for iv in window) / window_s,
            tokens_per_s=sum(iv.tokens for iv in window) / window_s,
            mean_batch_size=(sum(iv.batch_weighted for iv in window) / batches)
            if batches
            else None,
        )

    async def in_force(self) -> BatchingConfig:
        return self.scheduler.config

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        self.scheduler.reconfigure(config)  # from the next step on, as the engine does
        return ActuationReport(applied=[Applied("simulated server", None)])

    async def resync(self, config: BatchingConfig) -> ActuationReport:
        return ActuationReport()  # one server, always in line

    def record(self, step: TuneStep) -> None:
        self.intervals[-1].decision = step.decision

    # -- the engine's loop --------------------------------------------------------

    async def run(self, until_s: float) -> None:
        """Step the scheduler until `until_s` (virtual seconds)."""
        while self.now < until_s:
            self._take_arrivals(self.now)
            plan = self.scheduler.schedule(self.now)
            self._deliver(plan.ended, self.now)
            if not plan.size:
                await self._advance_to(min(self._next_event(), until_s))
                continue
            await self._step(plan)

    def _next_event(self) -> float:
        """When an idle scheduler may plan again: its own wake-up, the next arrival, the
        next interval's end (a round may change the config)."""
        wake = self.scheduler.wake_at()
        events = [self._arrival_time(), self.current.end_s]
        return max(self.now, min(events if wake is None else [*events, wake]))

    async def _step(self, plan: StepPlan) -> None:
        self._observe(plan)
        rows = _compute(plan)
        end = self.now + self._step_s(plan)
        await self._advance_to(end)  # arrivals and rounds while the model computes
        outputs = self.scheduler.postprocess(
            rows, [SAMPLED_TOKEN] * len(rows), [0.0] * len(rows), end
        )
        self._deliver(outputs, end)
        if self.opt.fast_forward:
            await self._fast_forward([seq for seq in rows if seq.finish_reason is None])

    def _step_s(self, plan: StepPlan) -> float:
        seconds = 0.0
        if plan.prefill:
            chunks = plan.chunks or [seq.num_uncomputed for seq in plan.prefill]
            seconds += self.curve.step_s(sum(chunks))
        if plan.decode:
            seconds += self.curve.step_s(len(plan.decode))
        return seconds

    def _observe(self, plan: StepPlan) -> None:
        """What the engine's observer records for a step."""
        iv = self.current
        iv.preemptions += len(plan.preempted)
        for seq in plan.first_scheduled:
            iv.queue_waits.append((seq.first_scheduled or seq.arrival) - seq.arrival)
        if plan.batch_size:
            self._record_batches(plan.batch_size, 1)
        iv.kv_max = max(iv.kv_max, self.pool.usage_ratio)

    def _record_batches(self, size: int, count: int) -> None:
        self.current.batch_weighted += size * count
        self.current.batch_count += count
        if self.opt.trace:
            self.batch_sizes += [size] * count

    async def _fast_forward(self, decode: list[Sequence]) -> None:
        """The next steps, applied at once where each would decode exactly `decode` (the
        rows that sampled and go on) and finish none of them (module docstring)."""
        if not decode or (
            # continuous: every running sequence decodes next (none waits for a chunk)
            self.opt.mode == "continuous" and len(decode) != self.scheduler.num_running
        ):
            return
        steps = self._repeats(decode)
        if steps <= 0:
            return
        for seq in decode:
            self.pool.grow(seq.block_table, seq.num_tokens + steps - 1)
            seq.token_ids += [SAMPLED_TOKEN] * steps
            seq.num_computed = seq.num_tokens - 1
        self.scheduler.steps += steps
        if self.opt.mode == "continuous":  # each continuous step records its rows
            self._record_batches(len(decode), steps)
        await self._advance_to(self.now + steps * self.curve.step_s(len(decode)))
        self.current.kv_max = max(self.current.kv_max, self.pool.usage_ratio)

    def _repeats(self, decode: list[Sequence]) -> int:
        """How many of the next steps plan exactly `decode` again and finish nothing."""
        step_s = self.curve.step_s(len(decode))
        limit = min(seq.params.max_tokens - seq.num_output for seq in decode) - 1
        until = [self.current.end_s]
        if self.opt.mode == "continuous":
            if self._may_admit():
                return 0
            if not self.scheduler.num_waiting:  # an arrival would be admitted
                until.append(self._arrival_time())
        for at in until:
            if at < math.inf:  # steps that start before `at`
                limit = min(limit, math.ceil((at - self.now) / step_s))
        if self.opt.mode == "continuous":
            limit = self._blocks_allow(decode, limit)
        return limit

    def _may_admit(self) -> bool:
        """Whether the continuous scheduler's next plan admits the head of the queue."""
        scheduler = self.scheduler
        if not scheduler.num_waiting or scheduler.num_running >= scheduler.config.max_batch_size:
            return False
        head = scheduler.waiting[0]
        return self.pool.can_hold(head.block_table, head.num_tokens + 1)

    def _blocks_allow(self, decode: list[Sequence], steps: int) -> int:
        """The most steps (<= `steps`) the pool has blocks for without a preemption."""

        def needed(k: int) -> int:
            size = self.pool.block_size
            return sum(
                -(-(seq.num_tokens + k - 1) // size) - len(seq.block_table) for seq in decode
            )

        if steps <= 0 or needed(steps) <= self.pool.num_free:
            return steps
        low, high = 0, steps
        while low < high:
            mid = (low + high + 1) // 2
            if needed(mid) <= self.pool.num_free:
                low = mid
            else:
                high = mid - 1
        return low

    # -- arrivals, completions, rounds ----------------------------------------------

    def _arrival_time(self) -> float:
        if self.next_arrival < len(self.work.arrivals):
            return float(self.work.arrivals[self.next_arrival])
        return math.inf

    def _take_arrivals(self, until: float) -> None:
        """Submit every request that arrived by `until`, in order."""
        while self._arrival_time() <= until:
            index = self.next_arrival
            self.next_arrival += 1
            seq = Sequence(
                request_id=str(index),
                prompt_ids=[0] * int(self.work.prompts[index]),
                params=SamplingParams(max_tokens=int(self.work.outputs[index]), ignore_eos=True),
                arrival=float(self.work.arrivals[index]),
                deadline=None,
                generator=None,
            )
            try:
                self.scheduler.add(seq)
            except QueueFullError:
                self.current.rejected += 1
                self.rejected += 1
                continue
            self.sequences[seq] = index

    def _deliver(self, outputs: list[Output], at: float) -> None:
        for output in outputs:
            if not output.final:
                continue
            index = self.sequences.pop(output.seq)
            if isinstance(output.item, EngineError):  # the engine ended it unserved
                self.current.rejected += 1
                self.rejected += 1
                continue
            latency = at - output.seq.arrival
            iv = self.current
            iv.completed += 1
            iv.good += latency <= self.opt.goal.slo.p99_latency_s
            iv.latencies.append(latency)
            iv.tokens += output.seq.num_output
            self.all_latencies.append(latency)
            if self.opt.trace:
                self.completions.append(Completion(index, at, output.item.step))

    async def _advance_to(self, t: float) -> None:
        """Move the clock to `t`, submitting arrivals and running a round at every
        interval's end on the way."""
        while self.current.end_s <= t:
            self._take_arrivals(self.current.end_s)
            self.now = self.current.end_s
            await self._close_interval()
        self._take_arrivals(t)
        self.now = t

    async def _close_interval(self) -> None:
        iv = self.current
        iv.waiting_at_end = self.scheduler.num_waiting
        iv.p99_s = float(np.percentile(iv.latencies, 99)) if iv.latencies else None
        self.intervals.append(iv)
        if self.opt.tune:
            await self.loop.round(self.opt.goal, self.opt.cadence, self.plugs)
        self.current = Interval(
            end_s=iv.end_s + self.opt.cadence.interval_s,
            config=self.scheduler.config,
            kv_max=self.pool.usage_ratio,
        )


def _compute(plan: StepPlan) -> list[Sequence]:
    """What the model runner does to a plan's rows (their K/V computed); the rows that
    sample a token."""
    chunks = plan.chunks or [seq.num_uncomputed for seq in plan.prefill]
    for seq, size in zip(plan.prefill, chunks, strict=True):
        seq.num_computed += size
    for seq in plan.decode:
        seq.num_computed = seq.num_tokens
    return [seq for seq in (*plan.prefill, *plan.decode) if seq.ready_to_sample]


def _bucket_p99(values: list[float]) -> float | None:
    if not values:
        return None
    counts = np.searchsorted(np.asarray(LATENCY_BUCKETS), np.asarray(values), side="left")
    cumulative = np.cumsum(np.bincount(counts, minlength=len(BUCKET_BOUNDS)))
    return histogram_quantile(0.99, BUCKET_BOUNDS, cumulative.tolist())


def simulate(
    scenario: Scenario,
    options: SimOptions,
    curve: StepCurve,
    seed: int = 0,
    drain_s: float = 0.0,
) -> SimResult:
    """Play `scenario` once; the tuning loop runs every interval when `options.tune`.

    `drain_s` keeps the server running that long after the last arrival window.
    """
    work = make_workload(scenario, seed)
    return simulate_workload(work, options, curve, scenario.duration_s + drain_s)


def simulate_workload(
    work: Workload, options: SimOptions, curve: StepCurve, run_s: float
) -> SimResult:
    server = SimulatedServer(work, options, curve)
    asyncio.run(server.run(run_s))
    # Requests still queued or running at the end count as not good.
    ended = [*server.intervals, server.current]
    latencies = server.all_latencies
    return SimResult(
        intervals=server.intervals,
        completed=sum(iv.completed for iv in ended),
        good=sum(iv.good for iv in ended),
        rejected=server.rejected,
        arrived=len(work.arrivals),
        duration_s=run_s,
        p99_s=float(np.percentile(latencies, 99)) if latencies else None,
        completions=server.completions,
        batch_sizes=server.batch_sizes,
    )


def static(options: SimOptions, config: BatchingConfig) -> SimOptions:
    """The same run with a fixed config and no tuner."""
    return replace(options, config=config, tune=False)
