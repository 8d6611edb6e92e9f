"""`batching.mode: auto`: the batching mode the measured workload calls for.

Pure and deterministic: the same (signals, mode in force, batch size, SLO,
state) always gives the same choice. It runs inside the round (`round.py`)
wherever the loop's plug points have a mode switch (an auto policy in the
operator; the simulator), on the round's signals.

The rule comes from the crossover map in docs/batching.md (bench/tradeoff.py;
a cell is prompt tokens / output spread / load as a share of continuous's
capacity):

- Continuous won at the SLO in 53 of the 54 cells (all 30 of tiny's, 23 of
  SmolLM2-135M's 24). The 54th, SmolLM2 16/equal/120%, went to static by a
  p99 within 1% of continuous's in overload, where no policy met the SLO: a
  tie, not a region. Static is never chosen: its batch waits for
  max_batch_size arrivals while the device idles (tiny 16/equal/10%: p99
  3.88 s against 0.22 s).
- Dynamic came out ahead on anything only at SmolLM2 16/equal/10% (p50
  3.43 s against 4.05 s) and 128/equal/10% (3.83 against 4.35 s): equal
  output lengths at low load, where a dynamic batch prefills once while each
  request joining a continuous batch adds a prefill to the running ones'
  steps. It pays with its p99: 1.51x continuous's there (8.63 against 5.70 s;
  9.10 against 6.64 s), 1.68x on tiny 16/equal/10% (0.37 against 0.22 s).
  At 30% load (tiny 16/equal/30%) continuous already had the lower p50 too.
- With any spread of output lengths continuous wins by far (hostage effect),
  at every load; prompt length (16 against 256 tokens on tiny, 16 against 128
  on SmolLM2) moved no boundary, so it is not an input.

Hence: dynamic when the outputs are equal, the load is low and the p99 has
room for dynamic's cost; continuous everywhere else. The inputs, measured:

- spread: p90 / p50 of `batchpilot_request_generation_tokens`. Equal lengths
  read at most 1.27 from its buckets, the map's narrowest spread (uniform
  16..112) about 1.6, its heavy tail (log-normal, sigma 1) about 3.6;
- occupancy: requests in the system per batch slot, request rate x mean
  latency / max_batch_size (Little's law). The map's 10% cells sit at about
  0.07 (tiny 16/equal/10%: 2.98 req/s x 0.18 s / 8; SmolLM2: 0.14 x 4.05 / 8),
  its 30% cells at about 0.22 (tiny: 8.95 x 0.20 / 8);
- p99 room: for each stated target with a measured p99 (TTFT, TPOT, end to end),
  continuous's p99 x P99_COST (the worst ratio above) within the band under the
  target; once dynamic runs, its own p99 within it.

Leaving dynamic takes a clearer signal than entering it (wider thresholds),
a switch takes `evidence_rounds` agreeing rounds with enough data, and no
switch follows another within `dwell_rounds`: a mode change restarts every
pod (docs/tuning.md), so it must not flip back and forth. Rounds without
enough data hold the mode in force and neither add nor take evidence.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from batchpilot_operator.signals import Signals
from batchpilot_operator.slo import Slo
from batchpilot_server.batching_config import Mode

SINCE_SWITCH_CAP = 1000


@dataclass(frozen=True)
class ModeParams:
    """The rule's thresholds; the module docstring derives each from the map."""

    enter_spread: float = 1.3  # p90/p50 at or under it: equal lengths
    leave_spread: float = 1.45  # over it: lengths vary (uniform reads ~1.6)
    enter_occupancy: float = 0.15  # between the 10% cells (~0.07) and the 30% ones (~0.22)
    leave_occupancy: float = 0.22
    p99_cost: float = 1.7  # dynamic's p99 over continuous's in the equal, low-load cells
    band: float = 0.2  # p99 room: within (1 - band) x SLO, the tuner's band
    evidence_rounds: int = 3
    dwell_rounds: int = 10


@dataclass(frozen=True)
class ModeState:
    """What the choice remembers between rounds (in memory, like the tuner's state)."""

    candidate: Mode | None = None  # the other mode the last rounds favoured
    streak: int = 0  # agreeing rounds for it so far
    # Rounds since the last switch; a fresh operator has made none, so it may switch.
    since_switch: int = SINCE_SWITCH_CAP


@dataclass(frozen=True)
class ModeChoice:
    mode: Mode  # the mode in force after this round
    reason: str
    state: ModeState
    switched: bool = False


