"""The window's derived quantities, computed once per round and read by every other part.

Pure. From the window's `Signals`, the goal and the rule's memory:

- demand: `arrival_rps` (arrivals alone, where measured, else finished), the
  `forecast_rps` a pod started now would meet (now's arrivals, `arrivals_now`: the
  window's, or the newest interval's where higher, plus the median rise of the last
  rounds over the lead time: the last scale-out's start-up and a round; one jump is no
  trend), and `demand_with_backlog_rps` (the forecast plus the backlog drained within
  a given horizon);
- the lengths' shape: prompt and output tokens over quantile slices, from the p10, p50,
  p90 and p99 the pods' histograms give (`length_grid`); where a quantile is missing its
  neighbour stands in;
- per pod: the throughput a pod showed (finished per busy second; without a busy
  share, a queueing pod is taken as always busy); the decode rows a step ran
  (`mean_rows`: the step counters, else the mean batch size);
- `queueing`: the wait for a slot is half the p99 it is part of (TTFT's where TTFT is
  a stated target: an end-to-end p99 of long answers hides a queue that breaks it), or
  the queue grows. For a class's view (the fallback reads the binding one's) the queue
  is the one its class waits behind, `waiting_ahead`: the requests of its priority or
  higher, since the schedulers serve a higher class first and a lower class's queue
  lengthens only its own wait. There a queue needs more than a request a pod waiting
  ahead, growing or with the wait half the p99: the queue-wait p99 is every class's
  together, and without that a lower class's minutes of waiting would pass for the
  view's own;
- `queue_grows`: more than a request a pod waits at the window's end and clearly
  fewer finished than arrived: evidence, whatever the window's count of finished
  requests;
- `has_evidence`: enough traffic to judge, or more misses judged than chance allows;
- the SLO as judged (`views`, `binding`): where the policy states classes and the
  window carries them, each class's own p99s against its own targets and its own
  attainment (the default class, the top-level targets, where it had traffic), since
  one class's long requests inflate the totals' p99 against another's target; else the
  totals against the top-level targets. The binding view (`binding`: the highest ratio) is the
  window's pressure. `observed()` stays the totals': the predictor's view.
"""

from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass

import numpy as np
from batchpilot_operator.policy.types import ARRIVAL_HISTORY, Fleet, ReplicaBounds, ReplicaState
from batchpilot_operator.signals import ClassSignals, Signals, misses_are_evidence
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import DEFAULT_CLASS

QUEUE_SHARE = 0.5  # queue wait >= this share of a p99: queueing is half the story
GROWTH_SHARE = 0.05  # finished under (1 - share) x arrivals: the queue grows


@dataclass(frozen=True)
class Forecast:
    now_rps: float
    rise_per_s: float = 0.0
    lead_s: float = 0.0

    @property
    def rps(self) -> float:
        return self.now_rps + self.rise_per_s * self.lead_s

    def describe(self) -> str:
        if self.rise_per_s <= 0:
            return f"{self.now_rps:.2f} req/s"
        return f"{self.now_rps:.2f} req/s, rising to {self.rps:.2f} req/s in {self.lead_s:.0f} s"


@dataclass(frozen=True)
class SloView:
    """One SLO as the window judged it: a class's (or the totals') p99s of its stated
    targets, those targets and its attainment objective, and the share of its judged
    requests that met every target."""

    name: str | None  # the class; None: the totals against the top-level targets
    targets: dict[str, float]  # seconds, by short name (ttft, tpot, e2e)
    objective: float  # the attainment to meet
    observed: dict[str, float]  # the p99 of each target measured
    attainment: float | None  # None: nothing judged

    def pressure(self) -> tuple[str, float] | None:
        """The target whose p99 is closest to (or furthest past) it, and that ratio; None
        where none is measured. Where at least the objective's share of the judged
        requests met every target the SLO holds: a p99 past its target is the allowed
        misses, so the ratio is at most 1."""
        ratios = {k: v / self.targets[k] for k, v in self.observed.items()}
        if not ratios:
            return None
        worst = max(ratios, key=lambda k: ratios[k])
        if self.attainment is not None and self.attainment >= self.objective:
            return worst, min(1.0, ratios[worst])
        return worst, ratios[worst]

    def label(self, target: str) -> str:
        """How a reason names one of its targets: `ttft`, or `class batch: e2e`."""
        return target if self.name is None else f"class {self.name}: {target}"


