"""`torch.inference_mode` for the engine's per-step entry points, entered only where
it is not on already.

The engine thread runs its whole loop in inference mode (`Engine._run`); entering it
again per call (the `torch.inference_mode()` decorator builds a context object and
switches the mode twice) cost ~10 us of a ~2 ms tiny-model step at batch 1 in each of
`ModelRunner.step` and `Sampler.sample`. Callers outside the engine (tests, benchmarks)
still get the mode for the call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def inference_mode(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper
