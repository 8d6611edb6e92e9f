"""Discrete-event simulation of a fleet of servers behind a load balancer: the real
schedulers under one virtual clock, with the tuning loop in the loop.

The engine (`server/engine/core.py`) runs step after step: its scheduler plans a step
(`schedule(now)`), the model runs it, and the scheduler takes the sampled tokens
back (`postprocess`). Each simulated server does the same with the same
schedulers (`scheduler_policies.new_scheduler`, ragged execution) over its own
`BlockPool`; only the model is replaced, by a step-time model read from the
engine benchmark (`docs/step_times.json`: seconds per decode step by batch
size): a step over T prompt tokens and n decode rows is one forward, as the
engine's is, and takes what a decode step of T + n rows takes (bench/step_mix.py
measures both against the engine). A request goes, when it arrives, to the server
the balancer picks (round robin, or least outstanding = waiting + running) and is
added to its scheduler, as the engine's `submit` does while the model computes.

Every `cadence.interval_s` one round of the tuning loop runs with the fleet as
its signal source (the last window's signals, built like the scrape source
builds them: p99 over all servers' requests, KV usage of the fullest server,
arrivals, forward seconds per generated token, the servers the window covers),
its actuator (a config goes to every server; a new server starts from the
config in force) and, where the goal has replica bounds, its scaler: a new
server serves `startup_s` after the decision; a removed one leaves the balancer,
finishes what it holds, then stops. A `ReplicaController` (the benchmark's
HPA-like rule) can drive the same scaler instead. Time advances from event to
event (arrivals and rounds first at one instant, then the servers in start
order), so an hour of traffic plays in seconds; one server without autoscaling
behaves exactly as the single-server simulator did.

Fast-forward: after a decode-only step in which no sequence finished, the steps
that follow are the same plan again until a sequence finishes, a request could
be admitted (any server's next arrival bounds it: conservative), the pool runs
short or the interval ends; those steps are applied together (each sequence's
tokens and blocks advanced as the scheduler's decode plan and `postprocess`
would) and the real scheduler plans the next one. A test replays traces with
and without it and compares every completion.

SLO classes: a workload may name each request's class (`Workload.classes`;
`merge_workloads` joins one workload per class). A request then carries its class and
that class's priority in the config's classes (the policy's where the config states
none), as the server's `x-gateway-inference-objective` header gives them; the real
schedulers serve it by `class_rank`, with `SimOptions.class_max_wait_s` as the age
bound (the server's default unless set), and fast-forward asks the scheduler which
request it would admit first (`first_in_line`) and when aging may change that
(`rank_changes_at`). Each request is judged against its class's targets; each
interval keeps every class's part (`Interval.classes`), the signals carry it as the
pods' `class` label does (`Signals.classes`), and a run sums it per class
(`SimResult.classes`). A workload naming no class runs exactly as before classes.
Torch-free.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
from batchpilot_operator.policy.predictor import Prediction
from batchpilot_operator.policy.round import Decision
from batchpilot_operator.policy.step_model import StepPoint
from batchpilot_operator.policy.types import Cadence, Fleet, Goal, ReplicaState, ScaleDecision
from batchpilot_operator.signal_fields import WindowTotals, signals_from
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_operator.tuning_loop import (
    ActuationReport,
    Applied,
    PlugPoints,
    TuneStep,
    TuningLoop,
)
from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import DEFAULT_CLASS, BatchingConfig, Mode
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.scheduler import Output
from batchpilot_server.engine.scheduler_policies import PolicyOptions, new_scheduler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import (
    CLASS_MAX_WAIT_S,
    LOWER_CLASS_PREFILL_TOKENS,
    EngineError,
    EngineOptions,
    QueueFullError,
    SamplingParams,
)
from batchpilot_server.metric_names import GENERATION_TOKEN_BUCKETS, LATENCY_BUCKETS

STEP_TIMES_FILE = Path(__file__).resolve().parent.parent / "docs" / "step_times.json"
BUCKET_BOUNDS = (*LATENCY_BUCKETS, math.inf)
GENERATION_TOKEN_BOUNDS = (*(float(n) for n in GENERATION_TOKEN_BUCKETS), math.inf)
# The engine's block size and prefill budget unless a simulation says otherwise.
ENGINE_DEFAULTS = EngineOptions(mode="continuous", config=BatchingConfig())

# Pod start to ready: scheduling and container start (image cached: seconds) plus the
# model load and the startup probe (/readyz every 5 s): tens of seconds for a 135M-8B
# model from a local volume. One tuning interval: the round after next sees the pod.
STARTUP_S = 30.0

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
    # Attention's cost: seconds per KV token a step's rows attend to (their context so
    # far). 0 keeps the batch-size-only curve the engine benchmark measures; the LLM
    # scenarios set it, so that long prompts and answers slow every step they share.
    kv_token_s: float = 0.0

    def __post_init__(self) -> None:
        if len(self.batch_sizes) < 2 or len(self.batch_sizes) != len(self.seconds):
            raise ValueError("a step curve needs at least two (batch, seconds) points")

    def step_s(self, batch: int) -> float:
        return _step_s(self, batch)

    def forward_s(self, rows: int, prompt_tokens: int, kv_tokens: int) -> float:
        """A step over `prompt_tokens` and `rows` decode rows: one forward over them
        together, as the engine's `ModelRunner.step` runs them (a decode step of that
        many rows), plus attention over the KV tokens the rows attend to."""
        tokens = rows + prompt_tokens
        return self.kv_token_s * kv_tokens + (self.step_s(tokens) if tokens else 0.0)

    def with_kv_cost(self, kv_token_s: float) -> StepCurve:
        return replace(self, kv_token_s=kv_token_s, source=f"{self.source} + KV attention")

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
    candidates = (
        [data] + [v for v in data.values() if isinstance(v, dict)] if isinstance(data, dict) else []
    )
    for candidate in candidates:
        points = {k: v for k, v in candidate.items() if str(k).isdigit()}
        if len(points) >= 2 and all(isinstance(v, int | float) for v in points.values()):
            return {int(k): float(v) for k, v in points.items()}
    raise ValueError(f"{path} holds no {{batch size: seconds}} mapping")


ScenarioKind = Literal["steady", "step", "diurnal", "bursts", "longer_outputs", "flash_crowd"]
FLASH_DECAY_S = 300.0  # a flash crowd fades back to the base load with this time constant


@dataclass(frozen=True)
class Scenario:
    """Traffic over time: Poisson arrivals at `rate(t)`, outputs around `output_mean(t)`."""

    name: ScenarioKind
    duration_s: float
    base_rate: float  # requests/s
    output_tokens: int = 64  # mean; uniform in [mean/4, 7*mean/4] unless output_range
    prompt_tokens: tuple[int, int] = (16, 128)  # uniform in [low, high]
    step_at_s: float | None = None  # load step, flash crowd, longer outputs: when
    peak: float = 3.0  # the step's and the flash crowd's load, times the base
    back_at_s: float | None = None  # when a step falls back to the base (None: never)
    output_range: tuple[int, int] | None = None  # uniform in [low, high] (scaled in time)
    acceptance: float = 0.0  # speculative decoding: each draft token's chance (Workload)

    def rate(self, t: float) -> float:
        at = self.step_at_s
        if self.name == "step" and at is not None and at <= t < (self.back_at_s or math.inf):
            return self.peak * self.base_rate
        if self.name == "flash_crowd" and at is not None and t >= at:
            surge = (self.peak - 1.0) * math.exp(-(t - at) / FLASH_DECAY_S)
            return self.base_rate * (1.0 + surge)
        if self.name == "diurnal":
            # One "day" per scenario: trough at the start, peak at 2.2x the base mid-way.
            return self.base_rate * (1.0 - 0.6 * math.cos(2 * math.pi * t / self.duration_s))
        if self.name == "bursts" and (t % 300.0) < 30.0:
            return 2.5 * self.base_rate  # 30 s bursts every 5 minutes
        return self.base_rate

    @property
    def rate_max(self) -> float:
        peaks = {"step": self.peak, "flash_crowd": self.peak, "diurnal": 1.6, "bursts": 2.5}
        return peaks.get(self.name, 1.0) * self.base_rate

    def output_mean(self, t: float) -> int:
        if self.name == "longer_outputs" and self.step_at_s is not None and t >= self.step_at_s:
            return round(1.5 * self.output_tokens)
        return self.output_tokens


@dataclass(frozen=True)
class Workload:
    arrivals: np.ndarray  # seconds, ascending
    prompts: np.ndarray  # tokens
    outputs: np.ndarray  # tokens
    # each request's SLO class (the name its header gives; its priority is the class's in
    # the policy); empty: every request is in the default class, as before classes
    classes: tuple[str, ...] = ()
    # speculative decoding (k > 0): the chance that the model accepts a draft token, each
    # independently until the first rejection (~0.7 for answers that quote their prompt,
    # ~0.2 for free-form chat); the simulator draws each verify row's accepted run by it
    acceptance: float = 0.0


def merge_workloads(parts: dict[str, Workload]) -> Workload:
    """Several classes' workloads as one: every request in arrival order (ties in the
    order of `parts`), named by the class whose workload it came from."""
    names = [name for name, work in parts.items() for _ in range(len(work.arrivals))]
    arrivals = np.concatenate([work.arrivals for work in parts.values()])
    order = np.argsort(arrivals, kind="stable")
    return Workload(
        arrivals=arrivals[order],
        prompts=np.concatenate([work.prompts for work in parts.values()])[order],
        outputs=np.concatenate([work.outputs for work in parts.values()])[order],
        classes=tuple(names[i] for i in order),
    )


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
    if scenario.output_range is None:
        spread = rng.uniform(0.25, 1.75, len(times))
    else:  # the range, stretched as output_mean stretches the mean
        low, high = scenario.output_range
        spread = rng.uniform(low, high, len(times)) / scenario.output_tokens
    outputs = np.maximum(1, np.round(means * spread)).astype(int)
    low, high = scenario.prompt_tokens
    prompts = rng.integers(low, high + 1, len(times))
    return Workload(times, prompts, outputs, acceptance=scenario.acceptance)


Balancer = Literal["round_robin", "least_outstanding"]


@dataclass(frozen=True)
class RequestTimes:
    """One finished request's latencies, in seconds; tpot None for a one-token answer."""

    ttft_s: float
    tpot_s: float | None
    e2e_s: float


