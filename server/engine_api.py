"""What the engine promises its callers (the HTTP app, benchmarks, tests).

Torch-free. `batchpilot_server.engine.core.Engine` implements it:

    engine = Engine(EngineOptions(mode="continuous", config=BatchingConfig(...)), observer)
    await engine.start()
    stream = engine.submit(prompt_ids, SamplingParams(max_tokens=16), deadline_s=30.0)
    async for event in stream:        # TokenEvent per generated token
        ...
    stream.cancel()                   # frees its KV blocks; safe at any time
    engine.reconfigure(BatchingConfig(...))   # applies at the next scheduling decision
    await engine.shutdown()           # running requests finish; never-scheduled ones end
                                      # with EngineStoppedError (drain=True serves them all)
    engine.abort("grace period over") # every admitted request ends now with that reason

The engine trusts its input: the HTTP API (protocol.py) validates token ids and
sampling values once, at the boundary. `submit` raises synchronously:
QueueFullError, PromptTooLongError (prompt + max_tokens beyond `max_model_len`,
which the API refuses first), EngineStoppedError. A stream raises
DeadlineExceededError (waited past `deadline_s` unscheduled) or
EngineStoppedError (shutdown, abort, or the engine thread failed: the message
carries the reason).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.model_presets import default_served_name

FinishReason = Literal["stop", "length"]
# decode attention: native (the C kernel, CPU float32), torch, or auto (native
# where it applies and builds, else torch); see attention_kernel
AttentionBackend = Literal["auto", "native", "torch"]
ATTENTION_BACKENDS: tuple[AttentionBackend, ...] = ("auto", "native", "torch")
# the weights' dtype; auto: bfloat16 on a GPU (else float16), and on a CPU with native
# bfloat16 for a real checkpoint; else float32 (weights.resolve_dtype)
DTypeName = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[DTypeName, ...] = ("auto", "float32", "bfloat16", "float16")
# weight-only quantization, CPU only (see linear_kernels): int8, every projection and
# the LM head with per-channel scales, activations in the model's dtype; int4, the
# decoder's projections as 4-bit codes with a scale and a minimum per 32 inputs
# (GGUF's Q4_1 block), bfloat16 activations
Quantization = Literal["none", "int8", "int4"]
QUANTIZATIONS: tuple[Quantization, ...] = ("none", "int8", "int4")
# how a static or dynamic batch runs: ragged (a finished member stops computing and
# holds its slot until the batch ends) or padded (it keeps decoding, its outputs
# discarded, as classic padded batchers run)
Execution = Literal["ragged", "padded"]
EXECUTIONS: tuple[Execution, ...] = ("ragged", "padded")


class EngineError(Exception):
    """Base of the errors a submitted request can end with."""


class QueueFullError(EngineError):
    """`submit` refused: the waiting queue holds `max_queue_size` requests."""


class DeadlineExceededError(EngineError):
    """Raised from the stream: the request waited past its deadline unscheduled."""


class EngineStoppedError(EngineError):
    """`submit` refused, or stream ended: the engine is shutting down."""


class PromptTooLongError(EngineError):
    """`submit` refused: prompt + max_tokens exceed `max_model_len` (the model's context,
    capped to what the KV pool holds for one sequence)."""


# Below this, sampling is greedy (vLLM's choice): logits divided by a temperature
# of 1e-38 overflow float32 and the softmax turns to NaN.
GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """One sequence's sampling, as the engine's sampler applies it (batched over a step's
    rows). Each default changes nothing; the HTTP API validates ranges once."""

    max_tokens: int
    temperature: float = 0.0  # below GREEDY_BELOW_TEMPERATURE: greedy
    top_p: float = 1.0
    seed: int | None = None  # per-request generator: a seeded request is reproducible
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    top_k: int = 0  # 0: every token (OpenAI clients also send -1; the API maps it to 0)
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    # vLLM's and transformers' multiplicative penalty on tokens of prompt or output
    repetition_penalty: float = 1.0
    # OpenAI's additive penalties over the output so far: count x frequency + presence
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many are output
    # top-k log-probabilities per generated token (None: none; 0: the chosen token's only)
    logprobs: int | None = None
    # the prompt's own log-probabilities (completions `echo`), with this many top tokens
    prompt_logprobs: int | None = None
    # structured output: a compiled grammar (grammar.Grammar) whose `start()`
    # gives each sequence its matcher; the sampler masks what it forbids
    grammar: Grammar | None = field(default=None, compare=False)


class Grammar(Protocol):
    def start(self) -> Any: ...


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    index: int  # 0-based position in the output
    # None while the sequence runs; set on its last event. In dynamic mode the
    # last event of every sequence of a batch is delivered only when the whole
    # batch ends (the hostage effect).
    finish_reason: FinishReason | None = None
    # log-probability of `token_id` under the model's raw distribution (before
    # temperature and top_p)
    logprob: float | None = None
    # the engine step at whose end the event was handed out (Engine.stats().steps
    # counts them): a dynamic batch's final events all carry its last step
    step: int = 0
    # SamplingParams.logprobs = k: the k most likely (token id, logprob), best first
    top_logprobs: tuple[tuple[int, float], ...] = ()
    # SamplingParams.prompt_logprobs set: on the first event only, one entry per prompt
    # token (the first is None: nothing precedes it)
    prompt_logprobs: tuple[PromptLogprob | None, ...] | None = None


@dataclass(frozen=True)
class PromptLogprob:
    """One prompt token's log-probability given the tokens before it."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # the k most likely (token id, logprob)


