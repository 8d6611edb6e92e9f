"""The tuner: a pure, deterministic function from signals to the next config.

No I/O, no clock, no randomness: the same (signals, config in force, goal,
state) always gives the same decision. `tuning_loop.TuningLoop` is its one
caller; the operator, `batchpilot tune`, `batchpilot demo` and the simulator
all drive that loop.

The rule (SLO-aware AIMD in the spirit of Clipper, with a diagnosis of *why*
the p99 is what it is: the p99 splits into queue wait and running time;
`docs/tuning.md` explains each constant):

1. bounds first: a config outside the policy's bounds is clamped into them;
2. hold when the window has no data, too little or no traffic;
3. KV guard: KV usage at the high watermark or any preemption cuts the batch
   multiplicatively, whatever the latency headroom says;
4. cooldown (none by default: the loop trims the window at a change instead);
5. hold when the window has no p99;
6. p99 above the SLO:
   - running alone breaks the SLO: back off the batch multiplicatively (that
     size becomes a ceiling for probing), unless requests also queue for half
     the p99 - then no batch size helps and the tuner holds;
   - else queueing pushes it over: halve the timeout when the timeout explains
     the wait and batches fire underfilled, otherwise grow the batch
     multiplicatively (capacity is short), up to the bound;
7. p99 under the hysteresis band: grow the batch additively while requests
   queue behind full batches; with ample headroom, underfilled batches and no
   queueing, let the timeout grow toward fuller batches (capped at a share
   of the SLO);
8. inside the band: grow additively only if queueing is half the p99 (act
   before the SLO breaks), else hold.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import cached_property
from typing import Any, Literal

from batchpilot_operator.capacity_model import (
    TRUSTED_WINDOWS,
    CapacityModel,
    StepSample,
    fit,
    of_fleet,
    remember,
    sample_of,
)
from batchpilot_operator.replica_rule import SCALE_OUT_UTILISATION, Capacity, ReplicaBounds
from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import BatchingConfig

Action = Literal[
    "hold",
    "clamp",
    "kv_guard",
    "grow_batch",
    "backoff_batch",
    "shrink_timeout",
    "grow_timeout",
]


@dataclass(frozen=True)
class Bounds:
    """The range the tuner may move each knob in; the one bounds type of the project."""

    min_batch: int = 1
    max_batch: int = 64
    min_timeout_ms: float = 0.0
    max_timeout_ms: float = 200.0
    # continuous mode's prompt tokens per step (the CRD's batching.prefillTokenBudget)
    min_prefill_budget: int = 2048
    max_prefill_budget: int = 2048

    def __post_init__(self) -> None:
        if not 1 <= self.min_batch <= self.max_batch:
            raise ValueError(
                f"batch bounds must satisfy 1 <= min <= max, got {self.min_batch}..{self.max_batch}"
            )
        if not 0 <= self.min_timeout_ms <= self.max_timeout_ms:
            raise ValueError(
                "timeout bounds must satisfy 0 <= min <= max, got "
                f"{self.min_timeout_ms:g}..{self.max_timeout_ms:g} ms"
            )
        if not 1 <= self.min_prefill_budget <= self.max_prefill_budget:
            raise ValueError(
                "prefill token budget bounds must satisfy 1 <= min <= max, got "
                f"{self.min_prefill_budget}..{self.max_prefill_budget}"
            )

    def clamp(self, config: BatchingConfig) -> BatchingConfig:
        batch = min(max(config.max_batch_size, self.min_batch), self.max_batch)
        timeout = min(max(config.batch_timeout_ms, self.min_timeout_ms), self.max_timeout_ms)
        budget = min(
            max(config.prefill_token_budget, self.min_prefill_budget), self.max_prefill_budget
        )
        return replace(
            config,
            max_batch_size=batch,
            batch_timeout_ms=float(timeout),
            prefill_token_budget=budget,
        )

    def contains(self, config: BatchingConfig) -> bool:
        return self.clamp(config) == config


@dataclass(frozen=True)
class TunerParams:
    """The rule's constants; `docs/tuning.md` gives the reasoning for each."""

    band: float = 0.2  # grow only while p99 < (1 - band) * SLO
    ample_headroom: float = 0.5  # the timeout grows only while p99 < ample * SLO
    additive_step: int = 4  # batch growth under queueing with headroom
    capacity_factor: float = 1.5  # batch growth when the breach is queueing
    backoff_factor: float = 0.7  # batch cut when the batch itself is too slow
    kv_cut_factor: float = 0.75  # batch cut by the KV guard
    timeout_cut_factor: float = 0.5
    timeout_step_share: float = 0.02  # timeout growth, as a share of the SLO
    timeout_budget_share: float = 0.1  # the timeout never exceeds this share of the SLO
    full_batch_share: float = 0.8  # mean batch >= share * max counts as "full"
    queue_share: float = 0.5  # queue wait >= share * p99: queueing is half the story
    service_share: float = 1.0  # p99 less queue wait above share * SLO: the batch is too slow
    timeout_explains: float = 2.0  # queue wait <= this x timeout: the timeout causes it
    queueing_share: float = 0.05  # queue wait p99 >= share * SLO: requests queue
    # Extra intervals to skip after a change. The loops already trim the signal
    # window at the last change (`signal_window_s`), so none are needed by default.
    cooldown_intervals: int = 0
    ceiling_ttl_intervals: int = 20  # how long a breach caps growth
    # The capacity model sizes the batch so each pod is at most this busy.
    busy_target: float = SCALE_OUT_UTILISATION


