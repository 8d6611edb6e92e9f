"""The step-time model: how long one engine step takes, fitted online from the pods' counters.

Pure and torch-free. Every window with engine steps gives one operating point, the
means per step of the window's totals (`Signals.steps`, `step_seconds`,
`step_decode_rows`, `step_prefill_tokens`, `step_kv_tokens`):

    step_s = fixed_s + per_row_s * rows + per_prefill_s * prefill_tokens + per_kv_s * kv_tokens

(weights are read once per step whatever it holds; each decode row adds its own
matrix rows, each prompt token computed its own, each KV token attended its
attention). A linear model of the means is the mean of the linear model, so a
window's mean point lies on the same plane as its steps.

The plane is fitted by least squares with non-negative coefficients (a free or
negative cost is noise on a flat curve): every subset of the terms is solved and the
best fit whose coefficients are all non-negative wins, which is the exact
non-negative least-squares answer for four terms. A term whose input did not vary
across the points (a steady prompt mix) cannot be told from the fixed cost and is left
out; the reason names the terms the fit used. Two terms whose inputs moved together
across the points cannot be told apart either: a window's decode rows and prompt tokens per
step both grow with its load, in the ratio of its workload's output to prompt lengths, and
a fit that prices them apart splits one cost between them by chance (the code workload's
windows priced a prompt token anywhere from 0 to 390 us, and its TTFT with it). Where
they correlate by `TOGETHER` or more they are priced as one: a decode row and a prompt
token are each one token through the same weights in one forward (attention, which
differs, is the KV term). Where the KV tokens a step attends moved with those tokens too
(a workload's contexts hold steady as its load moves: KV is rows times a steady
context), attention cannot be told from the weights either, and a fit free to split
them put the whole cost on either by chance: code's windows at two pods priced a prompt
token at 0-19 us in 9 of 14 fits, all of it on the KV, and predicted a TTFT of 2-10 ms
for 56-81 measured. Then the tokens carry the attention at the contexts the points saw.

For the same reason a decode row never costs less than a prompt token: where both vary
apart, the fit prices every token (rows and prompt tokens) at one price and a row at what
it adds beyond that (its sampling, its own bookkeeping), each non-negative. A fit left
free to price them apart found a row free on a real server whose few rows a step hid
their cost in the step's noise (SmolLM2's demo, 1-3 rows a 30 ms step), and took one pod
for a load it could not carry.

Points are kept per fleet size, like the old capacity line: where pods share hosts a
pod's speed depends on how many run. The fit is *trusted* once it goes through
`TRUSTED_POINTS` windows whose decode rows span `MIN_SPREAD`x: fewer, or one load
level, is a guess, and the rule steps by the fallback table (fallback.py) meanwhile.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
from batchpilot_operator.signals import Signals

MAX_POINTS = 24  # per band of rows and prompt tokens, over a few fleet sizes
TRUSTED_POINTS = 4  # windows a trusted fit goes through
MIN_SPREAD = 1.5  # the most decode rows seen must be this many times the fewest
VARIES = 0.1  # an input varies when its spread is at least this share of its mean
TOGETHER = 0.9  # rows and prompt tokens correlating this much are priced as one token
TERMS = ("rows", "prefill", "kv")
NOISE = 1e-9  # relative to the largest step: a coefficient this negative is rounding


@dataclass(frozen=True)
class StepPoint:
    """One window's mean step: its inputs, its seconds, and the fleet it was seen at."""

    rows: float
    prefill: float
    kv: float
    step_s: float
    pods: int = 0

    def inputs(self) -> tuple[float, float, float]:
        return (self.rows, self.prefill, self.kv)


def point_of(signals: Signals) -> StepPoint | None:
    """The window's mean step; None where it ran no steps or a counter is missing."""
    totals = (
        signals.steps, signals.step_seconds, signals.step_decode_rows,
        signals.step_prefill_tokens, signals.step_kv_tokens,
    )  # fmt: skip
    if any(value is None for value in totals):
        return None
    steps, seconds, rows, prefill, kv = (float(v) for v in totals)  # type: ignore[arg-type]
    if steps <= 0 or seconds <= 0:
        return None
    return StepPoint(rows / steps, prefill / steps, kv / steps, seconds / steps, signals.pods)


def remember(points: tuple[StepPoint, ...], point: StepPoint | None) -> tuple[StepPoint, ...]:
    """`point` as the newest of its band (fleet size, half-octave of rows, octave of prompt
    tokens), replacing the one there; at most MAX_POINTS, the least recently seen go first.

    One point per band rather than the newest windows: a steady load lands every window
    in one band, and a plane needs several.
    """
    if point is None:
        return points
    key = _band(point)
    kept = tuple(p for p in points if _band(p) != key)
    return (*kept, point)[-MAX_POINTS:]


def _band(point: StepPoint) -> tuple[int, int, int]:
    return (
        point.pods,
        round(2 * math.log2(max(point.rows, 0.5))),
        round(math.log2(max(point.prefill, 0.5))),
    )


def of_fleet(points: Sequence[StepPoint], pods: int) -> tuple[StepPoint, ...]:
    return tuple(p for p in points if p.pods == pods)


def fit_for(points: Sequence[StepPoint], pods: int) -> StepModel | None:
    """The fit at this fleet size; where that is not trusted (a steady load at a new size
    shows one operating point), the fit through every size's points if that one is: a
    pod's step is the same work whatever the fleet, and the reason names the fit used."""
    own = fit(of_fleet(points, pods))
    if own is not None and own.trusted:
        return own
    every = fit(points)
    if every is not None and every.trusted and len(every_size := {p.pods for p in points}) > 1:
        return replace(every, scope=f"across fleets of {', '.join(map(str, sorted(every_size)))}")
    return own


