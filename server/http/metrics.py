"""Prometheus metrics (the README's Metrics table), one registry per server app.

`ServerMetrics` is also the engine's `EngineObserver`: the engine calls its
hooks from the model thread; prometheus_client's metrics are thread-safe.

Outcomes of `batchpilot_requests_total`: `ok` (completed), `rejected` (not
admitted: invalid input, full queue, draining server), `timeout` (waited
past its deadline), `error` (failed or was abandoned by its client after
admission).
"""

from __future__ import annotations

from typing import Literal

from batchpilot_server import metric_names as names
from batchpilot_server.batching_config import DEFAULT_CLASS, BatchingConfig, Mode
from batchpilot_server.engine_api import EngineStats
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# --metrics-compat: "vllm" also exports vLLM's names for the same quantities
# (VllmMetrics), so that vLLM dashboards, KEDA triggers and the Gateway API Inference
# Extension's endpoint picker read batchpilot pods unchanged; "none": ours only.
MetricsCompat = Literal["vllm", "none"]
METRICS_COMPATS: tuple[MetricsCompat, ...] = ("vllm", "none")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024)
# A model step on this hardware takes ~1..100 ms: finer than request latency.
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.0,
    5.0,
)


class ServerMetrics:
    def __init__(
        self,
        *,
        model: str,
        mode: Mode,
        registry: CollectorRegistry | None = None,
        compat: MetricsCompat = "vllm",
        block_size: int = 16,
    ):
        self.model = model
        self.mode = mode
        self.registry = registry or CollectorRegistry()
        labels = list(names.COMMON_LABELS)
        self._values = {"model": model, "mode": mode}

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(name, doc, labels, buckets=buckets, registry=self.registry)
            return metric.labels(**self._values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry).labels(**self._values)

        def counter(name: str, doc: str) -> Counter:
            # prometheus_client appends `_total` itself.
            base = name.removesuffix("_total")
            return Counter(base, doc, labels, registry=self.registry).labels(**self._values)

        latency = names.LATENCY_BUCKETS
        self.vllm = VllmMetrics(model, self.registry, block_size) if compat == "vllm" else None
        vllm = self.vllm

        def by_class(
            name: str, doc: str, theirs: Histogram | None, buckets: tuple[float, ...] = latency
        ) -> ClassHistogram:
            family = Histogram(
                name, doc, [*labels, names.CLASS_LABEL], buckets=buckets, registry=self.registry
            )
            return ClassHistogram(family, self._values, theirs)

        self.request_duration = by_class(
            names.REQUEST_DURATION,
            "Arrival to last byte of completed requests.",
            vllm and vllm.e2e,
        )
        self.ttft = by_class(
            names.TIME_TO_FIRST_TOKEN, "Arrival to first token.", vllm and vllm.ttft
        )
        self.inter_token = by_class(
            names.INTER_TOKEN_LATENCY,
            "Time between tokens of one request.",
            vllm and vllm.inter_token,
        )
        self.queue_wait = histogram(names.QUEUE_WAIT, "Arrival to first scheduled.", latency)
        self.batch_size = histogram(
            names.BATCH_SIZE,
            "Sequences per executed step (continuous) or per batch (static, dynamic).",
            BATCH_SIZE_BUCKETS,
        )
        # by class too: the tuner predicts each class's tails from its own lengths (a
        # batch class's long prompts judged against a chat class's TTFT would size the
        # pool for a target they do not have)
        self.request_generation_tokens = by_class(
            names.REQUEST_GENERATION_TOKENS,
            "Output tokens of each finished request.",
            None,
            names.GENERATION_TOKEN_BUCKETS,
        )
        self.request_prompt_tokens = by_class(
            names.REQUEST_PROMPT_TOKENS,
            "Prompt tokens of each finished request.",
            None,
            names.PROMPT_TOKEN_BUCKETS,
        )
        self.request_tpot = by_class(
            names.REQUEST_TIME_PER_OUTPUT_TOKEN,
            "Each completed request's mean time per output token after its first.",
            vllm and vllm.request_tpot,
        )
        self.step_duration = histogram(
            names.STEP_DURATION,
            "One engine step: its forward (prefill and decode rows together) and its sampling.",
            STEP_BUCKETS,
        )
        self.step_decode_rows = counter(
            names.STEP_DECODE_ROWS_TOTAL, "Decode rows of the steps' forwards."
        )
        self.step_prefill_tokens = counter(
            names.STEP_PREFILL_TOKENS_TOTAL,
            "Prompt tokens the steps' prefill forwards computed (prefix-cache hits left out).",
        )
        self.step_kv_tokens = counter(
            names.STEP_KV_TOKENS_TOTAL,
            "KV tokens the steps attended: each row's context length at its step, summed.",
        )
        self.hostage = histogram(
            names.HOSTAGE, "Static, dynamic: a finished sequence's wait for its batch.", latency
        )
        self.kv_usage = gauge(names.KV_CACHE_USAGE, "Used / total KV cache blocks.")
        self.kv_capacity = gauge(
            names.KV_CACHE_CAPACITY_TOKENS, "The KV cache pool in tokens (blocks x block size)."
        )
        self._block_size = block_size
        self.running = gauge(names.REQUESTS_RUNNING, "Sequences being generated.")
        self.waiting = gauge(names.REQUESTS_WAITING, "Requests waiting to be scheduled.")
        self._waiting_by_class = Gauge(
            names.REQUESTS_WAITING_BY_CLASS,
            "Requests waiting to be scheduled, by SLO class.",
            [*labels, names.CLASS_LABEL],
            registry=self.registry,
        )
        self._classes: set[str] = set()  # every class known: each reads 0 while none waits
        requests = Counter(
            names.REQUESTS_TOTAL.removesuffix("_total"),
            "Completion requests by outcome.",
            [*labels, "outcome"],
            registry=self.registry,
        )
        self.requests = {
            outcome: requests.labels(**self._values, outcome=outcome) for outcome in names.OUTCOMES
        }
        slot_steps = Counter(
            names.BATCH_SLOT_STEPS_TOTAL.removesuffix("_total"),
            "Token positions of executed batches: active (computing a token a request "
            "needs), finished (held by a finished member of a static or dynamic batch, no "
            "compute), padding (computed only to keep the batch rectangular).",
            [*labels, "state"],
            registry=self.registry,
        )
        self.slot_steps = {
            state: slot_steps.labels(**self._values, state=state) for state in names.SLOT_STATES
        }
        structured = Histogram(
            names.STRUCTURED_OUTPUT,
            "Structured output's cost: compiling a schema (phase compile, once per schema "
            "text) and masking one step's grammar rows (phase mask).",
            [*labels, "phase"],
            buckets=STEP_BUCKETS,
            registry=self.registry,
        )
        self.structured_output = {
            phase: structured.labels(**self._values, phase=phase)
            for phase in names.STRUCTURED_OUTPUT_PHASES
        }
        slo = Counter(
            names.REQUESTS_SLO_TOTAL.removesuffix("_total"),
            "Requests judged against their SLO class's targets in force as they end: per "
            "stated target met or missed, and target all (every stated target held).",
            [*labels, names.CLASS_LABEL, "result", "target"],
            registry=self.registry,
        )
        self._slo = slo
        self._open_class(DEFAULT_CLASS)  # the default class's series exist from the start
        self._slo_target = Gauge(
            names.SLO_TARGET,
            "The SLO targets in force, in seconds (the stated ones).",
            [*labels, "target"],
            registry=self.registry,
        )
        self.arrivals = counter(names.REQUESTS_ARRIVED_TOTAL, "Generation requests arrived.")
        self.prompt_tokens = counter(names.PROMPT_TOKENS_TOTAL, "Prompt tokens admitted.")
        self.generation_tokens = counter(names.GENERATION_TOKENS_TOTAL, "Tokens generated.")
        self.preemptions = counter(names.PREEMPTIONS_TOTAL, "Sequences evicted for KV space.")
        self.prefix_cache_queries = counter(
            names.PREFIX_CACHE_QUERIES_TOTAL,
            "Tokens of admitted sequences looked up in the prefix cache.",
        )
        self.prefix_cache_hits = counter(
            names.PREFIX_CACHE_HITS_TOTAL, "Tokens found in the prefix cache (not computed again)."
        )
        self.spec_draft_tokens = counter(
            names.SPEC_DRAFT_TOKENS_TOTAL, "Draft tokens verified (speculative decoding)."
        )
        self.spec_accepted_tokens = counter(
            names.SPEC_ACCEPTED_TOKENS_TOTAL, "Draft tokens accepted (speculative decoding)."
        )
        self.engine_busy = counter(
            names.ENGINE_BUSY_SECONDS_TOTAL,
            "Seconds the engine thread spent on steps (scheduling, forwards, sampling, "
            "handing tokens out), its waits for work left out.",
        )
        self.config_max_batch_size = gauge(names.CONFIG_MAX_BATCH_SIZE, "max_batch_size in force.")
        self.config_batch_timeout = gauge(
            names.CONFIG_BATCH_TIMEOUT, "Batch timeout in force, in seconds."
        )
        self.config_prefill_token_budget = gauge(
            names.CONFIG_PREFILL_TOKEN_BUDGET, "prefill_token_budget in force."
        )
        if self.vllm is not None:  # each observation reaches both names
            self.queue_wait = Both(self.queue_wait, self.vllm.queue_time)
            self.prompt_tokens = Both(self.prompt_tokens, self.vllm.prompt_tokens)
            self.generation_tokens = Both(self.generation_tokens, self.vllm.generation_tokens)

    # --- EngineObserver: called from the engine's thread -------------------

    def on_scheduled(self, queue_wait_s: float) -> None:
        self.queue_wait.observe(queue_wait_s)

    def on_step(self, batch_size: int, duration_s: float) -> None:
        self.step_duration.observe(duration_s)

    def on_step_work(self, decode_rows: int, prefill_tokens: int, kv_tokens: int) -> None:
        self.step_decode_rows.inc(decode_rows)
        self.step_prefill_tokens.inc(prefill_tokens)
        self.step_kv_tokens.inc(kv_tokens)

    def on_busy(self, seconds: float) -> None:
        self.engine_busy.inc(seconds)

    def on_batch(self, batch_size: int) -> None:
        # The engine reports a step's sequences (continuous) or a fired batch (dynamic).
        self.batch_size.observe(batch_size)

    def on_hostage(self, seconds: float) -> None:
        self.hostage.observe(seconds)

    def on_preemption(self) -> None:
        self.preemptions.inc()

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_cache_queries.inc(queried_tokens)
        self.prefix_cache_hits.inc(hit_tokens)

    def on_spec_decode(self, drafted: list[int], accepted: list[int]) -> None:
        self.spec_draft_tokens.inc(sum(drafted))
        self.spec_accepted_tokens.inc(sum(accepted))
        if self.vllm is not None:
            self.vllm.count_spec_decode(drafted, accepted)

    def on_slot_steps(self, active: int, finished: int, padding: int) -> None:
        for state, count in zip(names.SLOT_STATES, (active, finished, padding), strict=True):
            if count:
                self.slot_steps[state].inc(count)

    # --- server side --------------------------------------------------------

    def count_request(self, outcome: str) -> None:
        self.requests[outcome].inc()

    def count_slo(self, verdict: dict[str, bool], slo_class: str = DEFAULT_CLASS) -> None:
        """One request's judgement (slo_judge.judge) in its class: each target it names,
        met or missed."""
        for target, met in verdict.items():
            self._slo.labels(
                **self._values,
                **{names.CLASS_LABEL: slo_class},
                result="met" if met else "missed",
                target=target,
            ).inc()

    def _open_class(self, slo_class: str) -> None:
        """A class's series from when it is known, at 0: a rate over a window then counts
        its first requests too (a series born at its first request has no earlier sample
        for `increase` to start from)."""
        for result in names.SLO_RESULTS:
            for target in names.SLO_TARGETS:
                self._slo.labels(
                    **self._values, **{names.CLASS_LABEL: slo_class}, result=result, target=target
                )
        for by_class in (self.request_duration, self.ttft, self.inter_token, self.request_tpot,
                         self.request_prompt_tokens, self.request_generation_tokens):  # fmt: skip
            by_class.open(slo_class)
        self._classes.add(slo_class)
        self._waiting_child(slo_class)

    def _waiting_child(self, slo_class: str) -> Gauge:
        return self._waiting_by_class.labels(**self._values, **{names.CLASS_LABEL: slo_class})

    def set_config(self, config: BatchingConfig) -> None:
        for slo_class in config.slo.classes:
            self._open_class(slo_class.name)
        self.config_max_batch_size.set(config.max_batch_size)
        self.config_batch_timeout.set(config.batch_timeout_s)
        self.config_prefill_token_budget.set(config.prefill_token_budget)
        self._slo_target.clear()  # a target no longer stated leaves the exposition
        for target, ms in config.slo.stated.items():
            self._slo_target.labels(**self._values, target=target).set(ms / 1000.0)

    def exposition(self, stats: EngineStats) -> bytes:
        """The text format, with the engine gauges read at scrape time."""
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        # a class once seen waiting stays known: its gauge must fall back to 0 with it
        self._classes.update(stats.waiting_by_class)
        for slo_class in self._classes:
            self._waiting_child(slo_class).set(stats.waiting_by_class.get(slo_class, 0))
        self.kv_usage.set(stats.kv_usage_ratio)
        self.kv_capacity.set(stats.kv_blocks_total * self._block_size)
        if self.vllm is not None:
            self.vllm.read(stats)
        return generate_latest(self.registry)


