"""`batching.mode: auto`'s choice: the map's regions, hysteresis, holding on thin data.

The workloads are the map's cells (docs/batching.md), turned into signals the
way the servers report them: output lengths through the server's own
histogram buckets, occupancy from the cell's rate and latency.
"""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from batchpilot_operator.policy.mode import ModeParams, ModeState, Workload, choose_mode
from batchpilot_operator.signals import MIN_REQUESTS_PER_WINDOW, Signals, histogram_quantile
from batchpilot_operator.slo import Slo
from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import Mode

BATCH = 8
PARAMS = ModeParams()
TOKEN_BOUNDS = (*names.GENERATION_TOKEN_BUCKETS, math.inf)
RNG = np.random.default_rng(0)
# The map's output spreads (bench/tradeoff.py): mean 64 tokens.
SPREADS = {
    "equal": np.full(2000, 64),
    "uniform": RNG.integers(16, 113, 2000),
    "heavy": np.clip(np.rint(RNG.lognormal(np.log(64) - 0.5, 1.0, 2000)), 2, 512),
}


def lengths_p50_p90(lengths: np.ndarray) -> tuple[float, float]:
    """The median and p90 a histogram_quantile over the server's buckets reads."""
    index = np.searchsorted(np.asarray(names.GENERATION_TOKEN_BUCKETS), lengths, side="left")
    cumulative = np.cumsum(np.bincount(index, minlength=len(TOKEN_BOUNDS))).tolist()
    p50 = histogram_quantile(0.5, TOKEN_BOUNDS, cumulative)
    p90 = histogram_quantile(0.9, TOKEN_BOUNDS, cumulative)
    assert p50 is not None and p90 is not None
    return p50, p90


def signals(
    spread: str = "equal", occupancy: float = 0.07, p99_s: float = 0.2, requests: float = 300
) -> Signals:
    """A window of `requests` finished requests in `spread` at `occupancy` of the batch."""
    p50, p90 = lengths_p50_p90(SPREADS[spread])
    mean_latency = p99_s / 2
    return Signals(
        status="ok", window_s=60, requests=requests, request_rate=occupancy * BATCH / mean_latency,
        p99_latency_s=p99_s, mean_latency_s=mean_latency,
        output_tokens_p50=p50, output_tokens_p90=p90,
    )


def run(
    windows: list[Signals], current: Mode = "continuous", slo_s: float = 10.0,
    state: ModeState | None = None,
) -> list[Mode]:
    """The mode in force after each round."""
    state = state or ModeState()
    modes = []
    for window in windows:
        choice = choose_mode(window, current, BATCH, Slo(e2e_s=slo_s), state, PARAMS)
        assert choice.switched == (choice.mode != current)
        current, state = choice.mode, choice.state
        modes.append(current)
    return modes


def test_the_map_spreads_read_apart_through_the_buckets() -> None:
    spread = {name: Workload.measured(signals(name), BATCH) for name in SPREADS}
    values = {name: w.spread for name, w in spread.items() if isinstance(w, Workload)}
    assert values["equal"] <= PARAMS.enter_spread < PARAMS.leave_spread < values["uniform"]
    assert values["uniform"] < values["heavy"]


@pytest.mark.parametrize("length", [2, 3, 5, 7, 10, 50, 64, 100, 300, 1000, 5000, 8000])
def test_equal_lengths_read_equal_whatever_the_length(length: int) -> None:
    p50, p90 = lengths_p50_p90(np.full(100, length))
    assert p90 / p50 <= PARAMS.enter_spread


def test_equal_lengths_at_low_load_with_room_go_dynamic_after_the_evidence() -> None:
    modes = run([signals("equal", 0.07)] * PARAMS.evidence_rounds)
    assert modes == ["continuous"] * (PARAMS.evidence_rounds - 1) + ["dynamic"]


@pytest.mark.parametrize(
    ("window", "why"),
    [
        (signals("uniform", 0.07), "output lengths vary"),
        (signals("heavy", 0.07), "output lengths vary"),
        (signals("equal", 0.22), "load too high"),  # the map's 30% cells
        # continuous's p99 x the cost breaks the band under the SLO
        (signals("equal", 0.07, p99_s=10.0 * 0.8 / PARAMS.p99_cost * 1.01), "no room"),
    ],
)
def test_continuous_everywhere_else(window: Signals, why: str) -> None:
    state = ModeState()
    for _ in range(2 * PARAMS.evidence_rounds):
        choice = choose_mode(window, "continuous", BATCH, Slo(e2e_s=10.0), state, PARAMS)
        assert choice.mode == "continuous" and not choice.switched
        assert why in choice.reason
        state = choice.state


def test_static_is_left_for_the_mode_the_workload_favours() -> None:
    assert run([signals("heavy")] * PARAMS.evidence_rounds, current="static")[-1] == "continuous"


@pytest.mark.parametrize(
    "thin",
    [
        Signals(status="too_little_traffic", requests=MIN_REQUESTS_PER_WINDOW - 1,
                detail="only 49 requests"),
        Signals(status="no_data", detail="Prometheus is unreachable"),
        replace(signals("equal"), output_tokens_p50=None, output_tokens_p90=None),
    ],
)
def test_thin_data_holds_and_keeps_the_evidence(thin: Signals) -> None:
    favouring = signals("equal")
    state = ModeState()
    for window in [favouring, thin, thin, favouring]:
        choice = choose_mode(window, "continuous", BATCH, Slo(e2e_s=10.0), state, PARAMS)
        if window is thin:
            assert choice.reason.startswith("holding continuous")
        state = choice.state
    # Two favouring rounds, the thin ones neither counted nor reset: one more switches.
    assert state.streak == 2
    assert choose_mode(favouring, "continuous", BATCH, Slo(e2e_s=10.0), state, PARAMS).switched


def test_a_dissenting_round_resets_the_evidence() -> None:
    favouring, other = signals("equal"), signals("heavy")
    modes = run([favouring, favouring, other, favouring, favouring])
    assert modes == ["continuous"] * 5


def test_a_load_that_sits_on_the_boundary_does_not_flip_flop() -> None:
    # Occupancy wandering around the entry threshold, inside the exit one: one switch.
    wobble = [PARAMS.enter_occupancy * f for f in (0.9, 1.1, 0.95, 1.05)]
    windows = [signals("equal", occupancy) for occupancy in wobble * 10]
    modes = run([signals("equal")] * PARAMS.evidence_rounds + windows)
    switches = sum(a != b for a, b in zip(["continuous", *modes], modes, strict=False))
    assert switches == 1 and modes[-1] == "dynamic"


def test_no_switch_back_within_the_dwell() -> None:
    evidence = PARAMS.evidence_rounds
    modes = run([signals("equal")] * evidence + [signals("heavy")] * (2 * PARAMS.dwell_rounds))
    flips = [i for i in range(1, len(modes)) if modes[i] != modes[i - 1]]
    assert modes[evidence - 1] == "dynamic" and modes[-1] == "continuous"
    # To dynamic at the evidence, and back no sooner than the dwell allows.
    assert len(flips) == 2 and flips[0] == evidence - 1
    assert flips[1] - flips[0] >= PARAMS.dwell_rounds


def test_dynamic_leaves_when_its_own_p99_breaks_the_band() -> None:
    inside = signals("equal", p99_s=0.79 * 10.0)  # dynamic's measured p99 within the band
    above = signals("equal", p99_s=0.81 * 10.0)
    assert run([inside] * PARAMS.evidence_rounds, current="dynamic")[-1] == "dynamic"
    assert run([above] * PARAMS.evidence_rounds, current="dynamic")[-1] == "continuous"
