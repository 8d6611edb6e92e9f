"""Discrete-event simulator of one server, with the real tuner in the loop.

It plays a scenario (arrival rate and output lengths over time) against a
model of the engine in either mode, driven by a step-time curve (measured
seconds per decode step by batch size, `docs/step_times.json`), and every
`interval_s` builds `Signals` from the last window the same way the real
sources do (p99 read from the shared latency buckets) and calls
`tuner.decide`. Time advances from event to event (arrival, completion,
batch end, tick), so an hour of traffic plays in seconds.

Engine model (DESIGN "Engine semantics"):
- dynamic: a batch fires when `max_batch_size` requests wait or the oldest
  has waited `batch_timeout_ms`; it reserves KV for prompt + output of every
  member up front (cut smaller if it would not fit), decodes until its
  longest member ends, and every member completes at that moment.
- continuous: each step admits waiting requests while running <
  `max_batch_size` and KV blocks allow; finished sequences leave at once;
  when KV runs out mid-decode the newest running sequence is preempted and
  recomputed later. An idle engine waits `batch_timeout_ms` for company.
Prefill costs the curve's marginal per-sequence time per prompt token.
Torch-free, numpy only.
"""

from __future__ import annotations

import json
import math
from collections import deque
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
from batchpilot_operator.tuner import (
    Bounds,
    Decision,
    Slo,
    TunerParams,
    TunerState,
    decide,
    signal_window_s,
)
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.metric_names import LATENCY_BUCKETS

STEP_TIMES_FILE = Path(__file__).resolve().parent.parent / "docs" / "step_times.json"
BUCKET_BOUNDS = (*LATENCY_BUCKETS, math.inf)

# DESIGN's CPU figures for the tiny model: ~0.7k tokens/s at batch 1 and
# ~6.5k at batch 64, i.e. a step of 1/700 s and 64/6500 s; used only until
# the engine's measured curve exists.
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
        xs, ys = self.batch_sizes, self.seconds
        if batch >= xs[-1]:  # extrapolate with the last segment's slope
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            return ys[-1] + slope * (batch - xs[-1])
        return float(np.interp(batch, xs, ys))

    @property
    def per_token_s(self) -> float:
        """Marginal cost of one more sequence in a step: what a prompt token costs."""
        xs, ys = self.batch_sizes, self.seconds
        return max(1e-6, (ys[-1] - ys[0]) / (xs[-1] - xs[0]))

    @classmethod
    def from_points(cls, points: dict[int, float], source: str) -> StepCurve:
        pairs = sorted((int(b), float(s)) for b, s in points.items())
        return cls(tuple(b for b, _ in pairs), tuple(s for _, s in pairs), source)

    @classmethod
    def load(cls, path: Path = STEP_TIMES_FILE) -> StepCurve:
        """The measured curve when the engine benchmark wrote one, else DESIGN's figures."""
        if not path.exists():
            return cls.from_points(FALLBACK_CURVE, "fallback: DESIGN's CPU figures")
        data = json.loads(path.read_text())
        return cls.from_points(_find_curve(data, path), f"measured: {path.name}")


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
    slo: Slo
    interval_s: float = 30.0
    window_s: float = 60.0
    kv_blocks: int = 4096
    block_size: int = 16
    tune: bool = True
    bounds: Bounds = field(default_factory=Bounds)
    params: TunerParams = field(default_factory=TunerParams)


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
    batch_weighted: float = 0.0  # sum of batch size x steps (continuous) or batches (dynamic)
    batch_count: float = 0.0
    kv_max: float = 0.0
    waiting_at_end: int = 0
    config: BatchingConfig | None = None  # in force during the interval
    p99_s: float | None = None
    decision: Decision | None = None


@dataclass
class SimResult:
    intervals: list[Interval]
    completed: int
    good: int
    rejected: int
    arrived: int
    duration_s: float
    p99_s: float | None

    @property
    def goodput(self) -> float:
        """Requests per second that finished within the SLO."""
        return self.good / self.duration_s