class ClassHistogram:
    """A histogram by SLO class (a latency, or a request's tokens); each observation also
    reaches vLLM's name (`theirs`, where there is one), which keeps its own labels. The
    default class's series exist from the start."""

    def __init__(self, ours: Histogram, values: dict[str, str], theirs: Histogram | None) -> None:
        self._ours = ours
        self._values = values
        self._theirs = theirs
        self.open(DEFAULT_CLASS)

    def open(self, slo_class: str) -> None:
        """The class's series, at 0."""
        self._child(slo_class)

    def _child(self, slo_class: str) -> Histogram:
        return self._ours.labels(**self._values, **{names.CLASS_LABEL: slo_class})

    def observe(self, value: float, slo_class: str = DEFAULT_CLASS) -> None:
        self._child(slo_class).observe(value)
        if self._theirs is not None:
            self._theirs.observe(value)


class Both:
    """One observation recorded under two names (ours and vLLM's)."""

    def __init__(self, ours: Histogram | Counter, theirs: Histogram | Counter) -> None:
        self._metrics = (ours, theirs)

    def observe(self, value: float) -> None:
        for metric in self._metrics:
            metric.observe(value)  # type: ignore[union-attr]

    def inc(self, amount: float = 1) -> None:
        for metric in self._metrics:
            metric.inc(amount)  # type: ignore[union-attr]