def missed_targets(times: RequestTimes, targets: dict[str, float]) -> list[str]:
    """The stated targets (ttft, tpot, e2e in seconds) the request missed, as a pod
    judges it; a one-token answer has no TPOT to miss."""
    observed = {"ttft": times.ttft_s, "tpot": times.tpot_s, "e2e": times.e2e_s}
    return [
        name
        for name, target in targets.items()
        if (value := observed[name]) is not None and value > target
    ]


# The predictor's seam: given the signals a round read, the config the round leaves in
# force, the replicas, the SLO and the rule's step points, what the next interval will
# measure (the policy's `predict_config`). None: no predictor.
Predictor = Callable[[Signals, BatchingConfig, int, Slo, tuple[StepPoint, ...]], Prediction | None]


@dataclass(frozen=True)
class SimOptions:
    mode: Mode
    config: BatchingConfig
    goal: Goal
    cadence: Cadence = field(default_factory=Cadence)
    kv_blocks: int = 4096
    block_size: int = ENGINE_DEFAULTS.block_size
    tune: bool = True
    fast_forward: bool = True
    trace: bool = False  # keep every step's batch size, completion's step, request's server
    replicas: int = 1  # servers at the start; fixed unless goal.replicas or a controller moves it
    balancer: Balancer = "least_outstanding"
    startup_s: float = STARTUP_S
    controller: ReplicaController | None = None  # a replica rule outside the loop
    # Asked after each round what the next interval will measure (bench/tuner.py
    # compares it with what it measured); None: nothing is predicted.
    predictor: Predictor | None = None
    # A waiting request this old ranks above every SLO class (the server's
    # --class-max-wait-s, scheduler.class_rank); matters only where classes differ.
    class_max_wait_s: float = CLASS_MAX_WAIT_S
    # Continuous: the lower classes' prompt tokens in a step that decodes a higher class
    # (the server's --lower-class-prefill-tokens).
    lower_class_prefill_tokens: int = LOWER_CLASS_PREFILL_TOKENS


@dataclass
class ClassInterval:
    """One SLO class's share of an interval (workloads that name classes only): its
    requests judged against the class's own targets."""

    arrived: int = 0
    completed: int = 0
    good: int = 0  # met every target the policy states for the class
    rejected: int = 0
    slo_judged: int = 0  # the pods' judgement against the config's class targets
    slo_met: int = 0
    slo_missed: dict[str, int] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    queue_waits: list[float] = field(default_factory=list)  # arrival to first scheduled
    waiting_at_end: int = 0  # the class's requests waiting as the interval ends
    prompts: list[int] = field(default_factory=list)  # each finished request's prompt
    outputs: list[int] = field(default_factory=list)  # and its tokens

    @property
    def attainment(self) -> float | None:
        return self.slo_met / self.slo_judged if self.slo_judged else None


