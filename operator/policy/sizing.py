"""The sizing step's answer, the same whichever way it was reached (choice.py or
fallback.py): the knobs, the pods needed, and why."""

from __future__ import annotations

from dataclasses import dataclass

from batchpilot_operator.policy.predictor import Prediction
from batchpilot_operator.policy.replicas import Need
from batchpilot_server.batching_config import BatchingConfig


@dataclass(frozen=True)
class Sizing:
    config: BatchingConfig
    action: str  # one of types.Action
    reason: str
    need: Need | None  # None: the window holds no judgement on the pod count
    prediction: Prediction | None = None  # the chosen candidate's (choice.py only)