@dataclass(frozen=True)
class Workload:
    """What the choice reads from a window of signals."""

    spread: float
    occupancy: float
    p99_s: float
    requests: float
    p99s: dict[str, float]  # the measured p99 of each target (ttft, tpot, e2e)

    @classmethod
    def measured(cls, signals: Signals, max_batch_size: int) -> Workload | str:
        """The window's workload, or why it cannot say (the choice then holds)."""
        if not signals.ok:
            return signals.detail or signals.status.replace("_", " ")
        spread = signals.output_spread
        if spread is None:
            return "the servers export no output lengths (batchpilot_request_generation_tokens)"
        if signals.p99_latency_s is None or signals.mean_latency_s is None:
            return "no latency in the window"
        occupancy = signals.request_rate * signals.mean_latency_s / max_batch_size
        p99s = {"ttft": signals.ttft_p99_s, "tpot": signals.tpot_p99_s,
                "e2e": signals.p99_latency_s}  # fmt: skip
        measured = {name: value for name, value in p99s.items() if value is not None}
        return cls(spread, occupancy, signals.p99_latency_s, signals.requests, measured)

    def describe(self) -> str:
        return (
            f"output p90/p50 {self.spread:.2f}, occupancy {self.occupancy:.2f} of the batch, "
            f"p99 {self.p99_s * 1000:.0f} ms over {self.requests:.0f} requests"
        )


def favoured(workload: Workload, current: Mode, slo: Slo, params: ModeParams) -> tuple[Mode, str]:
    """The mode the map names for this workload, and why: dynamic where every condition of
    its region holds, else continuous, naming the first that does not."""
    in_dynamic = current == "dynamic"
    spread_limit = params.leave_spread if in_dynamic else params.enter_spread
    occupancy_limit = params.leave_occupancy if in_dynamic else params.enter_occupancy
    # Dynamic's own p99 is measured once it runs; before, continuous's is scaled by its cost.
    cost = 1.0 if in_dynamic else params.p99_cost
    rooms = {name: (1 - params.band) * slo.stated[name] for name in workload.p99s
             if name in slo.stated}  # fmt: skip
    # (holds, why continuous where it does not): the region's conditions, in order
    conditions = [
        (workload.spread <= spread_limit,
         f"output lengths vary (p90/p50 {workload.spread:.2f} > {spread_limit:g}): "
         "dynamic batches would hold finished requests hostage"),
        (workload.occupancy <= occupancy_limit,
         f"load too high for dynamic (occupancy {workload.occupancy:.2f} > "
         f"{occupancy_limit:g}): continuous has the lower p50 and p99 there"),
        *((workload.p99s[name] * cost <= room,
           f"dynamic's {name} p99 (~{workload.p99s[name] * cost * 1000:.0f} ms) would leave "
           f"no room under the SLO ({room * 1000:.0f} ms with the band)")
          for name, room in rooms.items()),
    ]  # fmt: skip
    unmet = [why for holds, why in conditions if not holds]
    dynamic_why = (
        f"equal output lengths at low load (p90/p50 {workload.spread:.2f}, occupancy "
        f"{workload.occupancy:.2f}): a dynamic batch prefills once, for a lower p50, and its "
        f"p99 (~{workload.p99_s * cost * 1000:.0f} ms) leaves room under every target"
    )
    return ("continuous", unmet[0]) if unmet else ("dynamic", dynamic_why)


def choose_mode(
    signals: Signals,
    current: Mode,
    max_batch_size: int,
    slo: Slo,
    state: ModeState,
    params: ModeParams | None = None,
) -> ModeChoice:
    """The mode in force after this round; see the module docstring."""
    params = params or ModeParams()
    aged = replace(state, since_switch=min(state.since_switch + 1, SINCE_SWITCH_CAP))
    workload = Workload.measured(signals, max_batch_size)
    if isinstance(workload, str):
        return ModeChoice(current, f"holding {current}: {workload}", aged)
    target, why = favoured(workload, current, slo, params)
    seen = workload.describe()
    if target == current:
        return ModeChoice(
            current, f"{current}: {why} ({seen})", replace(aged, candidate=None, streak=0)
        )
    streak = aged.streak + 1 if aged.candidate == target else 1
    evidence = replace(aged, candidate=target, streak=streak)
    if streak < params.evidence_rounds or aged.since_switch < params.dwell_rounds:
        return ModeChoice(
            current,
            (
                f"holding {current}, {target} favoured for {streak} of {params.evidence_rounds} "
                f"rounds, the last switch {aged.since_switch} round(s) ago (dwell "
                f"{params.dwell_rounds}): {why} ({seen})"
            ),
            evidence,
        )
    return ModeChoice(
        target, f"{current} -> {target}: {why} ({seen})", ModeState(since_switch=0), switched=True
    )