def _measured(targets: dict[str, float], ttft: float | None, tpot: float | None,
              e2e: float | None) -> dict[str, float]:  # fmt: skip
    values = {"ttft": ttft, "tpot": tpot, "e2e": e2e}
    return {k: v for k, v in values.items() if k in targets and v is not None}


def _class_view(name: str, targets: dict[str, float], objective: float,
                seen: ClassSignals) -> SloView:  # fmt: skip
    observed = _measured(targets, seen.ttft_p99_s, seen.tpot_p99_s, seen.p99_latency_s)
    return SloView(name, targets, objective, observed, seen.attainment)


@dataclass(frozen=True)
class Window:
    signals: Signals
    slo: Slo
    pods: int  # pods the window covers (at least 1)
    forecast: Forecast
    fleet: Fleet | None
    replicas: ReplicaBounds | None
    # speculative decoding: each draft token's chance of acceptance (speculation.py),
    # measured under the k in force or the last one measured; None: never measured
    acceptance: float | None = None

    @classmethod
    def of(
        cls,
        signals: Signals,
        slo: Slo,
        fleet: Fleet | None,
        replicas: ReplicaBounds | None,
        memory: ReplicaState,
    ) -> Window:
        """The window's quantities; `memory` holds this round's arrivals already
        (replicas.py `observe`)."""
        pods = max(1, signals.pods or (fleet.ready if fleet is not None else 1))
        now_rps = arrivals_now(signals, memory)
        return cls(signals, slo, pods, forecast(now_rps, memory), fleet, replicas)

    @property
    def arrival_rps(self) -> float:
        return self.signals.demand_rate

    @property
    def forecast_rps(self) -> float:
        return self.forecast.rps

    @property
    def backlog(self) -> float:
        return self.signals.waiting

    def demand_with_backlog_rps(self, drain_s: float) -> float:
        """The forecast plus the backlog drained within `drain_s`."""
        return self.forecast_rps + self.backlog / drain_s

    @property
    def queue_grows(self) -> bool:
        """More than a request a pod waits at the window's end, and the pods finished
        clearly less than arrived (by `GROWTH_SHARE`: not the noise of a steady load)."""
        return self._grows(self.signals.waiting)

    def _grows(self, waiting: float) -> bool:
        s = self.signals
        return waiting > self.pods and s.finished_rate < (1 - GROWTH_SHARE) * s.demand_rate

    def waiting_ahead(self, view: SloView) -> float | None:
        """The requests waiting now that `view`'s class waits behind: those of the classes
        of its priority or higher (a class the policy does not state counts as ahead).
        None for the totals' view, or where a class's waiting is not exported (an older
        server): the queue cannot be split by class."""
        seen = self.signals.classes
        known = {name: c.waiting for name, c in seen.items() if c.waiting is not None}
        if view.name is None or not seen or len(known) < len(seen):
            return None
        priority = {DEFAULT_CLASS: 0, **{c.name: c.priority for c in self.slo.classes}}
        floor = priority.get(view.name, 0)
        return sum(n for name, n in known.items() if priority.get(name, floor) >= floor)

    def measured_per_pod_rps(self) -> float | None:
        """What each pod finished over the share of the window it was busy."""
        s = self.signals
        if s.finished_rate <= 0:
            return None
        # Without a busy share, a queueing pod is taken as always busy.
        busy = s.utilisation if s.utilisation is not None else (1.0 if self.queueing() else None)
        if busy is None or busy <= 0:
            return None
        return s.finished_rate / (self.pods * min(1.0, busy))

    def mean_rows(self) -> float | None:
        """Decode rows per engine step (the step counters), else the mean batch size."""
        s = self.signals
        if s.steps and s.step_decode_rows is not None:
            return s.step_decode_rows / s.steps
        return s.mean_batch_size

    def rows_in_flight(self) -> float | None:
        """The decode rows a pod holds on average: the rows a step runs times the share of
        the window its pods step (a pod serving a few long answers steps all the time);
        None where the rows are unknown."""
        rows, busy = self.mean_rows(), self.signals.utilisation
        return None if rows is None else rows * (1.0 if busy is None else min(1.0, busy))

    def rows_at_forecast(self) -> float | None:
        """`rows_in_flight` at the forecast's arrivals: a request's rows stay in flight as
        long as before, so they grow with the arrivals (Little's law); a load that rises
        fills the batch a start-up from now, not just now."""
        rows, f = self.rows_in_flight(), self.forecast
        return None if rows is None else rows * max(1.0, f.rps / f.now_rps if f.now_rps else 1.0)

    def queueing(self, view: SloView | None = None) -> bool:
        """The wait for a slot is half the p99 it is part of (TTFT where that is a stated
        target, else end to end), or the queue grows. With a class's `view`, whose queue
        splits by class: only where more than a request a pod waits ahead of that class
        (see the module docstring)."""
        ahead = None if view is None else self.waiting_ahead(view)
        if ahead is not None:
            return ahead > self.pods and (self._grows(ahead) or self._wait_is_half())
        return self.queue_grows or self._wait_is_half()

    def _wait_is_half(self) -> bool:
        """The queue-wait p99 is at least `QUEUE_SHARE` of the p99 it is part of."""
        s = self.signals
        ttft = s.ttft_p99_s if "ttft" in self.slo.stated else None
        p99 = (ttft if ttft is not None else s.p99_latency_s) or 0.0
        return (s.queue_wait_p99_s or 0.0) >= QUEUE_SHARE * p99 > 0

    def misses_are_evidence(self) -> bool:
        """A window too thin for p99s whose pods judged more misses than chance allows (a
        slow model finishes few requests a window, and each may miss)."""
        s = self.signals
        return s.status == "too_little_traffic" and misses_are_evidence(
            s.slo_judged, s.slo_missed.get("all"), self.slo.allowed_miss_share
        )

    @property
    def has_evidence(self) -> bool:
        """Enough traffic to judge (signals.py `traffic_status`), or misses that show the
        SLO missed however thin the window."""
        return self.signals.ok or self.misses_are_evidence()

    def observed(self) -> dict[str, float]:
        """The window's total p99 of each stated top-level target (those measured): every
        class's requests together, as the predictor sees them."""
        s = self.signals
        return _measured(self.slo.stated, s.ttft_p99_s, s.tpot_p99_s, s.p99_latency_s)

    def totals(self) -> SloView:
        """The totals against the top-level targets."""
        slo = self.slo
        return SloView(None, slo.stated, slo.attainment, self.observed(), self.signals.attainment)

    def views(self) -> tuple[SloView, ...]:
        """Each stated class the window carries (the default class, the top-level targets,
        first), against its own targets; the totals alone where the policy states no
        classes or the window carries none of them."""
        seen, slo = self.signals.classes, self.slo
        stated = [(DEFAULT_CLASS, slo.stated, slo.attainment),
                  *((c.name, c.stated, c.attainment) for c in slo.classes)]  # fmt: skip
        views = tuple(
            _class_view(name, targets, objective, seen[name])
            for name, targets, objective in stated
            if name in seen
        )
        return views if slo.classes and views else (self.totals(),)

    def binding(self) -> tuple[SloView, str, float] | None:
        """The view under the most pressure, its target and ratio (`SloView.pressure`);
        the first on a tie (the default class, then the classes in order); None where no
        view measured a p99."""
        pressed = [(view, *p) for view in self.views() if (p := view.pressure()) is not None]
        return max(pressed, key=lambda b: b[2]) if pressed else None

    def tightest(self, target: str) -> tuple[str, float, float] | None:
        """How a reason names it, the p99 and the target `target` (tpot, e2e) of the view
        whose p99 is furthest into it (the attainment aside: a longer step lengthens
        every class's tokens); None where no view states and measured it."""
        seen = [(v.label(target), v.observed[target], v.targets[target]) for v in self.views()
                if target in v.observed]  # fmt: skip
        return max(seen, key=lambda t: t[1] / t[2]) if seen else None