@dataclass(frozen=True)
class Goal:
    """What a policy asks of the tuner: the SLO, the knobs' bounds, the rule's constants."""

    slo: Slo
    bounds: Bounds = field(default_factory=Bounds)
    params: TunerParams = field(default_factory=TunerParams)
    replicas: ReplicaBounds | None = None  # None: the loop leaves the replica count alone


@dataclass(frozen=True)
class Cadence:
    """How often the loop decides, and how much history a decision reads at most."""

    interval_s: float = 30.0
    window_s: float = 60.0

    def __post_init__(self) -> None:
        if self.interval_s <= 0 or self.window_s <= 0:
            raise ValueError("the interval and the window must be positive")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"the window ({self.window_s:g} s) must be at least the interval "
                f"({self.interval_s:g} s): each decision needs a full interval of data"
            )


SINCE_CHANGE_CAP = 1000


@dataclass(frozen=True)
class TunerState:
    """What the tuner remembers between intervals, kept in memory by each tuning loop."""

    cooldown: int = 0
    # Intervals decided since the last change; a fresh tuner has made none, so its
    # first window is a full one.
    since_change: int = SINCE_CHANGE_CAP
    ceiling: int | None = None  # batch size that last broke the SLO or the KV guard
    ceiling_age: int = 0
    samples: tuple[StepSample, ...] = ()  # the capacity model's recent windows

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> TunerState:
        if not data:
            return cls()
        ceiling = data.get("ceiling")
        return cls(
            cooldown=max(0, int(data.get("cooldown", 0))),
            since_change=max(0, int(data.get("since_change", SINCE_CHANGE_CAP))),
            ceiling=None if ceiling is None else int(ceiling),
            ceiling_age=max(0, int(data.get("ceiling_age", 0))),
            samples=tuple(
                StepSample(
                    float(item["batch"]), float(item["iteration_s"]), int(item.get("pods", 0))
                )
                for item in data.get("samples") or ()
            ),
        )


@dataclass(frozen=True)
class Decision:
    config: BatchingConfig
    action: Action
    reason: str
    state: TunerState = field(default_factory=TunerState)
    # The capacity model's view of this round (None without a model), and whether the
    # knobs can add no more capacity: what the replica rule needs to know.
    capacity: Capacity | None = None
    spent: bool = False


def decide(
    signals: Signals, current: BatchingConfig, goal: Goal, state: TunerState
) -> Decision:
    """The next batching config for these signals; see the module docstring."""
    state = replace(state, samples=remember(state.samples, sample_of(signals)))
    case = _Case(signals, current, goal, state)
    case = replace(case, capacity=_capacity(case))
    decision = _decide(case)
    decision = replace(decision, capacity=case.capacity, spent=_spent(case, decision))
    if decision.config == current:
        held = decision.state
        since = min(held.since_change + 1, SINCE_CHANGE_CAP)
        return replace(decision, state=replace(held, since_change=since))
    return decision


