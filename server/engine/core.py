"""The engine: an asyncio front over a model loop that runs in its own thread.

`submit` (event loop) hands a request to the scheduler under a lock and returns
a `RequestStream`. The engine thread loops: the scheduler plans a step, the
model runs it outside the lock, and the scheduler takes the sampled tokens
back and says which events go out; they reach the loop in one
`call_soon_threadsafe`, so HTTP keeps answering while the model computes. The
scheduler (`scheduler.py`) owns every queue and every policy decision; the
engine owns the model, the request streams and the thread.

Shutdown: `shutdown()` stops admitting new requests; requests already
scheduled (running, or preempted and waiting to be recomputed) run to the end;
requests never scheduled end with `EngineStoppedError` at once.
`shutdown(drain=True)` instead serves every admitted request before stopping.
`abort(reason)` ends every admitted request now with `EngineStoppedError(reason)`
(a shutdown grace period ran out); `shutdown()` then returns after one step.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future

import torch
from batchpilot_server.batching_config import DEFAULT_CLASS, MODES, BatchingConfig, Mode
from batchpilot_server.engine.block_pool import BlockPool
from batchpilot_server.engine.busy_clock import BusyClock
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.model_build import build_model
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.models import ModelSpec, resolve_device
from batchpilot_server.engine.request_stream import END_OF_STREAM, RequestStream, StreamItem
from batchpilot_server.engine.sampling import Sampler, gather_prompt_logprobs, make_generator
from batchpilot_server.engine.scheduler import Output, Scheduler
from batchpilot_server.engine.scheduler_policies import PolicyOptions, new_scheduler
from batchpilot_server.engine.sequence import Sequence, TopLogprobs
from batchpilot_server.engine.step_plan import PromptLogprobEntries, StepPlan
from batchpilot_server.engine.weights import LoadedModel
from batchpilot_server.engine_api import (
    EngineError,
    EngineObserver,
    EngineOptions,
    EngineStats,
    EngineStoppedError,
    NullObserver,
    PromptTooLongError,
    SamplingParams,
    TokenEvent,
)
from batchpilot_server.tokenizer import Tokenizer

log = logging.getLogger(__name__)

Delivery = list[tuple[RequestStream, StreamItem]]


class Engine:
    def __init__(self, options: EngineOptions, observer: EngineObserver | None = None) -> None:
        if options.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}; got {options.mode!r}")
        self._options = options
        self._observer: EngineObserver = observer or NullObserver()
        self._device = resolve_device(options.device)
        self._loaded: LoadedModel | None = None  # by `start`: loading may take minutes
        self._max_model_len = 0  # by `start`: the model's context, capped to the KV pool
        self._cond = threading.Condition()
        self._streams: dict[Sequence, RequestStream] = {}
        self._outbox: Delivery = []  # items for the event loop, in order
        self._outbox_lock = threading.Lock()
        self._wakeup_pending = False
        self._state = "new"  # new -> running -> stopping -> stopped
        self._abort: EngineError | None = None  # end every request with this, then stop
        self._failure: str | None = None
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cache: KVCache | None = None
        self._runner: ModelRunner | None = None
        self._sampler: Sampler | None = None
        self._scheduler: Scheduler | None = None

    # ---- properties -------------------------------------------------------

    @property
    def _spec(self) -> ModelSpec:
        return self._model.spec

    @property
    def _model(self) -> LoadedModel:
        if self._loaded is None:
            raise RuntimeError("the engine loads its model in start(); not started yet")
        return self._loaded

    @property
    def tokenizer(self) -> Tokenizer:
        return self._model.tokenizer

    @property
    def max_model_len(self) -> int:
        """Tokens one request may hold, prompt + output: the model's context (or
        --max-model-len), capped to what the KV pool holds for one sequence."""
        if not self._max_model_len:
            raise RuntimeError("the engine sizes its context in start(); not started yet")
        return self._max_model_len

    @property
    def model_name(self) -> str:
        """The name the model is served as."""
        return self._options.served_name

    @property
    def device(self) -> str:
        return self._device

    @property
    def mode(self) -> Mode:
        return self._options.mode

    @property
    def config(self) -> BatchingConfig:
        """The batching config in force: the scheduler's (before start, the one it
        will start with)."""
        return self._options.config if self._scheduler is None else self._scheduler.config

    @property
    def failure(self) -> str | None:
        """Why the engine thread died, if it did: it serves nothing more."""
        return self._stopped_message() if self._failure else None

    @property
    def attention(self) -> str | None:
        """The decode attention in use (native or torch); None before `start`."""
        return self._runner.attention if self._runner else None

    def stats(self) -> EngineStats:
        with self._cond:
            pool = self._cache.pool if self._cache else None
            scheduler = self._scheduler
            return EngineStats(
                running=scheduler.num_running if scheduler else 0,
                waiting=scheduler.num_waiting if scheduler else 0,
                kv_blocks_total=pool.num_blocks if pool else 0,
                kv_blocks_used=pool.num_used if pool else 0,
                steps=scheduler.steps if scheduler else 0,
                preemptions=scheduler.preemptions if scheduler else 0,
                waiting_by_class=scheduler.waiting_by_class() if scheduler else {},
            )

    # ---- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        if self._state != "new":
            raise RuntimeError("an Engine starts once")
        self._loop = asyncio.get_running_loop()
        if self._options.threads is not None:
            torch.set_num_threads(self._options.threads)
        # read here: torch's thread count may differ in the engine thread
        threads = torch.get_num_threads()
        built: Future[None] = Future()
        self._thread = threading.Thread(
            target=self._main, args=(threads, built), name="batchpilot-engine", daemon=True
        )
        self._thread.start()
        await asyncio.wrap_future(built)
        log.info(
            "engine ready: %s (%s) on %s, %d KV blocks, %s decode attention",
            self.model_name,
            self._model.dtype,
            self._device,
            self._cache.pool.num_blocks,
            self._runner.attention,
        )

    def _main(self, threads: int, built: Future[None]) -> None:
        """The engine thread: builds the model, then runs its steps; `built` says how the
        build went (`start` awaits it).

        One thread does both because torch's OpenMP runtime (libgomp) keeps a team of
        worker threads for every thread that ever ran a parallel op. With more of them
        than CPUs (a helper thread's idle team from loading beside the engine thread's),
        libgomp stops spinning at barriers and sleeps on a futex instead, and a step
        passes hundreds of barriers: SmolLM2-135M at batch 10 on 2 CPUs took 50 ms a
        step against 30 ms with the engine thread's team alone."""
        built.set_running_or_notify_cancel()  # from here `start` can no longer cancel it
        try:
            torch.set_num_threads(threads)  # torch's count is per thread
            built_model = build_model(self._options, self._device, threads)
            self._loaded, self._cache, self._runner = (
                built_model.loaded, built_model.cache, built_model.runner
            )
            self._max_model_len = built_model.max_model_len
            self._sampler = Sampler(self._spec.vocab_size, self.tokenizer.eos_ids, self._device)
            scheduler = self._new_scheduler(self._cache.pool)
        except Exception as exc:
            built.set_exception(exc)
            return
        with self._cond:
            starting = self._state == "new"  # not shut down while the model loaded
            if starting:
                self._scheduler, self._state = scheduler, "running"
        if not starting:
            built.set_exception(EngineStoppedError("engine shut down while starting"))
            return
        built.set_result(None)
        self._run(scheduler)

    def _new_scheduler(self, pool: BlockPool) -> Scheduler:
        """The batching policy `mode` names."""
        options = self._options
        policy = PolicyOptions(
            padded=options.dynamic_execution == "padded",
            max_wait_s=None if options.max_wait_ms is None else options.max_wait_ms / 1000.0,
            class_max_wait_s=options.class_max_wait_s,
            lower_class_prefill_tokens=options.lower_class_prefill_tokens,
        )
        return new_scheduler(options.mode, pool, options.config, self.tokenizer.eos_ids, policy)

    async def shutdown(self, drain: bool = False) -> None:
        """Stop; see the module docstring for what happens to admitted requests."""
        with self._cond:
            if self._state == "new":
                self._state = "stopped"
            if self._state == "running":
                assert self._scheduler is not None
                self._scheduler.stop(drain)
                self._state = "stopping"
                self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            await asyncio.to_thread(thread.join)

    def abort(self, reason: str) -> None:
        """End every admitted request now with EngineStoppedError(reason) and stop
        admitting. Their streams are answered at once; the scheduler frees their
        blocks once the step in progress ends, and `shutdown()` waits for that."""
        error = EngineStoppedError(reason)
        with self._cond:
            if self._state not in ("running", "stopping"):
                return
            self._abort, self._state = error, "stopping"
            out: Delivery = [(stream, error) for stream in self._streams.values()]
            self._streams.clear()
            self._cond.notify_all()
        self._send(out)

    # ---- requests ---------------------------------------------------------

    def reconfigure(self, config: BatchingConfig) -> None:
        """Takes effect at the next scheduling decision; no admitted request fails."""
        with self._cond:
            if self._scheduler is None:
                raise RuntimeError("the engine applies a config once started")
            self._scheduler.reconfigure(config)
            self._cond.notify_all()

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        deadline_s: float | None = None,
        slo_class: str = DEFAULT_CLASS,
        priority: int = 0,
    ) -> RequestStream:
        """A request the API validated (token ids, sampling values) in its SLO class at
        that class's priority (higher first); raises QueueFullError, PromptTooLongError
        or EngineStoppedError."""
        now = time.monotonic()
        seq = Sequence(
            request_id=f"req-{uuid.uuid4().hex[:16]}-{next(self._ids)}",
            prompt_ids=list(prompt_token_ids),
            params=params,
            arrival=now,
            deadline=None if deadline_s is None else now + deadline_s,
            generator=make_generator(params, self._device),
            slo_class=slo_class,
            priority=priority,
        )
        stream = RequestStream(seq.request_id, lambda: self._cancel(seq))
        with self._cond:
            if self._state != "running" or self._scheduler is None:
                raise EngineStoppedError(self._stopped_message())
            self._check_fits(seq)
            self._scheduler.add(seq)
            self._streams[seq] = stream
            self._cond.notify_all()
        return stream

    def _check_fits(self, seq: Sequence) -> None:
        """Guards the KV pool: a request longer than max_model_len could never be
        scheduled (the API refuses it first, with the field at fault)."""
        if seq.max_total_tokens > self._max_model_len:
            raise PromptTooLongError(
                f"prompt ({seq.num_prompt} tokens) + max_tokens ({seq.params.max_tokens}) = "
                f"{seq.max_total_tokens} exceeds the context of {self._max_model_len} tokens"
            )

    def _stopped_message(self) -> str:
        if self._failure:
            return f"engine stopped after an internal error: {self._failure}"
        return "engine is not running (not started or shutting down)"

    def _cancel(self, seq: Sequence) -> None:
        with self._cond:
            self._streams.pop(seq, None)
            if self._scheduler is not None:
                self._scheduler.cancel(seq)
            self._cond.notify_all()

    # ---- engine thread ----------------------------------------------------

    # for the thread's life: the runner's and the sampler's own entry into it
    # (engine/inference_mode.py) is then a check per step
    @torch.inference_mode()
    def _run(self, scheduler: Scheduler) -> None:
        """Each step: schedule, run the model, hand the results back."""
        busy = BusyClock()
        try:
            while (plan := self._next_plan(scheduler, busy)) is not None:
                tokens, logprobs, tops, prompt = self._run_model(plan)
                with self._cond:
                    outputs = scheduler.postprocess(
                        plan, tokens, logprobs, time.monotonic(), tops, prompt
                    )
                    delivery = self._delivery(outputs)
                self._send(delivery)
                if plan.verify:  # what `postprocess` accepted
                    drafted = [len(draft) for draft in plan.drafts]
                    self._observer.on_spec_decode(drafted, plan.accepted)
                self._observer.on_busy(busy.lap())
        except Exception as exc:
            log.exception("engine thread failed")
            self._failure = f"{type(exc).__name__}: {exc}"
        finally:
            self._stop(scheduler)

    def _next_plan(self, scheduler: Scheduler, busy: BusyClock) -> StepPlan | None:
        """The next step to run, once there is one; None: stop. Requests that end
        meanwhile (cancelled, past their deadline, refused) are answered at once."""
        with self._cond:
            while True:
                if self._abort is not None:
                    error, self._abort = self._abort, None
                    self._send(self._delivery(scheduler.abort(error)))
                plan = scheduler.schedule(time.monotonic())
                self._send(self._delivery(plan.ended))
                if plan.size:
                    return plan
                if self._state == "stopping" and scheduler.idle:
                    return None
                wake_at = scheduler.wake_at()
                with busy.waiting():
                    self._cond.wait(
                        None if wake_at is None else max(0.0, wake_at - time.monotonic())
                    )

    def _run_model(
        self, plan: StepPlan
    ) -> tuple[list[int], list[float], list[TopLogprobs], list[PromptLogprobEntries]]:
        """Outside the lock: the plan's forwards; for the rows that sample
        (`plan.sampling()`) the tokens, their log-probabilities and the top
        log-probabilities they asked for; the prompt log-probabilities prefill gathered.
        Writes no sequence: `postprocess` records the step."""
        assert self._runner is not None and self._sampler is not None
        observer, runner, sampler = self._observer, self._runner, self._sampler
        for _ in plan.preempted:
            observer.on_preemption()
        for seq in plan.first_scheduled:
            observer.on_scheduled((seq.first_scheduled or seq.arrival) - seq.arrival)
        if plan.batch_size:
            observer.on_batch(plan.batch_size)
        slots = plan.slot_steps()
        observer.on_slot_steps(slots.active, slots.finished, slots.padding)
        work = plan.work()
        observer.on_step_work(work.decode_rows, work.prefill_tokens, work.kv_tokens)
        if plan.cache_queried:
            observer.on_prefix_cache(plan.cache_queried, plan.cache_hit)
        prompt: list[PromptLogprobEntries] = []

        def keep_prompt_logprobs(seq: Sequence, start: int, logits: torch.Tensor) -> None:
            prompt.append((seq, start, gather_prompt_logprobs(seq, start, logits)))

        rows = plan.sampler_rows()  # their logits come first, in this order
        began = time.perf_counter()
        # padded execution: finished rows decode last, their outputs discarded
        logits = runner.step(plan, keep_prompt_logprobs)
        sampled = sampler.sample(logits[: len(rows)], rows) if rows else None
        # the step count and seconds a step-time model pairs with the work counters
        observer.on_step(plan.size + len(plan.pad), time.perf_counter() - began)
        if sampled is None:
            return [], [], [], prompt
        return sampled.tokens, sampled.logprobs, sampled.top_logprobs, prompt

    def _delivery(self, outputs: list[Output]) -> Delivery:
        """Under the lock: each output paired with its request's stream (none once the
        client cancelled); a final output closes the stream."""
        out: Delivery = []
        for output in outputs:
            if output.held_s is not None:
                self._observer.on_hostage(output.held_s)
            if not output.final:
                stream = self._streams.get(output.seq)
                if stream is not None:
                    out.append((stream, output.item))
            elif (stream := self._streams.pop(output.seq, None)) is not None:
                out.append((stream, output.item))
                if isinstance(output.item, TokenEvent):
                    out.append((stream, END_OF_STREAM))
        return out

    def _send(self, out: Delivery) -> None:
        """Queue items for the event loop; wake it only if no wake-up is pending.

        Each wake-up is a socket write plus a GIL hand-over to the loop thread, so
        steps that finish while the loop is still busy ride on one wake-up."""
        if not out:
            return
        assert self._loop is not None
        with self._outbox_lock:
            self._outbox += out
            if self._wakeup_pending:
                return
            self._wakeup_pending = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            log.warning("event loop closed; %d stream items dropped", len(out))

    def _deliver(self) -> None:
        """On the event loop: hand every queued item to its stream."""
        with self._outbox_lock:
            items, self._outbox, self._wakeup_pending = self._outbox, [], False
        for stream, item in items:
            stream._push(item)

    def _stop(self, scheduler: Scheduler) -> None:
        """Thread exit: every stream still open ends with an error (after a failure,
        the scheduler's state is not to be trusted to find them)."""
        with self._cond:
            self._state = "stopped"
            error = EngineStoppedError(self._stopped_message())
            out: Delivery = [(stream, error) for stream in self._streams.values()]
            self._streams.clear()
        self._send(out)
        with self._cond:
            scheduler.abort(error)  # frees what a failed step left behind
