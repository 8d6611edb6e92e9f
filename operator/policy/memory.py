"""The rule's memory between rounds. One writer: the round (`round.decide`) returns the
next memory with its decision, and the loop keeps it; nothing else changes it (a
restarted operator only seeds the replica part from the policy's status).

- `since_change`: rounds since the knobs, the fleet or the mode last moved (or the
  fleet was still settling); the next window never reaches back past it;
- `points`: the step model's operating points; `errors`: the fit's recent relative
  prediction errors on the config in force (`FitErrors`: those of the fit's form alone);
- `replicas` and `mode`: the replica count's and the mode choice's own memories;
- `acceptance`: the last per-token draft acceptance measured (speculation.py): at k = 0
  the pods verify no drafts, and a k chosen again is judged by what was seen.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from batchpilot_operator.policy.mode import ModeState
from batchpilot_operator.policy.step_model import StepPoint
from batchpilot_operator.policy.types import ReplicaState

SINCE_CHANGE_CAP = 1000
ERROR_HISTORY = 3  # a fit's last errors kept: the median of three rides out one outlier


@dataclass(frozen=True)
class FitErrors:
    """The last errors of one form of fit (its scope and the terms it used). A refit
    through other terms or other fleets' points is another model: once a window judges
    it, it starts its own errors, so that a degenerate new fit is judged on its own
    error, not hidden behind the median of the fit it replaced; until then, the errors
    of the fit it replaced are the evidence there is."""

    form: tuple[str, ...] = ()
    values: tuple[float, ...] = ()

    def of(self, form: tuple[str, ...], error: float | None) -> FitErrors:
        """The errors with this round's fit of `form` and its `error` (None: not judged)."""
        if error is None:
            return self
        values = self.values if form == self.form else ()
        return FitErrors(form, (*values, error)[-ERROR_HISTORY:])

    def median(self) -> float | None:
        return statistics.median(self.values) if self.values else None


@dataclass(frozen=True)
class PolicyMemory:
    # A fresh rule has made no change, so its first window is a full one.
    since_change: int = SINCE_CHANGE_CAP
    points: tuple[StepPoint, ...] = ()
    errors: FitErrors = field(default_factory=FitErrors)
    replicas: ReplicaState = field(default_factory=ReplicaState)
    mode: ModeState = field(default_factory=ModeState)
    acceptance: float | None = None