@dataclass(frozen=True)
class StepModel:
    """A fitted plane; coefficients in seconds (per row, per prompt token, per KV token)."""

    fixed_s: float
    per_row_s: float
    per_prefill_s: float
    per_kv_s: float
    points: int
    used: tuple[str, ...]  # the terms the fit could tell apart (TERMS' names)
    trusted: bool
    rms_error: float = 0.0  # seconds, over the points
    scope: str = ""  # empty: this fleet size's points; else which sizes' points
    flat: tuple[str, ...] = ()  # the terms whose input did not vary across the points
    # the terms that moved with the rows, priced with them as one token: "prefill", and
    # "kv" where the KV tokens moved with both
    together: tuple[str, ...] = ()
    max_rows: float = 0.0  # the most decode rows a step of the points held

    @property
    def form(self) -> tuple[str, ...]:
        """What makes two fits the same model: the points' scope and the terms used."""
        return (self.scope, *self.used, *(f"with {t}" for t in self.together))

    def step_s(self, rows: float, prefill: float, kv: float) -> float:
        return (
            self.fixed_s + self.per_row_s * rows + self.per_prefill_s * prefill
            + self.per_kv_s * kv
        )  # fmt: skip

    def describe(self) -> str:
        parts = [f"{self.fixed_s * 1000:.2f} ms"]
        names = {"rows": "row", "prefill": "prompt token", "kv": "KV token"}
        values = {"rows": self.per_row_s, "prefill": self.per_prefill_s, "kv": self.per_kv_s}
        if self.together:
            moved = (
                "rows, prompt tokens and KV tokens"
                if "kv" in self.together
                else "rows and prompt tokens"
            )
            names["rows"] = f"token ({moved} moved together)"
        parts += [f"{values[t] * 1e6:.2f} us/{names[t]}" for t in TERMS if t in self.used]
        free = [
            t for t in TERMS
            if t not in self.used and t not in self.flat and t not in self.together
        ]  # fmt: skip
        left = f"; {', '.join(self.flat)} did not vary" if self.flat else ""
        left += f"; {', '.join(free)} cost nothing measurable" if free else ""
        scope = f" {self.scope}" if self.scope else ""
        return f"step fit {' + '.join(parts)} over {self.points} windows{scope}{left}"


def fit(points: Sequence[StepPoint]) -> StepModel | None:
    """Non-negative least squares through the points; None with fewer than two."""
    if len(points) < 2:
        return None
    x = np.array([p.inputs() for p in points], dtype=float)
    rows = x[:, 0].copy()
    y = np.array([p.step_s for p in points], dtype=float)
    varied = [
        i for i in range(len(TERMS))
        if np.ptp(x[:, i]) > VARIES * max(abs(float(np.mean(x[:, i]))), 1e-12)
    ]  # fmt: skip
    both = 0 in varied and 1 in varied
    together: tuple[str, ...] = ()
    if both and np.corrcoef(x[:, 0], x[:, 1])[0, 1] >= TOGETHER:
        # one column of tokens, priced once, with the KV where it moved along too (see
        # the module docstring)
        x[:, 0] += x[:, 1]
        varied.remove(1)
        together = ("prefill",)
        if 2 in varied and np.corrcoef(x[:, 0], x[:, 2])[0, 1] >= TOGETHER:
            varied.remove(2)
            together = ("prefill", "kv")
    elif both:  # a row costs a prompt token and what it adds beyond one (see the docstring)
        x[:, 1] += x[:, 0]
    best: tuple[float, np.ndarray, tuple[int, ...]] | None = None
    for size in range(len(varied), -1, -1):
        for subset in itertools.combinations(varied, size):
            if len(subset) + 1 > len(points):
                continue
            design = np.column_stack([np.ones(len(points)), x[:, list(subset)]])
            coef, *_ = np.linalg.lstsq(design, y, rcond=None)
            # A coefficient that is zero by nature solves as rounding noise either side.
            if np.any(coef < -NOISE * float(np.max(np.abs(y)))):
                continue
            coef = np.maximum(coef, 0.0)
            sse = float(np.sum((design @ coef - y) ** 2))
            if best is None or sse < best[0] - 1e-18:
                best = (sse, coef, subset)
    if best is None:  # even the mean is negative: impossible for step seconds
        return None
    sse, coef, subset = best
    values = [0.0, 0.0, 0.0]
    for i, c in zip(subset, coef[1:], strict=True):
        values[i] = float(c)
    if together:
        values[1] = values[0]
    elif both:  # the token price is a row's too
        values[0] += values[1]
        subset = (0, *subset) if 1 in subset and 0 not in subset else subset
    # priced: a term whose cost over the inputs seen is more than rounding (an exact
    # flat curve solves every term at noise around zero)
    seen = np.array([p.inputs() for p in points], dtype=float).max(axis=0)
    floor = NOISE * float(np.max(np.abs(y)))
    used = tuple(TERMS[i] for i in subset if values[i] * float(seen[i]) > floor)
    spread = float(np.min(rows)) > 0 and float(np.max(rows)) >= MIN_SPREAD * float(np.min(rows))
    return StepModel(
        fixed_s=float(coef[0]),
        per_row_s=values[0],
        per_prefill_s=values[1],
        per_kv_s=values[2],
        points=len(points),
        used=used,
        trusted=len(points) >= TRUSTED_POINTS and spread,
        rms_error=math.sqrt(sse / len(points)),
        flat=tuple(
            TERMS[i] for i in range(len(TERMS)) if i not in varied and TERMS[i] not in together
        ),
        together=together,
        max_rows=float(np.max(rows)),
    )
