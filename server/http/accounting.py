"""Request accounting: each request's outcome, duration, TPOT and SLO verdict, counted once."""

from __future__ import annotations

import time

from batchpilot_server.batching_config import DEFAULT_CLASS
from batchpilot_server.http.server_state import ServerState
from batchpilot_server.http.slo_judge import RequestTiming, judge

# answers that are the server's failure to serve (queue full, shutting down or failed,
# queue timeout): they miss every stated SLO target; a client's own error is not judged
SLO_FAILURES = frozenset({429, 503, 504})


class RequestEnd:
    """Counts a request's outcome, an answered one's duration and TPOT, and its SLO
    verdict, once. A stream records them before its last bytes go out, so that a client
    which saw its request end finds it counted in /metrics (a load test reading the
    server's counters right after)."""

    def __init__(self, state: ServerState, arrival: float) -> None:
        self.state = state
        self.timing = RequestTiming(arrival)  # Generation records each token's time here
        # the request's SLO class once known (slo_class.py); one refused before its body
        # was read (a draining server's 503) is the default class's
        self.slo_class = DEFAULT_CLASS
        self.recorded = False

    def record(self, outcome: str, status: int | None = None) -> None:
        """`status`: the error's HTTP status (an ApiError's), which says whether a
        request that did not complete counts against the SLO."""
        if self.recorded:
            return
        self.recorded = True
        metrics, now, name = self.state.metrics, time.monotonic(), self.slo_class
        if outcome == "ok":
            metrics.request_duration.observe(now - self.timing.arrival_s, name)
            if (tpot := self.timing.tpot_s) is not None:
                metrics.request_tpot.observe(tpot, name)
        metrics.count_request(outcome)
        # its class's targets in force as it ends; None: the class states no target (or a
        # PUT removed the class while the request ran), so it is not judged
        targets = self.state.engine.config.slo.by_name().get(name)
        if targets is None:
            return
        if outcome == "ok":
            metrics.count_slo(judge(targets, self.timing, now), name)
        elif status in SLO_FAILURES:
            metrics.count_slo(judge(targets, None, now), name)