# Lengths as (share of requests, tokens) over quantile slices, finest at the short end
# (a long prompt's prefill spreads over the fewest tokens of the shortest answers).
LENGTH_SLICES = ((0.0, 0.02), (0.02, 0.05), (0.05, 0.1), (0.1, 0.3), (0.3, 0.6),
                 (0.6, 0.9), (0.9, 0.99), (0.99, 1.0))  # fmt: skip
Lengths = tuple[tuple[float, float], ...]


def length_grid(
    p10: float | None, p50: float | None, p90: float | None, p99: float | None
) -> Lengths | None:
    """Lengths over `LENGTH_SLICES` from four quantiles: the quantile function through
    them, linear between, extended below p10 by the p10-p50 slope (at least one token)
    and flat above p99; a missing quantile is taken from its neighbour. None where none
    is known. The slices' midpoints, not the quantiles themselves, stand for them, so a
    mean over the grid is not biased long."""
    given = [v if v is not None and v > 0 else None for v in (p10, p50, p90, p99)]
    known = [v for v in given if v is not None]
    if not known:
        return None
    filled: list[float] = []
    for i, v in enumerate(given):
        if v is None:
            after = [u for u in given[i:] if u is not None]
            v = filled[-1] if filled else after[0]
        filled.append(max(v, filled[-1]) if filled else v)
    q10, q50, q90, q99 = filled
    low = max(1.0, q10 - 0.25 * (q50 - q10))
    qs, values = (0.0, 0.1, 0.5, 0.9, 0.99, 1.0), (low, q10, q50, q90, q99, q99)
    return tuple((b - a, float(np.interp((a + b) / 2, qs, values))) for a, b in LENGTH_SLICES)


