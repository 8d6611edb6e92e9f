"""The one signal type the tuner reads, whatever source produced it.

Torch-free and I/O-free: the Prometheus source, the direct scrape and the
simulator all build `Signals` through the helpers here, so a p99 means the
same thing everywhere (a quantile read from the shared latency buckets).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

SignalStatus = Literal["ok", "no_data", "too_little_traffic", "no_traffic"]

# Below this much evidence (requests finished plus requests still in the system: waiting
# or running) a p99 is just the maximum of a handful of samples: the rule must not act on it.
MIN_REQUESTS_PER_WINDOW = 50
# The quantiles of prompt and output tokens per request every source reads (the low
# one shows the short answers, whose time per output token a long prompt moves most).
LENGTH_QUANTILES = (0.1, 0.5, 0.9, 0.99)


@dataclass(frozen=True)
class ClassSignals:
    """One SLO class's view of the window, read from the series' `class` label: its
    requests judged and met, misses per target, and its p99s (seconds; None where the
    class observed nothing). Beside the totals, which the tuner reads unchanged."""

    name: str
    slo_judged: float | None = None
    slo_met: float | None = None
    slo_missed: dict[str, float] = field(default_factory=dict)
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    p99_latency_s: float | None = None
    budget_attainment: float | None = None  # over the SLO's budget window
    # the class's requests waiting now, summed over pods; None: no pod exports the
    # waiting gauge by class (an older server)
    waiting: float | None = None
    # Its finished requests' output and prompt tokens at LENGTH_QUANTILES, as the totals'
    # (None: an older server, whose length histograms carry no class).
    output_tokens_p10: float | None = None
    output_tokens_p50: float | None = None
    output_tokens_p90: float | None = None
    output_tokens_p99: float | None = None
    prompt_tokens_p10: float | None = None
    prompt_tokens_p50: float | None = None
    prompt_tokens_p90: float | None = None
    prompt_tokens_p99: float | None = None

    @property
    def attainment(self) -> float | None:
        """The share of the class's judged requests that met every target."""
        if not self.slo_judged or self.slo_met is None:
            return None
        return self.slo_met / self.slo_judged


@dataclass(frozen=True)
class Signals:
    """What the servers of one policy did during the last window.

    Rates are per second over the window; `kv_usage` is the highest usage of
    any pod (the pod closest to running out decides); latencies in seconds.
    Optional fields are None where the source had no series for them.
    """

    status: SignalStatus
    window_s: float = 0.0
    requests: float = 0.0  # requests finished in the window
    request_rate: float = 0.0
    p99_latency_s: float | None = None
    queue_wait_p99_s: float | None = None
    kv_usage: float | None = None
    waiting: float = 0.0  # requests queued now, summed over pods
    running: float = 0.0  # sequences being generated now (the batches in flight), summed over pods
    preemption_rate: float = 0.0
    tokens_per_s: float = 0.0
    mean_batch_size: float | None = None  # sequences per executed step/batch
    mean_latency_s: float | None = None  # arrival to last byte, mean of finished requests
    # Output tokens per finished request: the 10th percentile, the median, the 90th and
    # the 99th (LENGTH_QUANTILES).
    output_tokens_p10: float | None = None
    output_tokens_p50: float | None = None
    output_tokens_p90: float | None = None
    output_tokens_p99: float | None = None
    # The capacity model's inputs: requests arriving (admitted or not) per second over the
    # newer half of the window (a load that just stepped up shows there, not in the
    # window's mean), seconds of model forwards per generated token (all pods' forward
    # time over all their tokens, prefills included), and how many pods the window covers.
    arrival_rate: float | None = None
    busy_s_per_token: float | None = None
    pods: int = 0  # 0: the source could not tell
    # The LLM SLO's view: p99 time to first token and p99 per-request time per output
    # token (seconds), and the pods' exact per-request judgement over the window
    # (`batchpilot_requests_slo_total`): requests judged, requests that met every
    # target, and misses per target (ttft, tpot, e2e). None: no series.
    ttft_p99_s: float | None = None
    tpot_p99_s: float | None = None
    slo_judged: float | None = None
    slo_met: float | None = None
    slo_missed: dict[str, float] = field(default_factory=dict)
    # Attainment over the SLO's longer budget window (None: not measured), for the
    # error budget left.
    budget_attainment: float | None = None
    # Prompt tokens per finished request, at the same quantiles.
    prompt_tokens_p10: float | None = None
    prompt_tokens_p50: float | None = None
    prompt_tokens_p90: float | None = None
    prompt_tokens_p99: float | None = None
    # The step-time model's inputs, summed over the pods for the window: engine steps,
    # their seconds, decode rows, prompt tokens computed, KV tokens attended.
    steps: float | None = None
    step_seconds: float | None = None
    step_decode_rows: float | None = None
    step_prefill_tokens: float | None = None
    step_kv_tokens: float | None = None
    # A pod's KV pool in tokens, the smallest pod's (None: no pod exports it, an older
    # server): what the batch's KV is sized against.
    kv_pool_tokens: float | None = None
    # Speculative decoding, summed over the pods: draft tokens verified and accepted per
    # second (0 where no pod speculates); their ratio is `spec_acceptance`.
    spec_draft_tokens_per_s: float = 0.0
    spec_accepted_tokens_per_s: float = 0.0
    detail: str = ""  # why the status is not ok, for humans
    # Each SLO class's own view (the `class` label), by name; empty where the pods export
    # no class label (an older server) or the source reads none. Status only: the tuner
    # reads the totals above.
    classes: dict[str, ClassSignals] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def output_spread(self) -> float | None:
        """p90 / p50 of the output lengths: 1 when all are equal, ~3.6 for a log-normal tail."""
        p50, p90 = self.output_tokens_p50, self.output_tokens_p90
        if p50 is None or p90 is None or p50 <= 0:
            return None
        return p90 / p50

    @property
    def spec_acceptance(self) -> float | None:
        """The share of verified draft tokens accepted; None when no draft was verified
        (speculation off, or an older server): what a larger k would mostly waste or win."""
        if self.spec_draft_tokens_per_s <= 0:
            return None
        return self.spec_accepted_tokens_per_s / self.spec_draft_tokens_per_s

    @property
    def demand_rate(self) -> float:
        """Requests per second the fleet must carry: arrivals where measured, else finished."""
        return self.request_rate if self.arrival_rate is None else self.arrival_rate

    @property
    def finished_rate(self) -> float:
        """Requests per second that finished (refused ones do not count)."""
        return self.requests / self.window_s if self.window_s > 0 else 0.0

    @property
    def mean_output_tokens(self) -> float | None:
        """Tokens generated per finished request over the window."""
        if self.requests <= 0 or self.tokens_per_s <= 0 or self.window_s <= 0:
            return None
        return self.tokens_per_s * self.window_s / self.requests

    @property
    def utilisation(self) -> float | None:
        """The share of the window the average pod spent in model forwards."""
        if self.busy_s_per_token is None or self.pods <= 0:
            return None
        return self.busy_s_per_token * self.tokens_per_s / self.pods

    @property
    def attainment(self) -> float | None:
        """The share of the window's judged requests that met every target."""
        if not self.slo_judged or self.slo_met is None:
            return None
        return self.slo_met / self.slo_judged

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def no_data(detail: str, window_s: float = 0.0) -> Signals:
    return Signals(status="no_data", window_s=window_s, detail=detail)


def traffic_status(
    requests: float,
    waiting: float,
    running: float,
    *,
    min_requests: int = MIN_REQUESTS_PER_WINDOW,
) -> SignalStatus:
    """Classify a window by the evidence it holds: enough to judge it, or not.

    Evidence is what finished and what is still in the system: a queue is requests the
    pods have not served yet, and so is a batch still generating (64 long answers filling
    the batch are load, however few of them finished in the window). So
    `requests + waiting + running >= min_requests` judges a window in which some request
    finished (a latency to read), and so does any number in the system at least as large
    as what finished. A slow model finishing 10 requests a window while 10 more wait is
    overloaded; one finishing 10 while 10 run has requests that outlast the window
    (Little's law: running / finished is the mean latency in windows), so no window at
    that load finishes more than run: holding for more finished requests would hold for
    good. Only a window with few finished requests and fewer in the system is too thin.
    One in which nothing finished has no latency to read, however much runs or waits: it
    is too thin (the round holds and says so), not without traffic.
    """
    in_system = waiting + running
    if requests <= 0 and in_system <= 0:
        return "no_traffic"
    if requests > 0 and (requests + in_system >= min_requests or in_system >= requests):
        return "ok"
    return "too_little_traffic"


# A window too thin to read p99s from still judges its SLO: misses this unlikely under
# the allowed share (a binomial tail) are evidence that the SLO is missed.
MISS_EVIDENCE_P = 0.01


def misses_are_evidence(judged: float | None, missed: float | None, allowed_share: float) -> bool:
    """Whether `missed` of `judged` requests is more than chance allows at `allowed_share`:
    P(at least that many misses | Binomial(judged, allowed_share)) < MISS_EVIDENCE_P."""
    n, k = round(judged or 0), round(missed or 0)
    if n <= 0 or k <= 0 or not 0 < allowed_share < 1:
        return False
    below = sum(
        math.comb(n, i) * allowed_share**i * (1 - allowed_share) ** (n - i) for i in range(k)
    )
    return 1 - below < MISS_EVIDENCE_P


def status_detail(
    status: SignalStatus, requests: float, waiting: float, running: float, *, min_requests: int
) -> str:
    """Why the window is not judged (see `traffic_status`), for humans; "" when it is."""
    if status == "no_traffic":
        return "no request finished in the window and none is waiting or running"
    if status == "too_little_traffic" and requests <= 0:
        return (
            f"no request finished in the window while {running:.0f} run and {waiting:.0f} "
            "wait: no latency to read yet"
        )
    if status == "too_little_traffic":
        return (
            f"only {requests:.0f} requests finished in the window, and fewer run and wait "
            f"({running:.0f} running, {waiting:.0f} waiting; need {min_requests} finished, "
            "running and waiting together, or as many running and waiting as finished)"
        )
    return ""


def histogram_quantile(
    q: float, upper_bounds: Sequence[float], cumulative_counts: Sequence[float]
) -> float | None:
    """Prometheus' `histogram_quantile` over cumulative bucket counts.

    `upper_bounds` ascending and ending with +Inf, `cumulative_counts` the
    matching `le` counts. Linear interpolation inside the bucket, like
    Prometheus, so a p99 from the scrape agrees with one from PromQL; a
    quantile that lands in the +Inf bucket answers the last finite bound.
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile must be in [0, 1], got {q}")
    if len(upper_bounds) != len(cumulative_counts) or not upper_bounds:
        raise ValueError("bucket bounds and counts must be non-empty and of equal length")
    total = cumulative_counts[-1]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(upper_bounds, cumulative_counts, strict=True):
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            in_bucket = count - lower_count
            if in_bucket <= 0:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / in_bucket
        lower_bound, lower_count = bound, count
    return lower_bound
