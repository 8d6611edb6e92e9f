"""`batching.mode: auto`'s choice lives in `policy/mode.py` and runs inside the round;
this name stays for the tests and tools that import its parameters."""

from batchpilot_operator.policy.mode import ModeChoice, ModeParams, ModeState, choose_mode

__all__ = ["ModeChoice", "ModeParams", "ModeState", "choose_mode"]