def mean_length(lengths: Lengths) -> float:
    return sum(w * n for w, n in lengths)


def forecast(now_rps: float, memory: ReplicaState) -> Forecast:
    """Now's arrivals plus the recent rise over the lead time (see the module docstring)."""
    history = memory.arrivals
    rises = [(b - a) / (tb - ta) for (ta, a), (tb, b) in itertools.pairwise(history) if tb > ta]
    if len(rises) < ARRIVAL_HISTORY - 1:
        return Forecast(now_rps)
    gap = (history[-1][0] - history[0][0]) / (len(history) - 1)
    startup = memory.startup_s if memory.startup_s is not None else gap
    return Forecast(now_rps, max(0.0, statistics.median(rises)), gap + startup)


def arrivals_now(signals: Signals, memory: ReplicaState) -> float:
    """The demand the pods must carry now: the window's arrivals, or the newest interval's
    where they are higher.

    The arrival rate spans the newer half of the window. Where that half reaches back past
    the round before (a window of three intervals or more), a rise within the newest
    interval shows in it only in part: a fleet sized for it is sized for a load partly from
    before the rise, and a scale-in in a surge's first round takes away a pod the surge
    needs. The newest interval's rate is what is left of the half's arrivals once the part
    it shares with the round before is taken at the rate that round measured. A fall is
    not taken: the window's arrivals stay the demand until the window shows it, which is
    the evidence a scale-in waits for (the newest interval alone is a shorter, noisier
    count)."""
    rate = signals.demand_rate
    if signals.arrival_rate is None or len(memory.arrivals) < 2:
        return rate
    (before_at, before), (at, _) = memory.arrivals[-2:]
    # Exact where the arrivals were steady over the round before's half. Within a half
    # after a step up, that round's rate is under the shared part's, and this reads high
    # by up to (span - gap) / span of the step (a third at three intervals): a pod sooner
    # in a rise, for a round. Prometheus reads the half exactly; the scrape source and
    # the simulator from a round's snapshot, up to an interval further back.
    gap, span = at - before_at, signals.window_s / 2
    if not 0 < gap < span:
        return rate  # the half spans no more than the newest interval
    newest = (rate * span - before * (span - gap)) / gap
    return max(rate, newest)