@dataclass(frozen=True)
class _Case:
    """One decision's inputs, and the two ways a step of the rule answers."""

    signals: Signals
    current: BatchingConfig
    goal: Goal
    state: TunerState
    capacity: Capacity | None = None

    @cached_property
    def model(self) -> CapacityModel | None:
        # read by several steps of one decision; a new state makes a new case
        return fit(of_fleet(self.state.samples, self.signals.pods))

    @property
    def batch(self) -> int:
        return self.current.max_batch_size

    @property
    def timeout(self) -> float:
        return self.current.batch_timeout_ms

    @property
    def slo_s(self) -> float:
        return _e2e_target(self.goal.slo)

    @property
    def bounds(self) -> Bounds:
        return self.goal.bounds

    @property
    def p(self) -> TunerParams:
        return self.goal.params

    def hold(self, reason: str, state: TunerState | None = None) -> Decision:
        return Decision(self.current, "hold", reason, self.state if state is None else state)

    def change(
        self,
        action: Action,
        reason: str,
        *,
        batch: int | None = None,
        timeout: float | None = None,
        ceiling: int | None = None,
    ) -> Decision:
        config = replace(
            self.current,
            max_batch_size=self.batch if batch is None else batch,
            batch_timeout_ms=self.timeout if timeout is None else timeout,
        )
        return Decision(config, action, reason, _after_change(self.state, self.p, ceiling))


def _decide(case: _Case) -> Decision:
    signals, bounds = case.signals, case.bounds
    if not bounds.contains(case.current):
        clamped = bounds.clamp(case.current)
        return Decision(
            clamped, "clamp", _describe_clamp(case.current, clamped),
            _after_change(case.state, case.p),
        )  # fmt: skip
    if not signals.ok:
        why = signals.detail or signals.status.replace("_", " ")
        return case.hold(f"{signals.status.replace('_', ' ')}: {why}")
    case = replace(case, state=_age_ceiling(case.state, case.p))
    kv = _kv_guard(case)
    if kv is not None:
        return kv
    if case.state.cooldown > 0:
        return case.hold(
            f"cooldown: {case.state.cooldown} more interval(s) until the window reflects "
            "the last change",
            replace(case.state, cooldown=case.state.cooldown - 1),
        )
    p99 = signals.p99_latency_s
    if p99 is None:
        return case.hold("no p99 in the window")
    if p99 > case.slo_s:
        return _on_breach(case, p99)
    if p99 < (1 - case.p.band) * case.slo_s:
        return _on_headroom(case, p99)
    return _in_band(case, p99)


def _kv_guard(case: _Case) -> Decision | None:
    signals, slo = case.signals, case.goal.slo
    kv = signals.kv_usage
    kv_high = kv is not None and kv >= slo.kv_high_watermark
    if not kv_high and signals.preemption_rate <= 0:
        return None
    cause = (
        f"KV usage {kv:.2f} >= watermark {slo.kv_high_watermark:.2f}"
        if kv_high and kv is not None
        else f"{signals.preemption_rate:.2f} preemptions/s"
    )
    if case.state.cooldown > 0:
        return case.hold(
            f"{cause}, but the window still shows the config before the last change",
            replace(case.state, cooldown=case.state.cooldown - 1),
        )
    batch = case.batch
    if batch <= case.bounds.min_batch:
        return case.hold(f"{cause} at the minimum batch {batch}")
    new_batch = _cut_batch(case, case.p.kv_cut_factor)
    return case.change(
        "kv_guard", f"{cause}: batch {batch} -> {new_batch}", batch=new_batch, ceiling=batch
    )


