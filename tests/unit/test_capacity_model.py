"""The capacity model: samples from windows, the line through them, and what it predicts."""

from __future__ import annotations

import math
import random

import pytest
from batchpilot_operator.capacity_model import (
    MAX_SAMPLES,
    CapacityModel,
    StepSample,
    fit,
    of_fleet,
    remember,
    sample_of,
)
from batchpilot_operator.signals import Signals

FIXED_S, PER_SEQ_S = 0.004, 0.0005  # a CPU-like line: weights 4 ms, each sequence 0.5 ms


def window(batch: float, fixed_s: float = FIXED_S, per_seq_s: float = PER_SEQ_S) -> Signals:
    """A window whose engine iterated at `batch` on the line: busy per token = iteration / b."""
    iteration = fixed_s + per_seq_s * batch
    return Signals(
        status="ok", requests=600, request_rate=10.0, tokens_per_s=640.0,
        mean_batch_size=batch, busy_s_per_token=iteration / batch,
    )  # fmt: skip


def test_a_window_gives_its_mean_batch_and_iteration_time() -> None:
    sample = sample_of(window(8.0))
    assert sample is not None
    assert sample.batch == 8.0
    assert sample.iteration_s == pytest.approx(FIXED_S + PER_SEQ_S * 8)


@pytest.mark.parametrize(
    "signals",
    [
        Signals(status="too_little_traffic", mean_batch_size=4.0, busy_s_per_token=0.001),
        Signals(status="ok", mean_batch_size=None, busy_s_per_token=0.001),
        Signals(status="ok", mean_batch_size=4.0, busy_s_per_token=None),
        Signals(status="ok", mean_batch_size=0.0, busy_s_per_token=0.001),
    ],
)
def test_a_window_without_traffic_or_series_gives_no_sample(signals: Signals) -> None:
    assert sample_of(signals) is None


def test_samples_keep_the_newest_of_each_batch_band_and_skip_none() -> None:
    samples: tuple[StepSample, ...] = ()
    for batch in (2.0, 8.0, 8.2, 7.9):
        samples = remember(samples, StepSample(batch, 0.01))
    samples = remember(samples, None)
    # a steady load at ~8 refreshes its own band and keeps the line's other end
    assert [s.batch for s in samples] == [2.0, 7.9]
    assert fit(samples) is not None
    for k in range(40):  # 40 half-octaves: only the most recent MAX_SAMPLES bands stay
        samples = remember(samples, StepSample(2 ** (k / 2), 0.01))
    assert len(samples) == MAX_SAMPLES and samples[-1].batch == 2 ** 19.5


def test_samples_are_kept_and_fitted_per_fleet_size() -> None:
    one = [StepSample(2.0, 0.005, pods=1), StepSample(8.0, 0.008, pods=1)]
    # two pods sharing one host: each iterates slower at the same batch
    two = [StepSample(3.0, 0.012, pods=2)]
    samples: tuple[StepSample, ...] = ()
    for sample in (*one, *two):
        samples = remember(samples, sample)
    assert len(samples) == 3  # same band, other fleet: both kept
    assert of_fleet(samples, 1) == tuple(one) and fit(of_fleet(samples, 2)) is None
    model = fit(of_fleet(samples, 1))
    assert model is not None and model.per_sequence_s == pytest.approx(0.0005)


def test_fit_recovers_the_line_from_two_batch_sizes() -> None:
    samples = tuple(s for b in (2.0, 2.0, 8.0) if (s := sample_of(window(b))) is not None)
    model = fit(samples)
    assert model is not None and model.samples == 3
    assert model.fixed_s == pytest.approx(FIXED_S)
    assert model.per_sequence_s == pytest.approx(PER_SEQ_S)


@pytest.mark.parametrize("seed", range(5))
def test_fit_through_noisy_samples_stays_close(seed: int) -> None:
    rng = random.Random(seed)
    batches = [2 ** (i / 2) for i in range(12)]  # 1 .. 45, one per band
    rng.shuffle(batches)
    samples = tuple(
        StepSample(b, (FIXED_S + PER_SEQ_S * b) * rng.uniform(0.95, 1.05)) for b in batches
    )
    model = fit(samples)
    assert model is not None
    for batch in (4, 16, 45):
        assert model.iteration_s(batch) == pytest.approx(FIXED_S + PER_SEQ_S * batch, rel=0.1)


def test_no_model_until_the_samples_span_two_batch_sizes() -> None:
    assert fit(()) is None
    assert fit((StepSample(4.0, 0.006),)) is None
    # 4 and 5 are too close to tell a slope from noise
    assert fit((StepSample(4.0, 0.006), StepSample(5.0, 0.0065))) is None


def test_a_falling_line_reads_flat_and_a_negative_intercept_goes_through_zero() -> None:
    flat = fit((StepSample(2.0, 0.010), StepSample(16.0, 0.009)))
    assert flat is not None and flat.per_sequence_s == 0.0
    assert flat.fixed_s == pytest.approx(0.0095)
    origin = fit((StepSample(2.0, 0.001), StepSample(16.0, 0.016)))
    assert origin is not None and origin.fixed_s == 0.0 and origin.per_sequence_s > 0


def test_throughput_and_the_batch_that_carries_a_rate() -> None:
    model = CapacityModel(FIXED_S, PER_SEQ_S, 2)
    tokens = 64.0
    # one pod at batch 16: 16 sequences every 12 ms, 64 tokens each
    assert model.throughput_rps(16, tokens) == pytest.approx(16 / (tokens * 0.012))
    rate = 15.0
    batch = model.batch_for(rate, tokens, utilisation=0.8)
    assert batch is not None
    assert 0.8 * model.throughput_rps(batch, tokens) >= rate
    assert 0.8 * model.throughput_rps(batch - 1, tokens) < rate  # the smallest that does
    # throughput levels off at 1 / (tokens * per_seq): 31.25 req/s here, 25 at 80 %
    assert model.batch_for(26.0, tokens, utilisation=0.8) is None


def test_largest_batch_within_an_iteration_budget() -> None:
    model = CapacityModel(FIXED_S, PER_SEQ_S, 2)
    assert model.largest_batch_within(FIXED_S + PER_SEQ_S * 20) == 20
    assert model.largest_batch_within(FIXED_S / 2) == 1  # never below one
    assert model.largest_batch_within(1.0) == math.floor((1.0 - FIXED_S) / PER_SEQ_S)
    assert CapacityModel(0.01, 0.0, 2).largest_batch_within(0.02) > 10**6  # flat: no limit
    assert "per sequence" in model.describe() and "2 windows" in model.describe()
