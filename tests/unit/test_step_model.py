"""The step-time model: the fit recovers known costs, stays non-negative, says which terms it
could tell apart, and is trusted only across distinct operating points."""

from __future__ import annotations

import pytest
from batchpilot_operator.policy.step_model import (
    MAX_POINTS,
    StepPoint,
    fit,
    of_fleet,
    point_of,
    remember,
)
from hypothesis import given
from hypothesis import strategies as st

from tests.support.policy import PLANE, points, step_s, window


def test_the_fit_recovers_known_coefficients() -> None:
    model = fit(points())
    assert model is not None and model.trusted
    got = (model.fixed_s, model.per_row_s, model.per_prefill_s, model.per_kv_s)
    assert got == pytest.approx(PLANE, rel=1e-6)
    assert model.used == ("rows", "prefill", "kv")
    assert "over 5 windows" in model.describe()


@given(
    st.tuples(
        st.floats(0.0, 0.05), st.floats(0.0, 0.001), st.floats(0.0, 1e-4), st.floats(0.0, 1e-5)
    )
)
def test_any_physical_plane_is_recovered(costs: tuple[float, float, float, float]) -> None:
    # physical: nothing negative, and a row at least a prompt token (its extra >= 0)
    fixed, row_extra, prompt_token, kv = costs
    plane = (fixed, prompt_token + row_extra, prompt_token, kv)
    model = fit(points(plane=plane))
    assert model is not None
    for rows, prefill, kv in [(3, 100, 700), (12, 20, 4000)]:
        assert model.step_s(rows, prefill, kv) == pytest.approx(
            step_s(rows, prefill, kv, plane), rel=1e-6, abs=1e-9
        )


def test_noise_that_reads_as_a_negative_cost_is_fitted_as_none() -> None:
    # Step times that fall with the rows: a flat curve's noise, not a free row.
    noisy = [StepPoint(r, 100, 1000, 0.01 - 0.0001 * r, 1) for r in (1, 2, 4, 8)]
    model = fit(noisy)
    assert model is not None
    assert min(model.fixed_s, model.per_row_s, model.per_prefill_s, model.per_kv_s) >= 0
    assert model.per_row_s == 0
    # the rows varied: the reason says they cost nothing measurable, not that they stood
    assert "rows cost nothing measurable" in model.describe()
    assert "rows" not in model.flat and model.max_rows == 8


def test_a_row_is_never_priced_below_a_prompt_token() -> None:
    # A real server's few rows a step (1-3 in a 30 ms step) hide their cost in the noise:
    # free to, the fit prices a row at nothing while prompt tokens cost 50 us each. The
    # row is one token through the same weights, so it is priced at least as one.
    hidden = [(1, 40), (2, 200), (3, 90), (1.5, 300)]  # rows, prompt tokens a step
    model = fit([StepPoint(r, p, 0.0, 0.03 + 50e-6 * p, 1) for r, p in hidden])
    assert model is not None and model.trusted and not model.together
    assert model.per_prefill_s > 0
    assert model.per_row_s >= model.per_prefill_s
    assert "rows cost nothing" not in model.describe()
    assert model.step_s(32, 0, 0) - model.step_s(1, 0, 0) >= 31 * model.per_prefill_s


def test_a_term_that_did_not_vary_is_left_out_and_named() -> None:
    steady = [StepPoint(r, 100, 1000, step_s(r, 100, 1000), 1) for r in (1, 2, 4, 8)]
    model = fit(steady)
    assert model is not None and model.used == ("rows",)
    assert "prefill, kv did not vary" in model.describe()
    assert model.step_s(6, 100, 1000) == pytest.approx(step_s(6, 100, 1000))


def test_trust_needs_enough_windows_across_distinct_operating_points() -> None:
    few = fit(points()[:3])
    assert few is not None and not few.trusted
    one_level = [StepPoint(4, p, 1000, step_s(4, p, 1000), 1) for p in (10, 100, 300, 900)]
    flat = fit(one_level)
    assert flat is not None and not flat.trusted  # the rows never moved
    assert fit(points()[:1]) is None


def test_a_window_gives_its_mean_step_and_bands_keep_one_point_each() -> None:
    point = point_of(window())
    assert point is not None
    assert (point.rows, point.prefill, point.kv) == (8.0, 50.0, 3000.0)
    assert point.step_s == pytest.approx(step_s(8, 50, 3000))
    assert point_of(window(steps=None)) is None
    kept = remember((), point)
    again = remember(kept, point)
    assert again == kept  # the same band: replaced, not added
    many: tuple[StepPoint, ...] = ()
    for pods in range(1, 4):
        for rows in range(1, 40):
            many = remember(many, StepPoint(rows, 10, 10, 0.01, pods))
    assert len(many) == MAX_POINTS
    assert {p.pods for p in of_fleet(many, 3)} == {3}


def test_rows_and_prompt_tokens_that_move_together_are_priced_as_one_token() -> None:
    # A load rising through one workload: prompt tokens a step a steady share of the rows
    # (code's windows: 0.35-0.41 of them), every token at 200 us. Priced apart, the split
    # between rows and prompt tokens is any the noise picks; priced as one, a prompt's
    # cost (its TTFT) is the token's.
    share = (0.35, 0.39, 0.34, 0.36, 0.41)
    rising = [
        StepPoint(r, s * r, 0.0, 0.0015 + 0.0002 * (r + s * r), 1)
        for r, s in zip((2, 3, 4, 9, 17), share, strict=True)
    ]
    model = fit(rising)
    assert model is not None and model.together and model.trusted
    assert model.per_row_s == model.per_prefill_s == pytest.approx(0.0002, rel=1e-6)
    assert model.step_s(1, 300, 0) == pytest.approx(0.0015 + 0.0002 * 301, rel=1e-6)
    assert "us/token (rows and prompt tokens moved together)" in model.describe()
    assert "prefill" not in model.describe()


def test_kv_that_moves_with_the_tokens_is_priced_with_them() -> None:
    # code's windows at two pods: rows, prompt tokens and the KV the rows attend all grow
    # with the load (KV: the rows times a steady context). Split three ways, the fit put
    # every cost on the KV by chance and called a prompt token free (TTFT 2-10 ms predicted,
    # 56-81 measured); as one token, a prompt carries the attention its rows saw.
    share, context = (0.35, 0.39, 0.34, 0.36, 0.41), (400, 380, 410, 395, 405)
    rising = [
        StepPoint(r, s * r, c * r, 0.0014 + 0.00016 * (r + s * r) + 0.15e-6 * c * r, 2)
        for r, s, c in zip((2, 3, 4, 9, 17), share, context, strict=True)
    ]
    model = fit(rising)
    assert model is not None and model.trusted and model.together == ("prefill", "kv")
    assert model.per_kv_s == 0 and model.per_prefill_s == model.per_row_s >= 0.00016
    assert model.step_s(1, 300, 0) >= 0.0014 + 0.00016 * 301
    assert "us/token (rows, prompt tokens and KV tokens moved together)" in model.describe()
    assert "kv" not in model.flat and "did not vary" not in model.describe()


def test_rows_and_prompt_tokens_that_vary_apart_keep_their_own_prices() -> None:
    model = fit(points())
    assert model is not None and not model.together
