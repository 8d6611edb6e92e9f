"""The per-request SLO judgement: each stated target met or missed, and "all"."""

from __future__ import annotations

import pytest
from batchpilot_server.batching_config import SloTargets
from batchpilot_server.http.slo_judge import RequestTiming, judge


def timing(arrival: float, *tokens: tuple[int, float]) -> RequestTiming:
    """A request that arrived at `arrival` and received (choice, at) tokens."""
    request = RequestTiming(arrival)
    for choice, at in tokens:
        request.token(choice, at)
    return request


# arrival 10.0, first token at 10.2, then three more 0.05 s apart: ttft 200 ms, tpot 50 ms
STREAM = timing(10.0, (0, 10.2), (0, 10.25), (0, 10.3), (0, 10.35))
END = 10.4  # e2e 400 ms


def test_nothing_stated_judges_nothing() -> None:
    assert judge(SloTargets(), STREAM, END) == {}
    assert judge(SloTargets(), None, END) == {}


@pytest.mark.parametrize(
    ("targets", "verdict"),
    [
        (SloTargets(ttft_ms=250), {"ttft": True, "all": True}),
        (SloTargets(ttft_ms=150), {"ttft": False, "all": False}),
        (SloTargets(tpot_ms=51), {"tpot": True, "all": True}),
        (SloTargets(tpot_ms=49), {"tpot": False, "all": False}),
        (SloTargets(e2e_ms=401), {"e2e": True, "all": True}),
        (SloTargets(e2e_ms=399), {"e2e": False, "all": False}),
        (SloTargets(ttft_ms=250, tpot_ms=49), {"ttft": True, "tpot": False, "all": False}),
        (
            SloTargets(ttft_ms=100, tpot_ms=10, e2e_ms=300),
            {"ttft": False, "tpot": False, "e2e": False, "all": False},
        ),
    ],
)
def test_each_stated_target_and_all(targets: SloTargets, verdict: dict[str, bool]) -> None:
    assert judge(targets, STREAM, END) == verdict


def test_a_one_token_answer_holds_tpot_trivially() -> None:
    one = timing(0.0, (0, 0.5))
    assert judge(SloTargets(tpot_ms=0.001), one, 0.6) == {"tpot": True, "all": True}
    assert one.tpot_s is None


def test_a_failed_request_misses_every_stated_target() -> None:
    targets = SloTargets(ttft_ms=1e6, e2e_ms=1e6)
    assert judge(targets, None, END) == {"ttft": False, "e2e": False, "all": False}


def test_choices_are_judged_by_the_first_token_of_any_and_the_slowest_stream() -> None:
    # choice 1 starts later and runs slower: 0.1 s per token against choice 0's 0.05 s
    both = timing(0.0, (0, 0.1), (1, 0.3), (0, 0.15), (1, 0.4), (0, 0.2), (1, 0.5))
    assert both.ttft_s == pytest.approx(0.1)
    assert both.tpot_s == pytest.approx(0.1)
    assert judge(SloTargets(tpot_ms=75), both, 0.5) == {"tpot": False, "all": False}