def _on_breach(case: _Case, p99: float) -> Decision:
    signals, bounds, p = case.signals, case.bounds, case.p
    batch, timeout = case.batch, case.timeout
    head = f"p99 {_ms(p99)} > SLO {_ms(case.slo_s)}"
    queue_wait = min(p99, signals.queue_wait_p99_s or 0.0)
    service, basis = _running(case)
    # Without a model, a running time read as p99 less queue wait under heavy queueing is
    # mostly the queue's: trust it only where queueing is under half the p99.
    trusted = case.model is not None or queue_wait < p.queue_share * p99
    if _running_too_slow(case) and trusted:
        if queue_wait >= p.queue_share * p99:
            # Both halves break the SLO: a smaller batch queues more, a larger one runs
            # slower. Moving would only add noise; say so and wait for the load to drop.
            return case.hold(
                f"{head}: overloaded, running ~{_ms(service)} and queueing "
                f"{_ms(queue_wait)} both exceed what the SLO allows; no batch size fixes it"
            )
        # Running alone takes too long: a smaller batch makes every step shorter.
        if batch > bounds.min_batch:
            new_batch = _cut_batch(case, p.backoff_factor)
            floor, carried = _carrying_floor(case)
            running = f"{head} while running ({basis} ~{_ms(service)})"
            if new_batch < floor:
                if floor >= batch:
                    return case.hold(
                        f"{running}, but {carried}: a smaller batch only rebuilds the queue"
                    )
                running += f"; the cut stops at batch {floor}, as {carried}"
                new_batch = floor
            return case.change(
                "backoff_batch",
                f"{running}: batch {batch} -> {new_batch}",
                batch=new_batch,
                ceiling=batch,
            )
        return case.hold(f"{head} at the minimum batch: nothing left to cut")
    # The time is spent queued: either the timeout holds requests back, or capacity is short.
    if (
        timeout > bounds.min_timeout_ms
        and _underfilled(case)
        and queue_wait <= p.timeout_explains * case.current.batch_timeout_s
    ):
        new_timeout = _cut_timeout(case)
        return case.change(
            "shrink_timeout",
            f"{head}, queue wait p99 {_ms(queue_wait)} is the timeout's doing and batches fire "
            f"underfilled (mean {signals.mean_batch_size:.1f} of {batch}): "
            f"timeout {timeout:g} -> {new_timeout:g} ms",
            timeout=new_timeout,
        )
    predicted = _predicted_growth(case, f"{head} from queueing", overloaded=True)
    if predicted is not None:
        return predicted
    # Without a model, capacity growth ignores the probing ceiling: a ceiling learnt at
    # another load must not keep requests queued; if the bigger batch runs too slowly,
    # the next window says so and the batch backs off again.
    if batch < bounds.max_batch:
        new_batch = min(bounds.max_batch, _capacity_step(case))
        return case.change(
            "grow_batch",
            f"{head} from queueing (queue wait p99 {_ms(queue_wait)}, running ~{_ms(service)}): "
            f"capacity short, batch {batch} -> {new_batch}",
            batch=new_batch,
        )
    return case.hold(
        f"{head} from queueing at the maximum batch {batch}: the load exceeds what the "
        "SLO allows"
    )


def _on_headroom(case: _Case, p99: float) -> Decision:
    bounds, p = case.bounds, case.p
    batch, timeout = case.batch, case.timeout
    head = f"p99 {_ms(p99)} < {_ms((1 - p.band) * case.slo_s)}"
    limit = _growth_limit(case)
    if _queueing(case) and _full(case) and batch < limit:
        predicted = _predicted_growth(case, f"{head} and requests queue behind full batches")
        if predicted is not None:
            return predicted
        new_batch = min(limit, batch + p.additive_step)
        return case.change(
            "grow_batch",
            f"{head} and requests queue behind full batches: batch {batch} -> {new_batch}",
            batch=new_batch,
        )
    ahead = _sized_ahead(case, head, limit)
    if ahead is not None:
        return ahead
    timeout_cap = min(bounds.max_timeout_ms, p.timeout_budget_share * case.slo_s * 1000)
    step = max(1.0, p.timeout_step_share * case.slo_s * 1000)
    # Rounded to whole microseconds so that reaching the cap ends the growth.
    new_timeout = max(timeout, round(min(timeout_cap, timeout + step), 3))
    if (
        p99 < p.ample_headroom * case.slo_s
        and _underfilled(case)
        and not _queueing(case)
        and new_timeout > timeout
    ):
        return case.change(
            "grow_timeout",
            f"p99 {_ms(p99)} < {_ms(p.ample_headroom * case.slo_s)} and batches fire "
            f"underfilled: timeout {timeout:g} -> {new_timeout:g} ms for fuller batches",
            timeout=new_timeout,
        )
    why = "no queueing: a larger batch would not be used"
    if batch >= limit and _queueing(case):
        why = f"batch {batch} is at its limit {limit}"
    return case.hold(f"{head}; {why}")