# The scheduler's starvation bound by default: well past an interactive class's TTFT
# target (seconds), well within a batch class's end-to-end target (minutes), and below
# the server's queue timeout (30 s by default): at that bound or past it a starved
# request is timed out (504) the moment it would have been served.
CLASS_MAX_WAIT_S = 20.0
# Continuous mode: the prompt tokens lower classes compute together in a step that
# decodes a higher class's requests. Small against a 2048-token budget, so that such a
# step costs the higher class's TPOT little; more than none, so a lower class's prompt
# still progresses every step (and the age bound keeps holding).
LOWER_CLASS_PREFILL_TOKENS = 32


@dataclass(frozen=True)
class EngineOptions:
    mode: Mode
    config: BatchingConfig
    model: str = "tiny"  # a preset name, a model directory or a .gguf file
    device: str = "auto"  # auto | cpu | cuda
    kv_cache_mb: float = 64.0
    threads: int | None = None  # torch intra-op threads; None = torch default
    seed: int = 0  # model weights
    block_size: int = 16  # tokens per KV block
    attention: AttentionBackend = "auto"
    # CUDA only: size the KV pool as this fraction of free device memory
    # instead of kv_cache_mb (None: kv_cache_mb on every device)
    gpu_memory_fraction: float | None = None
    dtype: DTypeName = "auto"
    quantization: Quantization = "none"
    max_model_len: int | None = None  # None: the model's context
    served_model_name: str | None = None  # None: see `served_name`
    dynamic_execution: Execution = "ragged"  # static and dynamic modes
    # static mode: a partial batch fires once its oldest request waited this long
    # (None: never; only a full batch fires)
    max_wait_ms: float | None = None
    # automatic prefix caching: a request reuses the K/V of the longest prefix of its
    # tokens that earlier requests computed (block_pool)
    prefix_caching: bool = True
    # SLO classes: a request that arrived this long ago ranks above every class
    # (scheduler.class_rank), so no class starves
    class_max_wait_s: float = CLASS_MAX_WAIT_S
    # SLO classes, continuous: the lower classes' prompt tokens in a step that decodes
    # a higher class (scheduler_continuous)
    lower_class_prefill_tokens: int = LOWER_CLASS_PREFILL_TOKENS

    @property
    def served_name(self) -> str:
        """The model's name in the API and the metrics: served_model_name, else the
        preset's name, the directory's basename or the GGUF file's stem."""
        return self.served_model_name or default_served_name(self.model)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    kv_blocks_total: int
    kv_blocks_used: int
    steps: int = 0  # engine steps run so far (each runs a prefill and/or a decode forward)
    preemptions: int = 0  # sequences evicted for KV space so far
    # the waiting requests by SLO class (the classes with none waiting left out)
    waiting_by_class: dict[str, int] = field(default_factory=dict)

    @property
    def kv_usage_ratio(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


class EngineObserver(Protocol):
    """Hooks the engine calls (from its own thread) so the server can record metrics."""

    def on_scheduled(self, queue_wait_s: float) -> None: ...
    def on_step(self, batch_size: int, duration_s: float) -> None:
        """Once per step: its rows, and the seconds of its forwards and sampling."""
        ...

    def on_step_work(self, decode_rows: int, prefill_tokens: int, kv_tokens: int) -> None:
        """Once per step, before it runs: what it computes (scheduler.StepWork)."""
        ...

    def on_busy(self, seconds: float) -> None: ...
    def on_batch(self, batch_size: int) -> None: ...
    def on_hostage(self, seconds: float) -> None: ...
    def on_preemption(self) -> None: ...
    def on_slot_steps(self, active: int, finished: int, padding: int) -> None: ...
    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None: ...
    def on_spec_decode(self, drafted: list[int], accepted: list[int]) -> None:
        """Once per step with speculative decoding: per verified row, its draft tokens
        and how many of them it accepted."""
        ...


class NullObserver:
    """Records nothing: for benchmarks and tests that need no metrics."""

    def on_scheduled(self, queue_wait_s: float) -> None:
        pass

    def on_step(self, batch_size: int, duration_s: float) -> None:
        pass

    def on_step_work(self, decode_rows: int, prefill_tokens: int, kv_tokens: int) -> None:
        pass

    def on_busy(self, seconds: float) -> None:
        pass

    def on_batch(self, batch_size: int) -> None:
        pass

    def on_hostage(self, seconds: float) -> None:
        pass

    def on_preemption(self) -> None:
        pass

    def on_slot_steps(self, active: int, finished: int, padding: int) -> None:
        pass

    def on_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        pass

    def on_spec_decode(self, drafted: list[int], accepted: list[int]) -> None:
        pass
