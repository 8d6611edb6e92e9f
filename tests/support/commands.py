"""The installed `batchpilot` script, run as a user runs it."""

from __future__ import annotations

import sys
from pathlib import Path

BATCHPILOT = Path(sys.executable).parent / "batchpilot"
# How long a test gives one run of the operator's command to answer or exit.
DEADLINE_S = 30.0