@dataclass
class Interval:
    """What one tuning interval saw, and what the tuner did at its end."""

    end_s: float
    completed: int = 0
    good: int = 0
    rejected: int = 0
    arrived: int = 0  # admitted or refused
    latencies: list[float] = field(default_factory=list)
    queue_waits: list[float] = field(default_factory=list)
    ttfts: list[float] = field(default_factory=list)  # arrival to first token, per request
    tpots: list[float] = field(default_factory=list)  # mean after the first (2+ tokens)
    prompts: list[int] = field(default_factory=list)  # each finished request's prompt
    # The pods' exact judgement against the config's targets (batchpilot_requests_slo_total)
    slo_judged: int = 0
    slo_met: int = 0
    slo_missed: dict[str, int] = field(default_factory=dict)
    # The step-time model's inputs, all servers: steps, seconds, decode rows, prompt
    # tokens computed, KV tokens attended
    steps: int = 0
    step_seconds: float = 0.0
    step_decode_rows: int = 0
    step_prefill_tokens: int = 0
    step_kv_tokens: int = 0
    # speculative decoding, all servers: draft tokens verified, and those accepted
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    tokens: int = 0
    outputs: list[int] = field(default_factory=list)  # each finished request's tokens
    preemptions: int = 0
    batch_weighted: float = 0.0  # sum of the batch sizes the engine records (per step or batch)
    batch_count: float = 0.0
    kv_max: float = 0.0  # the fullest server's
    busy_s: float = 0.0  # simulated forward seconds, all servers
    waiting_at_end: int = 0
    running_at_end: int = 0  # sequences the live servers' batches hold at the end
    pods: int = 0  # servers the balancer reached for the whole interval
    replicas: int = 0  # the count of record after the interval's round
    ready: int = 0  # servers ready and not draining after the round
    config: BatchingConfig | None = None  # in force during the interval
    p99_s: float | None = None
    decision: Decision | None = None
    scale: ScaleDecision | None = None
    # What a predictor said this interval would measure (`Prediction`), when one is hooked.
    prediction: Prediction | None = None
    # By SLO class, where the workload names classes (the totals above hold them all)
    classes: dict[str, ClassInterval] = field(default_factory=dict)

    @property
    def attainment(self) -> float | None:
        return self.slo_met / self.slo_judged if self.slo_judged else None

    @property
    def ttft_p99_s(self) -> float | None:
        return float(np.percentile(self.ttfts, 99)) if self.ttfts else None

    @property
    def tpot_p99_s(self) -> float | None:
        return float(np.percentile(self.tpots, 99)) if self.tpots else None


@dataclass(frozen=True)
class Completion:
    request: int  # index into the workload
    at_s: float
    step: int  # the engine step whose end completed it


@dataclass(frozen=True)
class ClassTotals:
    """One SLO class over a whole run: what became of its requests, and the longest any
    waited to be first scheduled (one never scheduled: until the run's end)."""

    arrived: int
    completed: int
    good: int
    rejected: int  # refused (a full queue, no server) or ended unserved
    unfinished: int  # still waiting or running at the run's end
    max_wait_s: float

    @property
    def lost(self) -> int:
        """Requests neither answered, refused nor still held: none, unless one vanished."""
        return self.arrived - self.completed - self.rejected - self.unfinished


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
    routes: list[int]  # the server each request went to, -1 for none (`trace` only)
    replica_seconds: float
    classes: dict[str, ClassTotals] = field(default_factory=dict)  # classed workloads only

    @property
    def goodput(self) -> float:
        """Requests per second that finished within the SLO."""
        return self.good / self.duration_s


SAMPLED_TOKEN = 0  # what the model "samples": never an EOS (the simulated server has none)
REJECTED_TOKEN = 1  # what it samples where it rejects a draft token (drafts are SAMPLED_TOKEN)


def draft_everything(tokens: list[int], k: int) -> list[int]:
    """The simulator's proposer: every speculable row drafts all it may. Its token ids
    carry no text to look up; what a draft is worth is the workload's acceptance."""
    return [SAMPLED_TOKEN] * k


def accepted_run(rng: np.random.Generator, acceptance: float, draft: int) -> int:
    """Draft tokens a verify row keeps: each accepted with chance `acceptance` until the
    first rejection, at most the draft (the row then gains the model's own token too)."""
    kept = 0
    while kept < draft and rng.random() < acceptance:
        kept += 1
    return kept


@dataclass(frozen=True)
class StepRecord:
    """A server's last planned step, as an engine's per-step metrics report it (what a
    peer planner reads per engine, e.g. Dynamo's forward-pass metrics)."""

    prefill_requests: int
    prefill_tokens: int  # prompt tokens computed
    decode_requests: int
    kv_tokens: int  # KV tokens the step's rows attend to
    seconds: float


