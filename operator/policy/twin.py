"""The digital twin: one candidate's next window played by the real continuous scheduler
under the fitted step time.

Pure and deterministic (a fixed seed). Where the predictor (predictor.py) approximates
the queue, the twin runs it: for a candidate (batch B, timeout T, budget G, N pods) each
pod runs the engine's own `ContinuousScheduler` over a `BlockPool` for the window's
length on one virtual clock, and each step it plans takes what the fitted plane says
(`StepModel.step_s(decode rows, prompt tokens, KV tokens attended)`), so chunked
prefill, admission, preemption and the batch ceiling are the server's code, not a
formula. The demand:

- arrivals: Poisson at the window's forecast, each sent to the pod with the fewest
  outstanding requests (ties in turn), as the fleet's balancer does: an even random
  split instead put two long prompts on one pod often enough to read a p99 TTFT 1.5x
  the measured one at half load;
- lengths: drawn from the window's measured prompt and output distributions
  (`lengths_of`: eight quantile slices), through the quantile function the slices'
  midpoints give;
- the state at t=0: the window's backlog and running sequences split evenly over the
  N pods. The backlog waits in arrival order (FIFO: the waiting requests are the latest
  arrivals, so the i-th from the tail arrived i / the measured arrival rate ago, and
  that wait counts in its TTFT); the running ones decode part-way through their answer
  and are not judged (their first token was the last window's);
- the KV pool: the window's capacity where it tells it (`kv_capacity_tokens`), else
  room for everything the run holds.

Requests are judged as the pods judge them (TTFT, TPOT, end to end against the stated
targets; a refused one misses all) when they finish within the window, as a window's
measured p99s count only the requests that finished in it. The capacity figures
(`per_pod_rps`, `utilisation`) are the predictor's: a window's run shows tails, not the
throughput with every slot held.

Decode-only stretches are fast-forwarded as the simulator does (tools/simulator.py):
after a step that finished nothing, while no request could be admitted, the next steps
plan the same rows again, so they are applied at once up to the first that finishes a
request, an arrival that could be admitted, the window's end or the pool's last block.

`simulate(window, model, candidate)` takes `predict`'s arguments and returns its type, so
the chooser can call either. Its cost (bench/predictor_twin.py, one core): about 0.03 s
a candidate at the LLM scenarios' loads, 3.7 s for a round's grid of 112.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np
from batchpilot_operator.policy.predictor import (
    Candidate,
    Prediction,
    kv_capacity_tokens,
    lengths_of,
    predict,
)
from batchpilot_operator.policy.step_model import StepModel
from batchpilot_operator.policy.types import Cadence
from batchpilot_operator.policy.window import Lengths, Window
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.scheduler_continuous import ContinuousScheduler
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine.step_plan import StepPlan
from batchpilot_server.engine_api import EngineOptions, QueueFullError, SamplingParams

SEED = 0
BLOCK_SIZE = EngineOptions(mode="continuous", config=BatchingConfig()).block_size
SAMPLED = 0  # what the twin's model "samples": never an end of sequence
QUANTILE = 99.0


@dataclass(frozen=True)
class Demand:
    """What the candidate's fleet meets over the window."""

    arrival_rps: float  # the window's forecast, all pods
    queued_rps: float  # the measured arrivals per pod: the backlog's ages
    backlog: int  # per pod
    running: int  # per pod
    prompts: Lengths
    outputs: Lengths
    kv_blocks: int | None  # per pod; None: the window cannot tell the pool's size

    @classmethod
    def of(cls, window: Window, candidate: Candidate) -> Demand | None:
        """The window's demand on the candidate's pods; None without lengths."""
        lengths = lengths_of(window.signals)
        if lengths is None:
            return None
        pods = max(1, candidate.replicas)
        capacity = kv_capacity_tokens(window.signals)
        return cls(
            arrival_rps=window.forecast_rps,
            queued_rps=window.arrival_rps / pods,
            backlog=round(window.backlog / pods),
            running=round(window.signals.running / pods),
            prompts=lengths[0],
            outputs=lengths[1],
            kv_blocks=None if capacity is None else int(capacity // BLOCK_SIZE),
        )


@dataclass
class Tally:
    """The judged requests of a run."""

    ttfts: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)  # answers of two tokens or more
    e2es: list[float] = field(default_factory=list)
    judged: int = 0
    met: int = 0
    offered: int = 0  # requests the window held or brought (backlog and arrivals)
    steps: int = 0
    step_seconds: float = 0.0
    kv_peak: float = 0.0  # the fullest pool's usage

    def finish(self, slo: Slo, arrival: float, first: float, end: float, outputs: int) -> None:
        tpot = (end - first) / (outputs - 1) if outputs > 1 else None
        observed = {"ttft": first - arrival, "tpot": tpot, "e2e": end - arrival}
        self.ttfts.append(first - arrival)
        if tpot is not None:
            self.tpots.append(tpot)
        self.e2es.append(end - arrival)
        self.judged += 1
        # a one-token answer has no TPOT to miss, as the pods judge it
        self.met += all(
            (value := observed[name]) is None or value <= target
            for name, target in slo.stated.items()
        )

    def refuse(self) -> None:
        self.judged += 1  # a full queue: every target missed

    @property
    def attainment(self) -> float:
        """Judged requests meeting every target; none judged: 1 if none came, else 0 (none
        of what came finished within the window)."""
        if self.judged:
            return self.met / self.judged
        return 0.0 if self.offered else 1.0

    def p99(self, values: list[float]) -> float:
        if values:
            return float(np.percentile(values, QUANTILE))
        return math.inf if self.offered else 0.0