def _in_band(case: _Case, p99: float) -> Decision:
    p, batch = case.p, case.batch
    queue_wait = case.signals.queue_wait_p99_s or 0.0
    limit = _growth_limit(case)
    if queue_wait >= p.queue_share * p99 and batch < limit:
        # Near the SLO because requests queue: add room before the p99 breaks it.
        predicted = _predicted_growth(case, f"p99 {_ms(p99)} nears the SLO from queueing")
        if predicted is not None:
            return predicted
        new_batch = min(limit, batch + p.additive_step)
        return case.change(
            "grow_batch",
            f"p99 {_ms(p99)} nears the SLO from queueing (queue wait p99 {_ms(queue_wait)}): "
            f"batch {batch} -> {new_batch}",
            batch=new_batch,
        )
    return case.hold(
        f"p99 {_ms(p99)} within the band [{_ms((1 - p.band) * case.slo_s)}, "
        f"{_ms(case.slo_s)}]"
    )


def _capacity(case: _Case) -> Capacity | None:
    """The model's view of this round: how far the batch may go, and what one pod carries
    there; None while there is no model or no output length to size requests by."""
    model, signals = case.model, case.signals
    tokens = signals.mean_output_tokens
    if model is None or tokens is None:
        return None
    limit = _growth_limit(case)
    allowed = _iteration_budget(case, model)
    # Where even the smallest batch runs past the budget, no batch meets the SLO by its
    # running time: the queue is the part left to cut, and only the bounds limit growth.
    if allowed is not None and model.iteration_s(case.bounds.min_batch) <= allowed:
        limit = min(limit, max(case.bounds.min_batch, model.largest_batch_within(allowed)))
    # The backlog counts as demand to drain within one window.
    demand = signals.demand_rate + signals.waiting / max(signals.window_s, 1e-9)
    return Capacity(
        batch_limit=limit,
        per_pod_rps=model.throughput_rps(limit, tokens),
        demand_rps=demand,
        prediction=f"{model.describe()}, {tokens:.0f} tokens a request",
        windows=model.samples,
    )


def _iteration_budget(case: _Case, model: CapacityModel) -> float | None:
    """The longest iteration whose requests still run within the SLO's band.

    The longest requests (p99 output tokens) run that many iterations. Without a
    length histogram, the running time seen (p99 less queue wait) is scaled from
    the window's mean batch, where queueing does not swamp it.
    """
    signals, budget = case.signals, (1 - case.p.band) * case.slo_s
    if signals.output_tokens_p99 is not None and signals.output_tokens_p99 > 0:
        return budget / signals.output_tokens_p99
    p99, batch_seen = signals.p99_latency_s, signals.mean_batch_size
    if p99 is None or batch_seen is None:
        return None
    queue_wait = min(p99, signals.queue_wait_p99_s or 0.0)
    if queue_wait >= case.p.queue_share * p99:
        return None  # p99 less queue wait is mostly noise here
    return model.iteration_s(batch_seen) * budget / max(1e-6, p99 - queue_wait)


def _predicted_growth(case: _Case, head: str, overloaded: bool = False) -> Decision | None:
    """The batch the model says carries this window's demand per pod at `busy_target`
    busy, in one jump; None without a model (the caller steps by AIMD).

    The running-time limit caps the jump, except where the SLO is broken by queueing
    (`overloaded`) and the fleet cannot grow: a queue that never drains breaks every
    request's latency and then times them out, a batch past the limit only runs the
    longest ones a little over. Where no batch carries the demand, AIMD steps there.
    A back-off's ceiling does not cap this growth: it was learnt running too slow, the
    price accepted here (and `_carrying_floor` keeps the back-off from undoing it).
    """
    capacity, model = case.capacity, case.model
    tokens = case.signals.mean_output_tokens
    if capacity is None or model is None or tokens is None:
        return None
    batch, limit = case.batch, capacity.batch_limit
    pods = max(1, case.signals.pods)
    per_pod = capacity.demand_rps / pods
    needed = model.batch_for(per_pod, tokens, case.p.busy_target)
    busy = f"{case.p.busy_target:.0%} busy"
    needs = f"batch {needed}" if needed is not None else "more than any batch carries"
    wants = f"{per_pod:.2f} req/s per pod needs {needs} at {busy}"
    serve_past_limit = overloaded and not _fleet_can_grow(case)
    if needed is None and serve_past_limit:
        step = min(case.bounds.max_batch, _capacity_step(case))
        if step <= batch:
            return case.hold(f"{head}: model: {wants}; batch {batch} is at the maximum")
        return case.change(
            "grow_batch",
            f"{head}: model ({capacity.prediction}): {wants}, and the fleet cannot grow: "
            f"batch {batch} -> {step}",
            batch=step,
        )
    target = limit if needed is None else min(limit, max(case.bounds.min_batch, needed))
    if needed is not None and needed > limit:
        if serve_past_limit:
            target = min(case.bounds.max_batch, needed)
            wants += (
                f", past the running-time limit {limit}: the fleet cannot grow, and a queue "
                "that never drains is worse"
            )
        else:
            wants += f", capped at the limit {limit}"
    if target > batch:
        return case.change(
            "grow_batch",
            f"{head}: model ({capacity.prediction}): {wants}: batch {batch} -> {target}",
            batch=target,
        )
    if needed is not None and needed <= batch:
        # Right after a change the window's breach is the old backlog's tail. Later the
        # window itself must show the queue going; one that outlives a window at this
        # batch says the model promised more than the pods deliver (a line fitted through
        # the smallest batches only, their time outside forwards): the measurement wins,
        # AIMD steps on.
        if case.state.since_change == 0 or _draining(case):
            return case.hold(
                f"{head}: model: {wants}; batch {batch} carries it, the queue drains"
            )
        return None
    return case.hold(f"{head}: model: {wants}; batch {batch} is at its limit {limit}")


