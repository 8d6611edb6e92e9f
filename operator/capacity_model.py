"""The capacity model: what one pod carries at a batch size, fitted from its own signals.

Pure and torch-free. Each window with traffic gives one sample: the mean batch
size `b` and the engine's iteration time at that batch, `b x busy seconds per
generated token` (every forward of the window, prefills included, over every
token it produced: one iteration advances `b` sequences by one token). The
model is a line through the recent samples,

    iteration_s(b) = fixed_s + per_sequence_s * b

(weights are read once per iteration whatever the batch; each sequence adds
its own rows and attention), and from it, for requests of `m` output tokens:

    throughput_rps(b) = b / (m * iteration_s(b))      one pod, always busy
    running_s(b) ~ observed running time * iteration_s(b) / iteration_s(b_seen)

A line needs samples at two clearly different batch sizes; until then there
is no model and the tuner steps by AIMD (tuner.py). Samples are kept per
fleet size and a line is fitted through those of the fleet that runs: where
pods share hosts (the local demo's servers share two cores) a pod's speed
depends on how many run, and a line across fleet sizes would read that as
the batch's cost. docs/tuning.md gives the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from batchpilot_operator.signals import Signals

MAX_SAMPLES = 24  # half-octave batch bands (12 span 1 to 64), over a few fleet sizes
MIN_SPREAD = 1.5  # the largest sampled batch must be this many times the smallest
# A line through fewer windows sizes the batch (cheap to move again) but not the fleet:
# two windows of a start-up, under a queue and a changing load, are a guess.
TRUSTED_WINDOWS = 3


@dataclass(frozen=True)
class StepSample:
    """One window's mean batch size and the iteration time seen at it."""

    batch: float
    iteration_s: float
    pods: int = 0  # the fleet size it was seen at (0: unknown)


def sample_of(signals: Signals) -> StepSample | None:
    """The window's sample; None where the window saw too little to give one."""
    batch, per_token = signals.mean_batch_size, signals.busy_s_per_token
    if not signals.ok or batch is None or per_token is None or batch <= 0 or per_token <= 0:
        return None
    return StepSample(batch, batch * per_token, signals.pods)


def remember(samples: tuple[StepSample, ...], sample: StepSample | None) -> tuple[StepSample, ...]:
    """`sample` added as the newest of its half-octave of batch sizes at its fleet size,
    replacing the one there; at most MAX_SAMPLES, the least recently seen go first.

    One sample per batch size band, not the newest windows: under a steady load
    every window lands in one band, and a line needs two. The band a load
    visits is always fresh; others keep what the load last showed there.
    """
    if sample is None:
        return samples
    key = (sample.pods, _band(sample.batch))
    kept = tuple(s for s in samples if (s.pods, _band(s.batch)) != key)
    return (*kept, sample)[-MAX_SAMPLES:]


def of_fleet(samples: Sequence[StepSample], pods: int) -> tuple[StepSample, ...]:
    """The samples seen at this fleet size."""
    return tuple(s for s in samples if s.pods == pods)


def _band(batch: float) -> int:
    return round(2 * math.log2(batch))


@dataclass(frozen=True)
class CapacityModel:
    fixed_s: float
    per_sequence_s: float
    samples: int

    def iteration_s(self, batch: float) -> float:
        return self.fixed_s + self.per_sequence_s * batch

    def throughput_rps(self, batch: float, output_tokens: float) -> float:
        """Requests per second one always-busy pod finishes at `batch`."""
        return batch / (output_tokens * self.iteration_s(batch))

    def batch_for(self, rate_rps: float, output_tokens: float, utilisation: float) -> int | None:
        """The smallest batch whose throughput carries `rate_rps` at `utilisation` of it;
        None when no batch does (throughput levels off at 1 / (m * per_sequence_s))."""
        need = rate_rps * output_tokens / utilisation  # iterations' worth of sequences per s
        # b >= need * (fixed + per * b)  <=>  b * (1 - need * per) >= need * fixed
        room = 1.0 - need * self.per_sequence_s
        if room <= 0:
            return None
        return max(1, math.ceil(need * self.fixed_s / room - 1e-9))

    def largest_batch_within(self, iteration_s: float) -> int:
        """The largest batch whose iteration takes at most `iteration_s` (at least 1)."""
        if self.per_sequence_s <= 0:
            return 1 << 30
        return max(1, math.floor((iteration_s - self.fixed_s) / self.per_sequence_s + 1e-9))

    def describe(self) -> str:
        return (
            f"iteration {self.fixed_s * 1000:.2f} ms + {self.per_sequence_s * 1000:.3f} ms "
            f"per sequence ({self.samples} windows)"
        )


def fit(samples: Sequence[StepSample]) -> CapacityModel | None:
    """Least squares through the samples; None while they do not span two batch sizes.

    A negative slope (noise on a flat, GPU-like curve) is read as flat, and a
    negative intercept as a line through the origin, so the model never
    predicts a free or negative iteration.
    """
    if len(samples) < 2:
        return None
    xs = [s.batch for s in samples]
    ys = [s.iteration_s for s in samples]
    if max(xs) < MIN_SPREAD * min(xs):
        return None
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / sxx
    if slope <= 0:
        return CapacityModel(mean_y, 0.0, n)
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        slope = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs)
        intercept = 0.0
    return CapacityModel(intercept, slope, n)