class SimulatedServer:
    """One replica: its scheduler and KV pool, stepping on the fleet's virtual clock.

    Busy while a step (or a fast-forward of steps) computes, until `step_end`;
    idle otherwise, when it plans again at an arrival routed to it, at a round,
    or at its scheduler's wake-up.
    """

    def __init__(self, index: int, fleet: SimulatedFleet, ready_s: float) -> None:
        self.index = index
        self.fleet = fleet
        opt = fleet.opt
        self.pool = BlockPool(opt.kv_blocks, opt.block_size)
        # The engine's policy for the mode; no EOS: requests end at max_tokens.
        # the prefill budget is the config's (live)
        policy = PolicyOptions(
            class_max_wait_s=opt.class_max_wait_s,
            lower_class_prefill_tokens=opt.lower_class_prefill_tokens,
            proposer=draft_everything,
        )
        self.scheduler = new_scheduler(opt.mode, self.pool, fleet.config, frozenset(), policy)
        self.started_s = fleet.now
        self.ready_s = ready_s
        self.ready = ready_s <= fleet.now
        self.drain_s: float | None = None  # when it left the balancer
        self.stopped_s: float | None = None
        self.now = ready_s  # when it last planned
        self.step_end: float | None = None  # busy until then
        self.step_plan = StepPlan()  # the step in flight
        self.forwarding = False  # the step in flight is a fast-forward
        self.last_step: StepRecord | None = None  # the last planned step (`_observe`)

    @property
    def name(self) -> str:
        return f"server-{self.index}"

    @property
    def live(self) -> bool:
        return self.stopped_s is None

    @property
    def routable(self) -> bool:
        """Whether the balancer may send it requests: ready and not draining."""
        return self.ready and self.drain_s is None and self.stopped_s is None

    @property
    def outstanding(self) -> int:
        """What least-outstanding routing counts: waiting plus running."""
        return self.scheduler.num_waiting + self.scheduler.num_running

    def event_s(self) -> float:
        """When it next acts on its own: its step's end, or an idle scheduler's wake-up."""
        if self.step_end is not None:
            return self.step_end
        wake = self.scheduler.wake_at() if self.ready and self.live else None
        return math.inf if wake is None else max(self.now, wake)

    def become_ready(self) -> None:
        # It read the ConfigMap at start; a change since then reaches it now, as a resync.
        self.ready = True
        self.now = self.ready_s
        self.reconfigure(self.fleet.config)

    def reconfigure(self, config: BatchingConfig) -> None:
        """From its next step on, as the engine does (the prefill budget is the config's)."""
        self.scheduler.reconfigure(config)

    def drain(self, now: float) -> None:
        """Out of the balancer; it finishes what it holds (the server's SIGTERM drain)."""
        self.drain_s = now
        if not self.ready:
            self.stopped_s = now
            return
        self.scheduler.stop(drain=True)
        self.stop_if_drained(now)

    def stop_if_drained(self, now: float) -> None:
        if self.drain_s is not None and self.step_end is None and self.scheduler.idle:
            self.stopped_s = now

    def act(self, t: float, touched: bool, until_s: float) -> None:
        """Whatever falls due at `t`: the end of its step, then the next plan (before
        `until_s` only, as a run ends)."""
        if self.step_end is not None:
            if self.step_end > t:
                return
            self._finish(t)
            due = self.step_end is None
        else:
            due = touched or self.event_s() <= t
        if due and t < until_s and self.live:
            self._plan(t)
        self.stop_if_drained(t)

    def _plan(self, now: float) -> None:
        self.now = now
        plan = self.scheduler.schedule(now)
        self.fleet.deliver(plan.ended, now)
        if not plan.size:
            return
        self.step_plan = plan  # computed at its end: `postprocess` advances its rows
        # counted once: the timing, the counters and the step record all read them
        prefill_tokens, kv_tokens = _prefill_tokens(plan), _kv_tokens(plan)
        seconds = self.fleet.curve.forward_s(len(plan.decode), prefill_tokens, kv_tokens)
        self._observe(plan, seconds, prefill_tokens, kv_tokens)
        self.step_end = now + seconds

    def _finish(self, end: float) -> None:
        self.step_end = None
        if self.forwarding:
            self.forwarding = False
            self.fleet.current.kv_max = max(self.fleet.current.kv_max, self.pool.usage_ratio)
            return
        plan = self.step_plan
        rows = plan.sampling()
        for seq in rows:  # a recomputed (preempted) sequence's first token came earlier
            self.fleet.first_token.setdefault(seq, end)
        tokens = self._drawn_tokens(plan)
        outputs = self.scheduler.postprocess(plan, tokens, [0.0] * len(tokens), end)
        self.fleet.current.spec_accepted_tokens += sum(plan.accepted)
        self.fleet.deliver(outputs, end)
        # a fast-forward repeats plain decode steps; with k > 0 each step verifies drafts
        if self.fleet.opt.fast_forward and not self.scheduler.config.num_speculative_tokens:
            self._fast_forward([seq for seq in rows if seq.finish_reason is None], end)

    def _drawn_tokens(self, plan: StepPlan) -> list[int]:
        """What the model samples, one per `sampler_rows` row: SAMPLED_TOKEN, except where
        a verify row rejects its draft (at the run `accepted_run` draws)."""
        completed = len(plan.sampling()) - len(plan.decode)
        tokens = [SAMPLED_TOKEN] * completed
        for draft in plan.drafts:
            kept = accepted_run(self.fleet.rng, self.fleet.work.acceptance, len(draft))
            drawn = [SAMPLED_TOKEN] * (len(draft) + 1)
            if kept < len(draft):
                drawn[kept] = REJECTED_TOKEN
            tokens += drawn
        return tokens + [SAMPLED_TOKEN] * len(plan.decode)

    def _observe(self, plan: StepPlan, seconds: float, prefill_tokens: int, kv_tokens: int) -> None:
        """What the engine's observer records for a step."""
        iv = self.fleet.current
        iv.preemptions += len(plan.preempted)
        iv.busy_s += seconds
        iv.steps += 1
        iv.step_seconds += seconds
        # as the engine's `StepPlan.work` counts them: a verify row is a decode row, its
        # draft tokens prompt tokens (its timing above computes both as one chunk)
        drafted = sum(len(draft) for draft in plan.drafts)
        iv.step_decode_rows += len(plan.decode) + len(plan.verify)
        iv.step_prefill_tokens += sum(plan.chunks or []) + drafted
        iv.spec_draft_tokens += drafted
        iv.step_kv_tokens += kv_tokens
        for seq in plan.first_scheduled:
            iv.queue_waits.append((seq.first_scheduled or seq.arrival) - seq.arrival)
            if self.fleet.classed:
                self.fleet.class_iv(seq.slo_class).queue_waits.append(iv.queue_waits[-1])
        if plan.batch_size:
            self.fleet.record_batches(plan.batch_size, 1)
        iv.kv_max = max(iv.kv_max, self.pool.usage_ratio)
        self.last_step = StepRecord(
            len(plan.prefill), prefill_tokens,
            len(plan.decode), kv_tokens, seconds,
        )  # fmt: skip

    def _fast_forward(self, decode: list[Sequence], now: float) -> None:
        """The next steps, applied at once where each would decode exactly `decode` (the
        rows that sampled and go on) and finish none of them (module docstring)."""
        if not decode or (
            # continuous: every running sequence decodes next (none waits for a chunk)
            self.fleet.opt.mode == "continuous" and len(decode) != self.scheduler.num_running
        ):
            return
        context = sum(seq.num_tokens for seq in decode)  # what the next step attends to
        first_s, growth_s = self._ff_costs(decode, context)
        steps = self._repeats(decode, now, first_s, growth_s)
        if steps <= 0:
            return
        for seq in decode:
            self.pool.grow(seq.block_table, seq.num_tokens + steps - 1)
            # each step computes the newest token and samples the next: as `postprocess`
            seq.advance(steps, [SAMPLED_TOKEN] * steps)
        self.scheduler.steps += steps
        seconds = steps * first_s + growth_s * steps * (steps - 1) / 2
        if self.fleet.opt.mode == "continuous":  # each continuous step records its rows
            self.fleet.record_batches(len(decode), steps)
        iv = self.fleet.current
        iv.busy_s += seconds
        iv.steps += steps
        iv.step_seconds += seconds
        iv.step_decode_rows += steps * len(decode)
        # step j attends to each row's context so far: the first one's plus j tokens a row
        iv.step_kv_tokens += steps * context + len(decode) * steps * (steps - 1) // 2
        self.step_end = now + seconds
        self.forwarding = True

    def _ff_costs(self, decode: list[Sequence], context: int) -> tuple[float, float]:
        """A repeated decode step's seconds (the first of them) and how much each later one
        adds (attention over one more token a row); `context`: the rows' tokens so far."""
        curve = self.fleet.curve
        return curve.forward_s(len(decode), 0, context), curve.kv_token_s * len(decode)

    def _repeats(self, decode: list[Sequence], now: float, first_s: float, growth_s: float) -> int:
        """How many of the next steps plan exactly `decode` again and finish nothing, each
        taking `first_s` and `growth_s` more than the one before (`_ff_costs`)."""
        limit = min(seq.params.max_tokens - seq.num_output for seq in decode) - 1
        until = [self.fleet.current.end_s]
        if self.fleet.opt.mode == "continuous":
            if self.scheduler.may_admit(now):
                return 0
            # An arrival would be admitted. Any server's next arrival bounds it: the
            # balancer picks the server only when the request arrives (conservative).
            if not self.scheduler.num_waiting:
                until.append(self.fleet.arrival_s())
            # a waiting request of a lower class aging above the others may fit
            if (reranked := self.scheduler.rank_changes_at(now)) is not None:
                until.append(reranked)
        for at in until:
            if at < math.inf:  # steps that start before `at`
                limit = min(limit, _steps_starting_before(at - now, first_s, growth_s))
        if self.fleet.opt.mode == "continuous":
            limit = self._blocks_allow(decode, limit)
        return limit

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