def _carrying_floor(case: _Case) -> tuple[int, str]:
    """The smallest batch that still carries the arrivals with the pods always busy, where
    the fleet cannot grow, and why; (0, "") where pods may be added or there is no model.

    Below it the queue grows without end, breaking every request's latency and then timing
    them out; above it only the longest requests run over. This keeps a back-off from
    undoing the growth past the running-time limit that `_predicted_growth` makes there.
    """
    model, tokens = case.model, case.signals.mean_output_tokens
    if model is None or tokens is None or _fleet_can_grow(case):
        return 0, ""
    per_pod = case.signals.demand_rate / max(1, case.signals.pods)
    needed = model.batch_for(per_pod, tokens, 1.0)
    if needed is None:
        needed = case.batch
        how = "no batch carries"
    else:
        how = f"batch {needed} is the least that carries"
    return needed, f"{how} {per_pod:.2f} req/s per pod all busy and the fleet cannot grow"


def _draining(case: _Case) -> bool:
    """The window shows the queue going: the pods finished at least what arrived, and
    what still waits is down to a batch a pod."""
    signals = case.signals
    pods = max(1, signals.pods)
    return signals.finished_rate >= signals.demand_rate and signals.waiting <= case.batch * pods


def _fleet_can_grow(case: _Case) -> bool:
    """Whether pods may still be added: the replica rule runs and is below its maximum
    (an HPA that owns the count is taken to add pods too)."""
    replicas = case.goal.replicas
    return replicas is not None and max(1, case.signals.pods) < replicas.max_replicas


def _sized_ahead(case: _Case, head: str, limit: int) -> Decision | None:
    """With headroom and no queue yet, the batch the model says this demand needs, where
    the batch in force carries it at more than `busy_target` busy: a climbing load fills
    the slots a window before it queues, and growing then is cheaper than draining."""
    capacity, model = case.capacity, case.model
    tokens = case.signals.mean_output_tokens
    if capacity is None or model is None or tokens is None or case.batch >= limit:
        return None
    per_pod = capacity.demand_rps / max(1, case.signals.pods)
    needed = model.batch_for(per_pod, tokens, case.p.busy_target)
    if needed is None or needed <= case.batch:
        return None
    target = min(limit, capacity.batch_limit, needed)
    if target <= case.batch:
        return None
    return case.change(
        "grow_batch",
        f"{head}, but batch {case.batch} runs past {case.p.busy_target:.0%} busy: model "
        f"({capacity.prediction}): {per_pod:.2f} req/s per pod needs batch {needed}: "
        f"batch {case.batch} -> {target} before a queue forms",
        batch=target,
    )


def _running(case: _Case) -> tuple[float, str]:
    """The longest requests' running time, and how it was estimated.

    With a model: p99 output tokens times the iteration at the window's mean
    batch. Without one, p99 less queue-wait p99 (two p99s of different
    requests: under deep overload both land in the same wide bucket, and the
    difference is mostly noise).
    """
    signals, model = case.signals, case.model
    tokens, batch = signals.output_tokens_p99, signals.mean_batch_size
    if model is not None and tokens is not None and batch is not None:
        return tokens * model.iteration_s(batch), "model: p99 tokens x iteration"
    p99 = signals.p99_latency_s or 0.0
    return p99 - min(p99, signals.queue_wait_p99_s or 0.0), "p99 less queue wait"