def simulate(
    window: Window,
    model: StepModel,
    candidate: Candidate,
    *,
    duration_s: float | None = None,
    seed: int = SEED,
) -> Prediction | None:
    """The candidate's prediction from a run of its pods for `duration_s` (None: the
    window's length); None where the window has no lengths (as `predict`)."""
    base = predict(window, model, candidate)
    demand = Demand.of(window, candidate)
    if base is None or demand is None:
        return None
    length_s = duration_s or window.signals.window_s or Cadence().window_s
    config = candidate.config(BatchingConfig())
    rng = np.random.default_rng(seed)
    tally = _Fleet(config, model, demand, max(1, candidate.replicas), rng).play(
        window.slo, length_s
    )
    return replace(
        base,
        ttft_p99_s=tally.p99(tally.ttfts),
        tpot_p99_s=tally.p99(tally.tpots),
        e2e_p99_s=tally.p99(tally.e2es),
        attainment=tally.attainment,
        step_s=tally.step_seconds / tally.steps if tally.steps else base.step_s,
        kv_use=tally.kv_peak if demand.kv_blocks is not None else base.kv_use,
    )


def draw_lengths(lengths: Lengths, rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` lengths through the quantile function whose points are the slices' midpoints
    (flat beyond the first and last): the grid's shape without its eight-value steps."""
    weights = np.array([w for w, _ in lengths])
    tokens = np.array([t for _, t in lengths])
    middles = np.cumsum(weights) - weights / 2
    return np.maximum(1, np.round(np.interp(rng.random(n), middles, tokens))).astype(int)


def _sequence(index: int, prompt: int, output: int, arrival: float) -> Sequence:
    return Sequence(
        request_id=str(index),
        prompt_ids=[0] * int(prompt),
        params=SamplingParams(max_tokens=int(output), ignore_eos=True),
        arrival=arrival,
        deadline=None,
        generator=None,
    )


def _prefill_tokens(plan: StepPlan) -> int:
    return sum(plan.chunks or [])


def _kv_tokens(plan: StepPlan) -> int:
    """The KV tokens a step's rows attend to once computed (what the pods' counter
    `step_kv_tokens`, and so the fit, counts): each row's context."""
    prefill = zip(plan.prefill, plan.chunk_sizes(), strict=True)
    return sum(seq.num_computed + size for seq, size in prefill) + sum(
        seq.num_tokens for seq in plan.decode
    )


class _Fleet:
    """The candidate's pods on one virtual clock behind a least-outstanding balancer."""

    def __init__(
        self,
        config: BatchingConfig,
        model: StepModel,
        demand: Demand,
        pods: int,
        rng: np.random.Generator,
    ) -> None:
        self.config, self.model, self.demand, self.rng = config, model, demand, rng
        self.size = pods
        self.tally = Tally()

    def play(self, slo: Slo, duration_s: float) -> Tally:
        d = self.demand
        arrivals = self._arrivals(duration_s)
        blocks = d.kv_blocks
        if blocks is None:  # unknown size: room for every request of the run at its longest
            longest = max(t for _, t in d.prompts) + max(t for _, t in d.outputs)
            blocks = (d.backlog + d.running + len(arrivals) + 1) * (int(longest) // BLOCK_SIZE + 2)
        pods = [_Pod(self.config, self.model, max(1, blocks), self.tally) for _ in range(self.size)]
        for pod in pods:
            pod.seed_running(self._lengths(d.running, least=2), self.rng)
            pod.seed_backlog(self._lengths(d.backlog), d.queued_rps)
        self.tally.offered = d.backlog * self.size + len(arrivals)
        prompts, outputs = self._lengths(len(arrivals))
        # each pod plans at `due[i]`: its step's end, its wake-up, or an arrival routed to it
        due = [0.0] * self.size
        turn = next_index = 0
        while True:
            arrival = float(arrivals[next_index]) if next_index < len(arrivals) else math.inf
            first = min(range(self.size), key=lambda i: due[i])
            if arrival <= min(due[first], duration_s):  # arrivals first at one instant
                order = [(turn + k) % self.size for k in range(self.size)]
                chosen = min(order, key=lambda i: pods[i].outstanding)
                turn += 1
                seq = _sequence(next_index, prompts[next_index], outputs[next_index], arrival)
                pods[chosen].add(seq)
                if not pods[chosen].busy:
                    due[chosen] = min(due[chosen], arrival)
                next_index += 1
                continue
            if due[first] >= duration_s:
                return self.tally
            due[first] = pods[first].act(due[first], slo, duration_s, arrival)

    def _arrivals(self, duration_s: float) -> np.ndarray:
        """Poisson arrival times over the run."""
        rate = self.demand.arrival_rps
        if rate <= 0:
            return np.array([])
        expected = rate * duration_s
        gaps = self.rng.exponential(1 / rate, int(expected + 6 * math.sqrt(expected) + 10))
        times = np.cumsum(gaps)
        return times[times < duration_s]

    def _lengths(self, n: int, least: int = 1) -> tuple[np.ndarray, np.ndarray]:
        prompts = draw_lengths(self.demand.prompts, self.rng, n)
        return prompts, np.maximum(least, draw_lengths(self.demand.outputs, self.rng, n))


class _Pod:
    """One pod: the real scheduler and its pool, stepping by the fitted step time."""

    def __init__(self, config: BatchingConfig, model: StepModel, blocks: int, tally: Tally) -> None:
        self.model = model
        self.pool = BlockPool(blocks, BLOCK_SIZE)
        self.scheduler = ContinuousScheduler(self.pool, config, frozenset())
        self.tally = tally
        self.busy = False  # computing a step (or fast-forwarded steps) until its `due`
        self.judged: set[Sequence] = set()  # the backlog and the arrivals, not the running
        self.first_token: dict[Sequence, float] = {}

    @property
    def outstanding(self) -> int:
        """What least-outstanding routing counts: waiting plus running."""
        return self.scheduler.num_waiting + self.scheduler.num_running

    def seed_running(
        self, lengths: tuple[np.ndarray, np.ndarray], rng: np.random.Generator
    ) -> None:
        """The sequences in flight at t=0, each part-way through its answer (uniformly)."""
        for i, (prompt, output) in enumerate(zip(*lengths, strict=True)):
            seq = _sequence(-1 - i, prompt, output, 0.0)
            seq.advance(0, [SAMPLED] * int(rng.integers(1, output)))
            if not self.pool.grow(seq.block_table, seq.num_tokens):
                return  # the pool holds no more: the rest had been preempted
            seq.admit(seq.num_tokens - 1)  # decoding: only its newest token uncomputed
            self.scheduler.running.append(seq)

    def seed_backlog(self, lengths: tuple[np.ndarray, np.ndarray], rate: float) -> None:
        """The waiting requests at t=0, oldest first; the i-th from the tail arrived
        i / the measured arrival rate ago (module docstring)."""
        prompts, outputs = lengths
        n = len(prompts)
        for i in range(n):
            age = (n - i) / rate if rate > 0 else 0.0
            self.add(_sequence(-1 - i, prompts[i], outputs[i], -age))

    def add(self, seq: Sequence) -> None:
        try:
            self.scheduler.add(seq)
        except QueueFullError:
            self.tally.refuse()
        else:
            self.judged.add(seq)

    def act(self, now: float, slo: Slo, duration_s: float, arrival_s: float) -> float:
        """Plan at `now` and run the step; when it plans next (inf: at an arrival)."""
        plan = self.scheduler.schedule(now)
        if not plan.size:
            self.busy = False
            wake = self.scheduler.wake_at()
            return wake if wake is not None and wake > now else math.inf
        self.busy = True
        return self._step(plan, now, slo, duration_s, arrival_s)

    def _step(
        self, plan: StepPlan, now: float, slo: Slo, duration_s: float, arrival_s: float
    ) -> float:
        """Run `plan` and the decode steps that repeat it; when the pod is free again."""
        seconds = self.model.step_s(len(plan.decode), _prefill_tokens(plan), _kv_tokens(plan))
        end = now + seconds
        self._count(1, seconds)
        rows = plan.sampling()
        for seq in rows:  # a recomputed (preempted) sequence's first token came earlier
            self.first_token.setdefault(seq, end)
        # applied now rather than at `end`: nothing reads this pod's sequences meanwhile
        # but the balancer's count, which a finishing request leaves a step early
        outputs = self.scheduler.postprocess(plan, [SAMPLED] * len(rows), [0.0] * len(rows), end)
        for output in outputs:
            if output.final and output.seq in self.judged and end <= duration_s:
                seq = output.seq
                self.tally.finish(slo, seq.arrival, self.first_token[seq], end, seq.num_output)
        going_on = [seq for seq in rows if seq.finish_reason is None]
        return end + self._fast_forward(going_on, end, min(duration_s, arrival_s), duration_s)

    def _count(self, steps: int, seconds: float) -> None:
        self.tally.steps += steps
        self.tally.step_seconds += seconds
        self.tally.kv_peak = max(self.tally.kv_peak, self.pool.usage_ratio)

    def _fast_forward(
        self, decode: list[Sequence], now: float, arrival_s: float, duration_s: float
    ) -> float:
        """Apply the next decode steps that plan exactly `decode` and finish none of them
        (module docstring); their seconds."""
        scheduler = self.scheduler
        if not decode or len(decode) != scheduler.num_running or scheduler.may_admit(now):
            return 0.0
        # an arrival matters only where it could be admitted: no queue ahead of it, room;
        # any arrival bounds it, as the balancer picks its pod only when it comes
        until = arrival_s if not scheduler.num_waiting else duration_s
        if len(decode) >= scheduler.config.max_batch_size:
            until = duration_s
        context = sum(seq.num_tokens for seq in decode)
        first_s = self.model.step_s(len(decode), 0, context)
        growth_s = self.model.per_kv_s * len(decode)  # each later step attends one more a row
        steps = min(
            min(seq.params.max_tokens - seq.num_output for seq in decode) - 1,
            _steps_starting_before(until - now, first_s, growth_s),
        )
        steps = self._blocks_allow(decode, steps)
        if steps <= 0:
            return 0.0
        for seq in decode:
            self.pool.grow(seq.block_table, seq.num_tokens + steps - 1)
            seq.advance(steps, [SAMPLED] * steps)
        seconds = steps * first_s + growth_s * steps * (steps - 1) / 2
        self._count(steps, seconds)
        return seconds

    def _blocks_allow(self, decode: list[Sequence], steps: int) -> int:
        """The most steps (<= `steps`) the pool has blocks for without a preemption."""

        def needed(k: int) -> int:
            return sum(
                self.pool.blocks_for(seq.num_tokens + k - 1) - len(seq.block_table)
                for seq in decode
            )

        low, high = 0, max(0, steps)
        while low < high:
            mid = (low + high + 1) // 2
            low, high = (mid, high) if needed(mid) <= self.pool.num_free else (low, mid - 1)
        return low


def _steps_starting_before(span_s: float, first_s: float, growth_s: float) -> int:
    """How many back-to-back steps start within `span_s` when the first takes `first_s`
    and each later one `growth_s` more: the first m end at `m first + growth m (m-1) / 2`,
    so this is the ceiling of that quadratic's positive root (in its stable form)."""
    if span_s <= 0:
        return 0
    if math.isinf(span_s):
        return 1 << 30
    b = max(first_s, 1e-9) - growth_s / 2
    root = 2 * span_s / (b + math.sqrt(b * b + 2 * growth_s * span_s))
    return math.ceil(root)