class ReplicaController(Protocol):
    """A replica rule outside the tuning loop (the benchmark's HPA-like baseline): once per
    interval it reads the fleet's signals and drives the same scaler."""

    def decide(
        self, signals: Signals, fleet: Fleet, state: ReplicaState, now: float
    ) -> ScaleDecision: ...


class FleetObserver(Protocol):
    """A controller that also reads the fleet itself before it decides (a peer planner that
    takes per-engine metrics and traffic over the interval: bench/planner_baselines.py)."""

    def observe(self, fleet: SimulatedFleet) -> None: ...


class SimulatedFleet:
    """The servers behind a load balancer on one virtual clock; the tuning loop's signal
    source, actuator and scaler."""

    def __init__(self, work: Workload, options: SimOptions, curve: StepCurve) -> None:
        self.work = work
        self.opt = options
        self.curve = curve
        self.config = options.config  # the config of record: every server's, new ones too
        self.now = 0.0
        self.next_arrival = 0
        # Python floats: the clock reads the next arrival at every event
        self.arrivals: list[float] = work.arrivals.tolist()
        self.sequences: dict[Sequence, int] = {}  # admitted -> request index
        self.first_token: dict[Sequence, float] = {}  # when each one's first token came
        self.servers: list[SimulatedServer] = []
        self.starting: list[SimulatedServer] = []  # started, not ready yet
        self.desired = options.replicas
        for _ in range(options.replicas):
            self._start_server(ready_s=0.0)
        self.turn = 0  # the balancer's rotation
        self.intervals: list[Interval] = []
        self.current = Interval(end_s=options.cadence.interval_s, config=options.config)
        self.all_latencies: list[float] = []
        self.rejected = 0
        self.completions: list[Completion] = []
        # speculative decoding's accepted runs (`accepted_run`): seeded, so a run replays
        self.rng = np.random.default_rng(0)
        self.batch_sizes: list[int] = []
        self.routes: list[int] = []
        self.loop = TuningLoop(clock=lambda: self.now)
        self.plugs = PlugPoints(source=self, actuator=self, recorder=self.record, scaler=self)
        self.controller_state = ReplicaState()
        # SLO classes: kept per class only where the workload names them
        self.classed = bool(work.classes)
        unknown = sorted(set(work.classes) - set(self._class_table()))
        if unknown:  # the server answers 400 naming the known ones
            raise ValueError(
                f"the workload names SLO classes the policy lacks: {', '.join(unknown)} "
                f"(known: {', '.join(self._class_table())})"
            )

    # -- the tuning loop's plug points --------------------------------------------

    async def read(self, window_s: float) -> Signals:
        """Signals over the last window, from the totals a scrape of the simulated servers
        would give: the servers' histogram buckets, their counters summed, KV as the
        fullest server."""
        interval_s = self.opt.cadence.interval_s
        window = self.intervals[-max(1, round(window_s / interval_s)) :]
        totals = _window_totals(window, interval_s)
        # every simulated pod's pool is the same size, as the pods export it
        pool_tokens = self.opt.kv_blocks * self.opt.block_size
        totals.least[names.KV_CACHE_CAPACITY_TOKENS] = float(pool_tokens)
        return signals_from(totals)

    async def in_force(self) -> BatchingConfig:
        return self.config

    async def apply(self, config: BatchingConfig) -> ActuationReport:
        self.config = config
        live = [s for s in self.servers if s.live]
        for server in live:
            server.reconfigure(config)
        return ActuationReport(applied=[Applied(s.name, None) for s in live])

    async def resync(self, config: BatchingConfig) -> ActuationReport:
        return ActuationReport()  # every server holds the config of record

    async def fleet(self) -> Fleet:
        return Fleet(self.desired, sum(s.routable for s in self.servers))

    async def scale(self, decision: ScaleDecision) -> None:
        """Start servers (ready after `startup_s`, from the config in force) or drain the
        excess: starting ones first, then the newest, as a ReplicaSet picks its victims."""
        self.desired = decision.replicas
        active = [s for s in self.servers if s.live and s.drain_s is None]
        for _ in range(self.desired - len(active)):
            self._start_server(ready_s=self.now + self.opt.startup_s)
        victims = sorted(active, key=lambda s: (s.ready, -s.index))
        for server in victims[: max(0, len(active) - self.desired)]:
            server.drain(self.now)

    def record(self, step: TuneStep) -> None:
        self.intervals[-1].decision = step.decision
        self.intervals[-1].scale = step.scale

    # -- the clock ----------------------------------------------------------------

    async def run(self, until_s: float) -> None:
        """Play until `until_s` (virtual seconds): events in time order, and at one
        instant arrivals and rounds before the servers act."""
        while True:
            serving = [s for s in self.servers if s.live]
            t = min([self._external_s(), *(s.event_s() for s in serving)])
            if t >= until_s and all(s.step_end is None for s in serving):
                await self._external_until(until_s)
                return
            touched = await self._external_until(t)
            for server in serving:
                server.act(t, server in touched, until_s)

    def _external_s(self) -> float:
        return min(self.arrival_s(), self.current.end_s, self._ready_s())

    def _ready_s(self) -> float:
        if not self.starting:
            return math.inf
        return min((s.ready_s for s in self.starting if s.live), default=math.inf)

    async def _external_until(self, t: float) -> set[SimulatedServer]:
        """Readiness, arrivals and rounds up to `t`, in time order; the idle servers that
        must plan again after them."""
        touched: set[SimulatedServer] = set()
        while True:
            ready, arrival = self._ready_s(), self.arrival_s()
            at = min(ready, arrival, self.current.end_s)
            if at > t:
                break
            if ready == at:
                server = min((s for s in self.starting if s.live), key=lambda s: s.ready_s)
                self.starting.remove(server)
                server.become_ready()
                touched.add(server)
            elif arrival == at:
                touched.update(self._route(at))
            else:
                self.now = at
                await self._close_interval()
                touched.update(self.servers)
        self.now = max(self.now, t)  # a step that ended past the run's end moved it on
        return touched

    # -- arrivals, completions, rounds ----------------------------------------------

    def arrival_s(self) -> float:
        if self.next_arrival < len(self.arrivals):
            return self.arrivals[self.next_arrival]
        return math.inf

    def _route(self, at: float) -> list[SimulatedServer]:
        """Send the request arriving at `at` to the balancer's pick; refused when its queue
        is full or no server is routable."""
        index = self.next_arrival
        self.next_arrival += 1
        self.current.arrived += 1
        server = self._pick()
        if self.opt.trace:
            self.routes.append(-1 if server is None else server.index)
        name, priority = DEFAULT_CLASS, 0
        if self.classed:  # its class, at the priority the policy gives it now
            name = self.work.classes[index]
            priority = self._class_table()[name][0]
            self.class_iv(name).arrived += 1
        seq = Sequence(
            request_id=str(index),
            prompt_ids=[0] * int(self.work.prompts[index]),
            params=SamplingParams(max_tokens=int(self.work.outputs[index]), ignore_eos=True),
            arrival=at,
            deadline=None,
            generator=None,
            slo_class=name,
            priority=priority,
        )
        try:
            if server is None:
                raise QueueFullError("no server is ready")
            server.scheduler.add(seq)
        except QueueFullError:
            self._refuse(name)
        else:
            self.sequences[seq] = index
        return [] if server is None else [server]

    def _pick(self) -> SimulatedServer | None:
        routable = [s for s in self.servers if s.routable]
        if not routable:
            return None
        start = self.turn % len(routable)
        self.turn += 1
        order = routable[start:] + routable[:start]
        if self.opt.balancer == "round_robin":
            return order[0]
        # Ties go round robin too, so equally loaded servers share the requests.
        return min(order, key=lambda s: s.outstanding)

    def _start_server(self, ready_s: float) -> None:
        server = SimulatedServer(len(self.servers), self, ready_s)
        self.servers.append(server)
        if not server.ready:
            self.starting.append(server)

    def record_batches(self, size: int, count: int) -> None:
        self.current.batch_weighted += size * count
        self.current.batch_count += count
        if self.opt.trace:
            self.batch_sizes += [size] * count

    def deliver(self, outputs: list[Output], at: float) -> None:
        for output in outputs:
            if not output.final:
                continue
            index = self.sequences.pop(output.seq)
            first = self.first_token.pop(output.seq, None)
            if isinstance(output.item, EngineError):  # the engine ended it unserved
                self._refuse(output.seq.slo_class)
                continue
            seq = output.seq
            latency = at - seq.arrival
            times = RequestTimes(
                ttft_s=(at if first is None else first) - seq.arrival,
                tpot_s=(at - first) / (seq.num_output - 1)
                if first is not None and seq.num_output > 1
                else None,
                e2e_s=latency,
            )
            iv = self.current
            iv.completed += 1
            if self.classed:
                good = not missed_targets(times, self._goal_targets(seq.slo_class))
                iv.good += good
                self._class_done(seq, times, good)
                self._judge(missed_targets(times, self._class_table()[seq.slo_class][1]),
                            seq.slo_class)  # fmt: skip
            else:
                iv.good += not missed_targets(times, self.opt.goal.slo.stated)
                self._judge(missed_targets(times, self._pod_targets()))
            iv.latencies.append(latency)
            iv.ttfts.append(times.ttft_s)
            if times.tpot_s is not None:
                iv.tpots.append(times.tpot_s)
            iv.prompts.append(seq.num_prompt)
            iv.tokens += seq.num_output
            iv.outputs.append(seq.num_output)
            self.all_latencies.append(latency)
            if self.opt.trace:
                self.completions.append(Completion(index, at, output.item.step))

    def _pod_targets(self) -> dict[str, float]:
        """What the pods judge against (seconds): the config's targets, which the operator
        hands them with the config; the policy's where the config states none."""
        stated = self.config.slo.stated
        if not stated:
            return self.opt.goal.slo.stated
        return {name: ms / 1000.0 for name, ms in stated.items()}

    def _class_table(self) -> dict[str, tuple[int, dict[str, float]]]:
        """Each class a request may name, as the pods take it: its priority and targets
        (seconds), from the config's classes (the policy's where the config states none);
        the default class at priority 0 with `_pod_targets`."""
        slo = self.config.slo if self.config.slo.classes else self.opt.goal.slo.targets()
        return {
            DEFAULT_CLASS: (0, self._pod_targets()),
            **{
                c.name: (c.priority, {k: ms / 1000.0 for k, ms in c.stated.items()})
                for c in slo.classes
            },
        }

    def _goal_targets(self, name: str) -> dict[str, float]:
        """What the policy states for class `name` (seconds): what `good` counts."""
        for c in self.opt.goal.slo.classes:
            if c.name == name:
                return c.stated
        return self.opt.goal.slo.stated

    def class_iv(self, name: str) -> ClassInterval:
        """The current interval's part for class `name`."""
        return self.current.classes.setdefault(name, ClassInterval())

    def _class_done(self, seq: Sequence, times: RequestTimes, good: bool) -> None:
        part = self.class_iv(seq.slo_class)
        part.completed += 1
        part.good += good
        part.latencies.append(times.e2e_s)
        part.ttfts.append(times.ttft_s)
        if times.tpot_s is not None:
            part.tpots.append(times.tpot_s)
        part.prompts.append(seq.num_prompt)
        part.outputs.append(seq.num_output)

    def _judge(self, missed: list[str], slo_class: str | None = None) -> None:
        """The pods' verdict on one request, in the totals and (classed) in its class."""
        parts: list[Interval | ClassInterval] = [self.current]
        if slo_class is not None:
            parts.append(self.class_iv(slo_class))
        for part in parts:
            part.slo_judged += 1
            part.slo_met += not missed
            for name in [*missed, "all"] if missed else []:
                part.slo_missed[name] = part.slo_missed.get(name, 0) + 1

    def _refuse(self, slo_class: str = DEFAULT_CLASS) -> None:
        """A refused or timed-out request: missed on every stated target (its class's)."""
        self.current.rejected += 1
        self.rejected += 1
        if not self.classed:
            self._judge(list(self._pod_targets()))
            return
        self.class_iv(slo_class).rejected += 1
        self._judge(list(self._class_table()[slo_class][1]), slo_class)

    def _serving_through(self, iv: Interval) -> int:
        """Servers the balancer could reach for the whole interval."""
        start = iv.end_s - self.opt.cadence.interval_s
        return sum(
            s.ready_s <= start
            and (s.drain_s is None or s.drain_s >= iv.end_s)
            and (s.stopped_s is None or s.stopped_s >= iv.end_s)
            for s in self.servers
        )

    async def _close_interval(self) -> None:
        iv = self.current
        live = [s for s in self.servers if s.live]
        iv.waiting_at_end = sum(s.scheduler.num_waiting for s in live)
        iv.running_at_end = sum(s.scheduler.num_running for s in live)
        if self.classed:
            for server in live:
                for name, n in server.scheduler.waiting_by_class().items():
                    self.class_iv(name).waiting_at_end += n
        iv.p99_s = float(np.percentile(iv.latencies, 99)) if iv.latencies else None
        iv.pods = self._serving_through(iv)
        self.intervals.append(iv)
        if self.opt.tune:
            await self.loop.round(self.opt.goal, self.opt.cadence, self.plugs)
        if self.opt.controller is not None:
            await self._controlled_round(self.opt.controller)
        iv.replicas = self.desired
        iv.ready = sum(s.routable for s in self.servers)
        self.current = Interval(
            end_s=iv.end_s + self.opt.cadence.interval_s,
            config=self.config,
            kv_max=max((s.pool.usage_ratio for s in live), default=0.0),
        )
        if self.opt.predictor is not None:
            signals = await self.read(self.opt.cadence.window_s)
            self.current.prediction = self.opt.predictor(
                signals, self.config, self.desired, self.opt.goal.slo, self.loop.memory.points
            )

    async def _controlled_round(self, controller: ReplicaController) -> None:
        observe = getattr(controller, "observe", None)
        if observe is not None:  # a peer planner reads per-engine state the signals lack
            observe(self)
        signals = await self.read(self.opt.cadence.window_s)
        fleet = await self.fleet()
        decision = controller.decide(signals, fleet, self.controller_state, self.now)
        self.controller_state = decision.state
        if decision.replicas != fleet.desired:
            await self.scale(decision)
        self.intervals[-1].scale = decision

    def replica_seconds(self, end_s: float) -> float:
        """Each server from its start (startup included) to its stop after the drain."""
        return sum(
            max(0.0, min(end_s, math.inf if s.stopped_s is None else s.stopped_s) - s.started_s)
            for s in self.servers
        )