class VllmMetrics:
    """vLLM's names (vllm/v1/metrics/loggers.py) with its label `model_name`."""

    def __init__(self, model: str, registry: CollectorRegistry, block_size: int) -> None:
        label = {"model_name": model}
        self._block_size = block_size

        def histogram(name: str, doc: str) -> Histogram:
            metric = Histogram(
                name, doc, ["model_name"], buckets=names.LATENCY_BUCKETS, registry=registry
            )
            return metric.labels(**label)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, ["model_name"], registry=registry).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            base = name.removesuffix("_total")
            return Counter(base, doc, ["model_name"], registry=registry).labels(**label)

        self.running = gauge(names.VLLM_REQUESTS_RUNNING, "Sequences being generated.")
        self.waiting = gauge(names.VLLM_REQUESTS_WAITING, "Requests waiting to be scheduled.")
        self.kv_usage = gauge(names.VLLM_KV_CACHE_USAGE, "KV-cache usage, 0 to 1.")
        self.ttft = histogram(names.VLLM_TIME_TO_FIRST_TOKEN, "Arrival to first token.")
        self.inter_token = histogram(
            names.VLLM_INTER_TOKEN_LATENCY, "Time between tokens of one request."
        )
        self.e2e = histogram(names.VLLM_E2E_REQUEST_LATENCY, "Arrival to last byte.")
        self.queue_time = histogram(names.VLLM_REQUEST_QUEUE_TIME, "Arrival to first scheduled.")
        self.request_tpot = histogram(
            names.VLLM_REQUEST_TIME_PER_OUTPUT_TOKEN,
            "Each completed request's mean time per output token after its first.",
        )
        self.prompt_tokens = counter(names.VLLM_PROMPT_TOKENS_TOTAL, "Prompt tokens admitted.")
        self.generation_tokens = counter(names.VLLM_GENERATION_TOKENS_TOTAL, "Tokens generated.")
        self.spec_drafts = counter(
            names.VLLM_SPEC_DECODE_NUM_DRAFTS, "Drafts verified (speculative decoding)."
        )
        self.spec_draft_tokens = counter(
            names.VLLM_SPEC_DECODE_NUM_DRAFT_TOKENS, "Draft tokens verified."
        )
        self.spec_accepted_tokens = counter(
            names.VLLM_SPEC_DECODE_NUM_ACCEPTED_TOKENS, "Draft tokens accepted."
        )
        self._spec_per_pos = Counter(
            names.VLLM_SPEC_DECODE_ACCEPTED_PER_POS.removesuffix("_total"),
            "Draft tokens accepted, by their position in the draft.",
            ["model_name", "position"],
            registry=registry,
        )
        # vLLM's info gauge: value 1, the cache's configuration in its labels
        self._cache_config = Gauge(
            names.VLLM_CACHE_CONFIG_INFO,
            "Information of the KV cache's configuration.",
            ["model_name", "block_size", "num_gpu_blocks"],
            registry=registry,
        )
        self._model = model
        self._blocks: int | None = None

    def count_spec_decode(self, drafted: list[int], accepted: list[int]) -> None:
        """One step's verified drafts: their lengths, and the tokens each accepted."""
        self.spec_drafts.inc(len(drafted))
        self.spec_draft_tokens.inc(sum(drafted))
        self.spec_accepted_tokens.inc(sum(accepted))
        for count in accepted:
            for position in range(count):  # a draft is accepted from its start
                self._spec_per_pos.labels(model_name=self._model, position=str(position)).inc()

    def read(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_usage.set(stats.kv_usage_ratio)
        if self._blocks != stats.kv_blocks_total:  # known once the engine sized its pool
            self._cache_config.clear()
            self._blocks = stats.kv_blocks_total
            self._cache_config.labels(
                model_name=self._model,
                block_size=str(self._block_size),
                num_gpu_blocks=str(stats.kv_blocks_total),
            ).set(1)
