"""The modules whose import registers Kopf handlers; `batchpilot operator` and the tests load these.

`handlers` reconciles each policy's objects; `autotune` starts and stops each
policy's tuning task.
"""

from __future__ import annotations

import importlib

HANDLER_MODULES: tuple[str, ...] = ("batchpilot_operator.handlers", "batchpilot_operator.autotune")


def load_handlers() -> None:
    """Import every handler module so that its decorators register on Kopf's default registry."""
    for module in HANDLER_MODULES:
        importlib.import_module(module)