def _window_totals(window: list[Interval], interval_s: float) -> WindowTotals:
    """The declared series' totals (signal_fields.py) over the window's intervals, as the
    servers' metrics would show them: samples in the servers' histogram buckets, counts
    summed, gauges as read at the window's end."""
    window_s = len(window) * interval_s
    newer = window[len(window) // 2 :]  # the newer half, as both signal sources read it

    def samples(name: str) -> list[float]:
        return [x for iv in window for x in getattr(iv, name)]

    histograms = {  # histogram -> (the intervals' samples, its bucket bounds)
        names.REQUEST_DURATION: (samples("latencies"), BUCKET_BOUNDS),
        names.QUEUE_WAIT: (samples("queue_waits"), BUCKET_BOUNDS),
        names.TIME_TO_FIRST_TOKEN: (samples("ttfts"), BUCKET_BOUNDS),
        names.REQUEST_TIME_PER_OUTPUT_TOKEN: (samples("tpots"), BUCKET_BOUNDS),
        names.REQUEST_GENERATION_TOKENS: (samples("outputs"), GENERATION_TOKEN_BOUNDS),
        names.REQUEST_PROMPT_TOKENS: (samples("prompts"), GENERATION_TOKEN_BOUNDS),
    }
    # the pods' judgement: requests that met every target, misses per target and "all"
    met = float(sum(iv.slo_met for iv in window))
    slo: dict[tuple[str, str], float] = {("met", names.SLO_ALL): met}
    for iv in window:
        for target, count in iv.slo_missed.items():
            slo["missed", target] = slo.get(("missed", target), 0.0) + count
    return WindowTotals(
        window_s=window_s,
        buckets={
            name: _cumulative_buckets(values, bounds)
            for name, (values, bounds) in histograms.items()
            if values
        },
        sums={
            names.REQUEST_DURATION: sum(samples("latencies")),
            names.BATCH_SIZE: sum(iv.batch_weighted for iv in window),
            names.STEP_DURATION: sum(iv.step_seconds for iv in window),
        },
        counts={
            names.REQUEST_DURATION: float(sum(iv.completed for iv in window)),
            names.REQUESTS_TOTAL: float(sum(iv.completed for iv in window)),
            names.BATCH_SIZE: sum(iv.batch_count for iv in window),
            names.PREEMPTIONS_TOTAL: float(sum(iv.preemptions for iv in window)),
            names.GENERATION_TOKENS_TOTAL: float(sum(iv.tokens for iv in window)),
            names.ENGINE_BUSY_SECONDS_TOTAL: sum(iv.busy_s for iv in window),
            names.STEP_DURATION: float(sum(iv.steps for iv in window)),
            names.STEP_DECODE_ROWS_TOTAL: float(sum(iv.step_decode_rows for iv in window)),
            names.STEP_PREFILL_TOKENS_TOTAL: float(sum(iv.step_prefill_tokens for iv in window)),
            names.STEP_KV_TOKENS_TOTAL: float(sum(iv.step_kv_tokens for iv in window)),
            names.SPEC_DRAFT_TOKENS_TOTAL: float(sum(iv.spec_draft_tokens for iv in window)),
            names.SPEC_ACCEPTED_TOKENS_TOTAL: float(
                sum(iv.spec_accepted_tokens for iv in window)
            ),
        },
        now={
            names.REQUESTS_WAITING: float(window[-1].waiting_at_end),
            names.REQUESTS_RUNNING: float(window[-1].running_at_end),
        },
        peaks={names.KV_CACHE_USAGE: max(iv.kv_max for iv in window)},
        slo=slo,
        arrival_rate=sum(iv.arrived for iv in newer) / (len(newer) * interval_s),
        pods=min(iv.pods for iv in window),
        **_class_totals(window),
    )


# ClassInterval's samples behind each histogram the signals read by class, and its bounds
CLASS_SAMPLES = {
    names.TIME_TO_FIRST_TOKEN: ("ttfts", BUCKET_BOUNDS),
    names.REQUEST_TIME_PER_OUTPUT_TOKEN: ("tpots", BUCKET_BOUNDS),
    names.REQUEST_DURATION: ("latencies", BUCKET_BOUNDS),
    names.REQUEST_GENERATION_TOKENS: ("outputs", GENERATION_TOKEN_BOUNDS),
    names.REQUEST_PROMPT_TOKENS: ("prompts", GENERATION_TOKEN_BOUNDS),
}


def _class_totals(window: list[Interval]) -> dict[str, Any]:
    """WindowTotals' per-class fields (the series' `class` label), as the pods export
    them: each class's latency and length buckets, its SLO verdicts and its requests
    waiting at the window's end (0 for a class none of which waits, as a pod's gauge
    reads)."""
    buckets: dict[str, dict[str, dict[float, float]]] = {}
    slo: dict[str, dict[tuple[str, str], float]] = {}
    for name in sorted({name for iv in window for name in iv.classes}):
        parts = [iv.classes[name] for iv in window if name in iv.classes]
        verdicts = {("met", names.SLO_ALL): float(sum(p.slo_met for p in parts))}
        for part in parts:
            for target, count in part.slo_missed.items():
                verdicts["missed", target] = verdicts.get(("missed", target), 0.0) + count
        slo[name] = verdicts
        buckets[name] = {
            histogram: _cumulative_buckets(values, bounds)
            for histogram, (attr, bounds) in CLASS_SAMPLES.items()
            if (values := [x for p in parts for x in getattr(p, attr)])
        }
    last = window[-1].classes
    waiting = {name: float(last[name].waiting_at_end if name in last else 0) for name in slo}
    return {"class_buckets": buckets, "class_slo": slo, "class_waiting": waiting}


def _prefill_tokens(plan: StepPlan) -> int:
    """The prompt tokens a step is timed by: its chunks, and each verify row's newest
    token and draft (computed as a prefill chunk, as `StepPlan.work` counts them). Timed
    as if computed, as the single-server simulator always did: an unchunked prefill then
    costs what a one-row step does."""
    return sum(plan.chunks or []) + sum(len(draft) + 1 for draft in plan.drafts)


def _kv_tokens(plan: StepPlan) -> int:
    """The KV tokens a step's rows attend to once computed: each row's context."""
    prefill = zip(plan.prefill, plan.chunk_sizes(), strict=True)
    verify = zip(plan.verify, plan.drafts, strict=True)
    return (
        sum(seq.num_computed + size for seq, size in prefill)
        + sum(seq.num_tokens + len(draft) for seq, draft in verify)
        + sum(seq.num_tokens for seq in plan.decode)
    )


def _steps_starting_before(span_s: float, first_s: float, growth_s: float) -> int:
    """How many back-to-back steps start within `span_s` when the first takes `first_s`
    and each later one `growth_s` more: the largest k with k-1 steps ending before it."""
    if growth_s <= 0 or span_s <= 0:
        return math.ceil(span_s / first_s)

    def ends_s(m: int) -> float:  # the first m steps' seconds
        return m * first_s + growth_s * m * (m - 1) / 2

    low, high = 0, max(1, math.ceil(span_s / first_s))  # m < high: ends_s(high) >= span
    while low < high:
        mid = (low + high + 1) // 2
        if ends_s(mid) < span_s:
            low = mid
        else:
            high = mid - 1
    return low + 1


def _cumulative_buckets(
    values: list[float] | list[int], bounds: tuple[float, ...]
) -> dict[float, float]:
    """le -> how many of `values` a server's histogram with these bounds (ending +Inf)
    counts at or below it."""
    counts = np.searchsorted(np.asarray(bounds[:-1]), np.asarray(values), side="left")
    cumulative = np.cumsum(np.bincount(counts, minlength=len(bounds)))
    return dict(zip(bounds, cumulative.astype(float).tolist(), strict=True))


def simulate(
    scenario: Scenario,
    options: SimOptions,
    curve: StepCurve,
    seed: int = 0,
    drain_s: float = 0.0,
) -> SimResult:
    """Play `scenario` once; the tuning loop runs every interval when `options.tune`.

    `drain_s` keeps the servers running that long after the last arrival window.
    """
    work = make_workload(scenario, seed)
    return simulate_workload(work, options, curve, scenario.duration_s + drain_s)


def simulate_workload(
    work: Workload,
    options: SimOptions,
    curve: StepCurve,
    run_s: float,
    cost_until_s: float | None = None,
) -> SimResult:
    """Play `work` for `run_s`; `cost_until_s`: count replica-seconds only until then (a
    drain after the load, played to see every request answered, costs nothing)."""
    fleet = SimulatedFleet(work, options, curve)
    asyncio.run(fleet.run(run_s))
    classes = _run_class_totals(fleet, run_s) if fleet.classed else {}
    # Requests still queued or running at the end count as not good.
    ended = [*fleet.intervals, fleet.current]
    latencies = fleet.all_latencies
    return SimResult(
        intervals=fleet.intervals,
        completed=sum(iv.completed for iv in ended),
        good=sum(iv.good for iv in ended),
        rejected=fleet.rejected,
        arrived=len(work.arrivals),
        duration_s=run_s,
        p99_s=float(np.percentile(latencies, 99)) if latencies else None,
        completions=fleet.completions,
        batch_sizes=fleet.batch_sizes,
        routes=fleet.routes,
        replica_seconds=fleet.replica_seconds(run_s if cost_until_s is None else cost_until_s),
        classes=classes,
    )


def _run_class_totals(fleet: SimulatedFleet, run_s: float) -> dict[str, ClassTotals]:
    """Each class over the run (the interval still open at the end included)."""
    ended = [*fleet.intervals, fleet.current]
    held = list(fleet.sequences)  # admitted, not ended
    totals = {}
    for name in dict.fromkeys(fleet.work.classes):
        parts = [iv.classes[name] for iv in ended if name in iv.classes]
        unstarted = [run_s - s.arrival for s in held
                     if s.slo_class == name and s.first_scheduled is None]  # fmt: skip
        waits = [w for p in parts for w in p.queue_waits] + unstarted
        totals[name] = ClassTotals(
            arrived=sum(p.arrived for p in parts),
            completed=sum(p.completed for p in parts),
            good=sum(p.good for p in parts),
            rejected=sum(p.rejected for p in parts),
            unfinished=sum(s.slo_class == name for s in held),
            max_wait_s=max(waits, default=0.0),
        )
    return totals


def static(options: SimOptions, config: BatchingConfig) -> SimOptions:
    """The same run with a fixed config and no tuner."""
    return replace(options, config=config, tune=False)
