"""The hostage example both engine and serving benchmarks run: max batch 8, batch
timeout 10 ms; one request at t=0 and three more within 10 ms, forced (ignore_eos)
to 10, 50, 100 and 200 output tokens. In dynamic mode all four form one batch and
the 10-token answer waits for the 200-token one; in continuous mode each leaves
as soon as it is done."""

from __future__ import annotations

LENGTHS = (10, 50, 100, 200)
# inside the 10 ms timeout with room for the HTTP hand-off of the last request,
# so that dynamic mode batches all four together
OFFSETS_S = (0.0, 0.002, 0.004, 0.006)
MAX_BATCH = 8
TIMEOUT_MS = 10.0


def describe() -> str:
    offsets = ", ".join(f"{t * 1e3:g}" for t in OFFSETS_S[1:])
    return (
        f"max batch {MAX_BATCH}, batch timeout {TIMEOUT_MS:g} ms; one request at t=0 and "
        f"three more {offsets} ms later, of "
        + "/".join(map(str, LENGTHS))
        + " output tokens (ignore_eos)"
    )