class _Engine:
    """The mutable state of one simulated server and its event loop."""

    def __init__(self, work: Workload, options: SimOptions, curve: StepCurve) -> None:
        self.work = work
        self.opt = options
        self.curve = curve
        self.config = options.config
        self.state = TunerState()
        self.now = 0.0
        self.next_arrival = 0
        self.waiting: deque[int] = deque()
        self.admitted_at: dict[int, float] = {}
        # continuous: per running sequence [request, tokens left, context tokens]
        self.running: list[list[int]] = []
        self.kv_used = 0
        self.intervals: list[Interval] = []
        self.current = Interval(end_s=options.interval_s, config=self.config)
        self.all_latencies: list[float] = []
        self.rejected = 0
        # Tokens still to generate for preempted requests (they keep their progress).
        self.left_after_preemption: dict[int, int] = {}

    # -- arrivals and records -------------------------------------------------

    def _arrival_time(self) -> float:
        if self.next_arrival < len(self.work.arrivals):
            return float(self.work.arrivals[self.next_arrival])
        return math.inf

    def _take_arrivals(self) -> None:
        while self._arrival_time() <= self.now:
            if len(self.waiting) >= self.config.max_queue_size:
                self.current.rejected += 1
                self.rejected += 1
            else:
                self.waiting.append(self.next_arrival)
            self.next_arrival += 1

    def _scheduled(self, request: int) -> None:
        if request not in self.admitted_at:
            self.admitted_at[request] = self.now
            self.current.queue_waits.append(self.now - float(self.work.arrivals[request]))

    def _complete(self, request: int, at: float) -> None:
        latency = at - float(self.work.arrivals[request])
        iv = self.current
        iv.completed += 1
        iv.good += latency <= self.opt.slo.p99_latency_s
        iv.latencies.append(latency)
        iv.tokens += int(self.work.outputs[request])
        self.all_latencies.append(latency)
        self.admitted_at.pop(request, None)

    def _kv_sample(self) -> None:
        self.current.kv_max = max(self.current.kv_max, self.kv_used / self.opt.kv_blocks)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.opt.block_size)

    # -- ticks ----------------------------------------------------------------

    def _tick(self) -> None:
        iv = self.current
        iv.waiting_at_end = len(self.waiting)
        iv.p99_s = float(np.percentile(iv.latencies, 99)) if iv.latencies else None
        self.intervals.append(iv)
        if self.opt.tune:
            signals = self.signals()
            iv.decision = decide(
                signals, self.config, self.opt.bounds, self.opt.slo, self.state, self.opt.params
            )
            self.config, self.state = iv.decision.config, iv.decision.state
        self.current = Interval(end_s=iv.end_s + self.opt.interval_s, config=self.config)

    def signals(self) -> Signals:
        """Signals over the last window, built like the scrape source builds them."""
        window_s = signal_window_s(self.state, self.opt.interval_s, self.opt.window_s)
        count = max(1, round(window_s / self.opt.interval_s))
        window = self.intervals[-count:]
        window_s = len(window) * self.opt.interval_s
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

    def _advance_to(self, t: float) -> None:
        """Move the clock to t, closing every interval boundary on the way."""
        while self.current.end_s <= t:
            self.now = self.current.end_s
            self._take_arrivals()
            self._tick()
        self.now = t

    # -- the loop ---------------------------------------------------------------

    def run(self, duration_s: float) -> None:
        step = self._continuous_event if self.opt.mode == "continuous" else self._dynamic_event
        while self.now < duration_s:
            self._take_arrivals()
            step()

    def _idle_until(self) -> float | None:
        """When an engine with nothing running starts its next unit of work (None: now)."""
        if not self.waiting:
            return min(self._arrival_time(), self.current.end_s)
        if len(self.waiting) >= self.config.max_batch_size:
            return None
        fire_at = float(self.work.arrivals[self.waiting[0]]) + self.config.batch_timeout_s
        if fire_at <= self.now:
            return None
        return min(fire_at, self._arrival_time(), self.current.end_s)

    def _dynamic_event(self) -> None:
        wait_until = self._idle_until()
        if wait_until is not None:
            self._advance_to(wait_until)
            return
        members: list[int] = []
        blocks = 0
        while self.waiting and len(members) < self.config.max_batch_size:
            request = self.waiting[0]
            need = self._blocks(int(self.work.prompts[request] + self.work.outputs[request]))
            if members and blocks + need > self.opt.kv_blocks:
                break  # cut the batch smaller rather than run out of KV
            members.append(self.waiting.popleft())
            blocks += need
        for request in members:
            self._scheduled(request)
        self.kv_used = blocks
        self._kv_sample()
        outputs = sorted(int(self.work.outputs[r]) for r in members)
        duration = self.curve.per_token_s * float(sum(self.work.prompts[r] for r in members))
        done = 0
        for i, out in enumerate(outputs):
            duration += (out - done) * self.curve.step_s(len(outputs) - i)
            done = out
        self.current.batch_weighted += len(members)
        self.current.batch_count += 1
        end = self.now + duration
        self._advance_to(end)
        self.kv_used = 0
        for request in members:
            self._complete(request, end)

    def _continuous_event(self) -> None:
        if not self.running:
            wait_until = self._idle_until()
            if wait_until is not None:
                self._advance_to(wait_until)
                return
        prefill = self._admit()
        if not self.running:
            # Only a request larger than the whole KV pool gets here: refuse it.
            self.waiting.popleft()
            self.current.rejected += 1
            self.rejected += 1
            return
        n = len(self.running)
        step_s = self.curve.step_s(n)
        k = min(seq[1] for seq in self.running)
        next_arrival = self._arrival_time()
        if n < self.config.max_batch_size and not self.waiting and next_arrival < math.inf:
            k = min(k, max(1, math.ceil((next_arrival - self.now) / step_s)))
        k = min(k, max(1, math.ceil((self.current.end_s - self.now) / step_s)))
        k = self._fit_kv(k)
        if k == 0:
            self._preempt_newest()
            return
        self.current.batch_weighted += n * k
        self.current.batch_count += k
        self.kv_used += sum(
            self._blocks(seq[2] + k) - self._blocks(seq[2]) for seq in self.running
        )
        self._kv_sample()
        self._advance_to(self.now + prefill + k * step_s)
        still: list[list[int]] = []
        for seq in self.running:
            seq[1] -= k
            seq[2] += k
            if seq[1] <= 0:
                self.kv_used -= self._blocks(seq[2])
                self._complete(seq[0], self.now)
            else:
                still.append(seq)
        self.running = still

    def _admit(self) -> float:
        """Admit waiting requests while the batch and KV allow; the prefill time they add."""
        prefill_tokens = 0
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            output = int(self.work.outputs[request])
            left = self.left_after_preemption.get(request, output)
            context = int(self.work.prompts[request]) + output - left
            need = self._blocks(context + 1)
            # Keep a block per running sequence in reserve, so that the next step
            # can always run (vLLM's watermark): admission never forces a preemption.
            if self.kv_used + need + len(self.running) + 1 > self.opt.kv_blocks:
                break
            self.waiting.popleft()
            self._scheduled(request)
            self.kv_used += need
            self.left_after_preemption.pop(request, None)
            self.running.append([request, left, context + 1])
            prefill_tokens += context
        return prefill_tokens * self.curve.per_token_s

    def _fit_kv(self, k: int) -> int:
        """The most steps (<= k) the running sequences can take before KV runs out."""
        free = self.opt.kv_blocks - self.kv_used

        def extra(steps: int) -> int:
            return sum(
                self._blocks(seq[2] + steps) - self._blocks(seq[2]) for seq in self.running
            )

        if extra(k) <= free:
            return k
        low, high = 0, k
        while low < high:
            mid = (low + high + 1) // 2
            if extra(mid) <= free:
                low = mid
            else:
                high = mid - 1
        return low

    def _preempt_newest(self) -> None:
        request, left, context = self.running.pop()
        self.kv_used -= self._blocks(context)
        self.left_after_preemption[request] = left
        self.waiting.appendleft(request)
        self.current.preemptions += 1


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
    """Play `scenario` once; the tuner runs every interval when `options.tune`.

    `drain_s` keeps the server running that long after the last arrival window.
    """
    work = make_workload(scenario, seed)
    return simulate_workload(work, options, curve, scenario.duration_s + drain_s)


def simulate_workload(
    work: Workload, options: SimOptions, curve: StepCurve, run_s: float
) -> SimResult:
    engine = _Engine(work, options, curve)
    engine.run(run_s)
    # Requests still queued or running at the end count as not good.
    ended = [*engine.intervals, engine.current]
    latencies = engine.all_latencies
    return SimResult(
        intervals=engine.intervals,
        completed=sum(iv.completed for iv in ended),
        good=sum(iv.good for iv in ended),
        rejected=engine.rejected,
        arrived=len(work.arrivals),
        duration_s=run_s,
        p99_s=float(np.percentile(latencies, 99)) if latencies else None,
    )


def static(options: SimOptions, config: BatchingConfig) -> SimOptions:
    """The same run with a fixed config and no tuner."""
    return replace(options, config=config, tune=False)