def _running_too_slow(case: _Case) -> bool:
    """Running alone exceeds what the SLO allows (by `_running`'s estimate)."""
    if case.signals.p99_latency_s is None:
        return False
    return _running(case)[0] > case.p.service_share * case.slo_s


def _spent(case: _Case, decision: Decision) -> bool:
    """Whether the knobs can add no more capacity: the batch sits at the most they may
    give, the KV guard or a back-off cut it, or running alone breaks the SLO."""
    if decision.action in ("kv_guard", "backoff_batch"):
        return True
    if decision.action not in ("hold", "grow_batch"):
        return False
    capacity = case.capacity
    if capacity is not None and capacity.windows >= TRUSTED_WINDOWS:
        # the model's running time is one to act on: too slow, and only pods help the queue
        return decision.config.max_batch_size >= capacity.batch_limit or _running_too_slow(case)
    return decision.config.max_batch_size >= _growth_limit(case)


def _underfilled(case: _Case) -> bool:
    mean = case.signals.mean_batch_size
    return mean is not None and mean < case.p.full_batch_share * case.batch


def _full(case: _Case) -> bool:
    # With no batch-size series, queued requests are the evidence that batches fill.
    mean = case.signals.mean_batch_size
    return mean is None or mean >= case.p.full_batch_share * case.batch


def _queueing(case: _Case) -> bool:
    queue_wait = case.signals.queue_wait_p99_s or 0.0
    return queue_wait >= case.p.queueing_share * case.slo_s


def _capacity_step(case: _Case) -> int:
    # Never less than the step taken with headroom: a breach is the stronger evidence.
    return max(case.batch + case.p.additive_step, round(case.batch * case.p.capacity_factor))


def _cut_batch(case: _Case, factor: float) -> int:
    # At least one smaller, so a factor that rounds back to the batch still moves.
    batch = case.batch
    return max(case.bounds.min_batch, min(batch - 1, math.floor(batch * factor)))


def _cut_timeout(case: _Case) -> float:
    cut = case.timeout * case.p.timeout_cut_factor
    floor = case.bounds.min_timeout_ms
    # Below a millisecond a timeout only costs a wake-up: go straight to the floor.
    return floor if cut < 1.0 else max(floor, round(cut, 3))


def _growth_limit(case: _Case) -> int:
    bounds, ceiling = case.bounds, case.state.ceiling
    if ceiling is None:
        return bounds.max_batch
    return max(bounds.min_batch, min(bounds.max_batch, ceiling - 1))


def _age_ceiling(state: TunerState, p: TunerParams) -> TunerState:
    if state.ceiling is None:
        return state
    if state.ceiling_age + 1 >= p.ceiling_ttl_intervals:
        return replace(state, ceiling=None, ceiling_age=0)
    return replace(state, ceiling_age=state.ceiling_age + 1)


def _after_change(state: TunerState, p: TunerParams, ceiling: int | None = None) -> TunerState:
    if ceiling is None:
        return replace(state, cooldown=p.cooldown_intervals, since_change=0)
    return replace(
        state, cooldown=p.cooldown_intervals, since_change=0, ceiling=ceiling, ceiling_age=0
    )


def signal_window_s(state: TunerState, cadence: Cadence) -> float:
    """The window the next signals should cover: never reaching back past the last change.

    Right after a change the window is one interval long, so the tuner judges
    the new config alone instead of a blend of old and new.
    """
    since = min(state.since_change, SINCE_CHANGE_CAP) + 1
    return min(cadence.window_s, cadence.interval_s * since)


def _describe_clamp(before: BatchingConfig, after: BatchingConfig) -> str:
    return (
        f"config outside the bounds: batch {before.max_batch_size} -> {after.max_batch_size}, "
        f"timeout {before.batch_timeout_ms:g} -> {after.batch_timeout_ms:g} ms"
    )


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _e2e_target(slo: Slo) -> float:
    """The end-to-end target this rule aims at (it judges the end-to-end p99 only)."""
    if slo.e2e_s is None:
        raise ValueError("this tuner needs an end-to-end target")
    return slo.e2e_s
