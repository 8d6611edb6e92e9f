"""The engine: an asyncio front over a model loop that runs in its own thread.

`submit` (event loop) appends to the waiting queue under a lock and returns a
`RequestStream`; the engine thread asks the scheduler for a step, runs the
model outside the lock, and hands the step's events to the loop in one
`call_soon_threadsafe`, so HTTP keeps answering while the model computes.

Shutdown: `shutdown()` stops admitting new requests; requests already
scheduled (running, or preempted and waiting to be recomputed) run to the end;
requests never scheduled end with `EngineStoppedError` at once.
`shutdown(drain=True)` instead serves every admitted request before stopping.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from batchpilot_server.batching import BatchingConfig, Mode
from batchpilot_server.engine_api import (
    DeadlineExceededError,
    EngineError,
    EngineObserver,
    EngineOptions,
    EngineStats,
    EngineStoppedError,
    InvalidRequestError,
    NullObserver,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
    TokenEvent,
)
from batchpilot_server.kv_cache import KVCache
from batchpilot_server.model_runner import ModelRunner
from batchpilot_server.models import ModelSpec, resolve_device
from batchpilot_server.sampling import make_generator, sample
from batchpilot_server.scheduler_continuous import ContinuousScheduler
from batchpilot_server.scheduler_dynamic import DynamicScheduler
from batchpilot_server.scheduling import Scheduler, StepPlan
from batchpilot_server.sequence import Sequence, Status
from batchpilot_server.tokenizer import Tokenizer
from batchpilot_server.weights import LoadedModel, load_model

log = logging.getLogger(__name__)

_END = object()  # a stream's end marker
StreamItem = TokenEvent | EngineError | object
Delivery = list[tuple["RequestStream", StreamItem]]


class RequestStream:
    """Async iterator of one request's `TokenEvent`s; raises the `EngineError` it ends with.

    A deque and one waiter future rather than an asyncio.Queue: the event loop
    hands out every token of every step, and its time there is time the engine
    thread may wait for the GIL."""

    def __init__(self, request_id: str, on_cancel: Callable[[], None]) -> None:
        self.request_id = request_id
        self._on_cancel = on_cancel
        self._items: deque[StreamItem] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False  # no more items will be yielded

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        if self._closed:
            raise StopAsyncIteration
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if item is _END or self._closed:
            self._closed = True
            raise StopAsyncIteration
        if isinstance(item, EngineError):
            self._closed = True
            raise item
        assert isinstance(item, TokenEvent)
        return item

    def cancel(self) -> None:
        """Stop the request and free its KV blocks; iteration ends. Safe at any time."""
        if self._closed:
            return
        self._closed = True
        self._put(_END)  # wakes a reader blocked in __anext__
        self._on_cancel()

    def _push(self, item: StreamItem) -> None:
        if not self._closed:
            self._put(item)

    def _put(self, item: StreamItem) -> None:
        self._items.append(item)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


class Engine:
    def __init__(self, options: EngineOptions, observer: EngineObserver | None = None) -> None:
        if options.mode not in ("dynamic", "continuous"):
            raise ValueError(f"mode must be dynamic or continuous, got {options.mode!r}")
        self._options = options
        self._observer: EngineObserver = observer or NullObserver()
        self._device = resolve_device(options.device)
        self._loaded: LoadedModel | None = None  # by `start`: loading may take minutes
        self._config = options.config
        self._cond = threading.Condition()
        self._waiting: deque[Sequence] = deque()
        self._streams: dict[Sequence, RequestStream] = {}
        self._final_events: dict[Sequence, TokenEvent] = {}  # dynamic: held until batch end
        self._cancelled: list[Sequence] = []
        self._outbox: Delivery = []  # items for the event loop, in order
        self._outbox_lock = threading.Lock()
        self._wakeup_pending = False
        self._state = "new"  # new -> running -> stopping -> stopped
        self._drain = False
        self._failure: str | None = None
        self._steps = 0
        self._preemptions = 0
        self._ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cache: KVCache | None = None
        self._runner: ModelRunner | None = None
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
        return self._spec.max_seq_len

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
        return self._config

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
            return EngineStats(
                running=self._scheduler.num_running if self._scheduler else 0,
                waiting=len(self._waiting),
                kv_blocks_total=pool.num_blocks if pool else 0,
                kv_blocks_used=pool.num_used if pool else 0,
                steps=self._steps,
                preemptions=self._preemptions,
            )

    # ---- lifecycle --------------------------------------------------------

    async def start(self) -> None:
        if self._state != "new":
            raise RuntimeError("an Engine starts once")
        self._loop = asyncio.get_running_loop()
        if self._options.threads is not None:
            torch.set_num_threads(self._options.threads)
        # read here: torch's thread count may differ in the helper thread that builds
        threads = torch.get_num_threads()
        self._cache, self._runner = await asyncio.to_thread(self._build, threads)
        log.info(
            "engine ready: %s (%s) on %s, %d KV blocks, %s decode attention",
            self.model_name,
            self._model.dtype,
            self._device,
            self._cache.pool.num_blocks,
            self._runner.attention,
        )
        pool, waiting = self._cache.pool, self._waiting
        self._scheduler = (
            DynamicScheduler(pool, waiting)
            if self.mode == "dynamic"
            else ContinuousScheduler(pool, waiting, self._options.prefill_token_budget)
        )
        self._state = "running"
        self._thread = threading.Thread(target=self._run, name="batchpilot-engine", daemon=True)
        self._thread.start()

    def _build(self, threads: int) -> tuple[KVCache, ModelRunner]:
        options = self._options
        self._loaded = load_model(
            options.model,
            device=self._device,
            dtype=options.dtype,
            seed=options.seed,
            max_model_len=options.max_model_len,
        )
        model = self._loaded.model
        budget = options.kv_cache_mb * 2**20
        if self._device == "cuda" and options.gpu_memory_fraction is not None:
            free, _ = torch.cuda.mem_get_info()
            budget = free * options.gpu_memory_fraction
        # float32 on the CPU whatever the weights (the native kernel reads float32)
        dtype = model.lm_head.weight.dtype if self._device == "cuda" else torch.float32
        cache = KVCache.sized(self._spec, budget, options.block_size, self._device, dtype)
        return cache, ModelRunner(model, cache, options.attention, threads)

    async def shutdown(self, drain: bool = False) -> None:
        """Stop; see the module docstring for what happens to admitted requests."""
        with self._cond:
            if self._state == "new":
                self._state = "stopped"
            if self._state != "running":
                thread = self._thread
            else:
                self._state, self._drain, thread = "stopping", drain, self._thread
                self._cond.notify_all()
        if thread is not None:
            await asyncio.to_thread(thread.join)

    # ---- requests ---------------------------------------------------------

    def reconfigure(self, config: BatchingConfig) -> None:
        """Takes effect at the next scheduling decision; no admitted request fails."""
        with self._cond:
            self._config = config
            self._cond.notify_all()

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        deadline_s: float | None = None,
    ) -> RequestStream:
        self._check_request(prompt_token_ids, params, deadline_s)
        now = time.monotonic()
        seq = Sequence(
            request_id=f"req-{uuid.uuid4().hex[:16]}-{next(self._ids)}",
            prompt_ids=list(prompt_token_ids),
            params=params,
            arrival=now,
            deadline=None if deadline_s is None else now + deadline_s,
            generator=make_generator(params, self._device),
        )
        stream = RequestStream(seq.request_id, lambda: self._cancel(seq))
        with self._cond:
            if self._state != "running":
                raise EngineStoppedError(self._stopped_message())
            limit = self._config.max_queue_size
            if len(self._waiting) >= limit:
                raise QueueFullError(
                    f"waiting queue is full ({len(self._waiting)} requests, "
                    f"max_queue_size {limit}); retry later"
                )
            self._waiting.append(seq)
            self._streams[seq] = stream
            self._cond.notify_all()
        return stream

    def _stopped_message(self) -> str:
        if self._failure:
            return f"engine stopped after an internal error: {self._failure}"
        return "engine is not running (not started or shutting down)"

    def _check_request(
        self, prompt: list[int], params: SamplingParams, deadline_s: float | None
    ) -> None:
        if self._loaded is None:
            raise EngineStoppedError(self._stopped_message())
        vocab = self._spec.vocab_size
        if not prompt:
            raise InvalidRequestError("prompt must hold at least one token")
        bad = next((t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad!r} is outside the vocabulary 0..{vocab - 1}")
        if params.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {params.max_tokens}")
        if params.temperature < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {params.temperature}")
        if not 0 < params.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {params.top_p}")
        if deadline_s is not None and deadline_s <= 0:
            raise InvalidRequestError(f"deadline_s must be positive, got {deadline_s}")
        total = len(prompt) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds the model context of {self.max_model_len} tokens"
            )
        if self._cache is not None and self._cache.pool.blocks_for(total) > (
            blocks := self._cache.pool.num_blocks
        ):
            raise PromptTooLongError(
                f"prompt + max_tokens = {total} tokens needs more KV blocks than the whole "
                f"pool holds ({blocks} blocks of {self._cache.block_size} tokens)"
            )

    def _cancel(self, seq: Sequence) -> None:
        with self._cond:
            self._streams.pop(seq, None)
            self._cancelled.append(seq)
            self._cond.notify_all()

    # ---- engine thread ----------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    plan, wake_at = self._decide()
                    if plan is None:
                        if wake_at is None and self._state == "stopping" and self._idle():
                            break
                        timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic())
                        self._cond.wait(timeout)
                        continue
                self._execute(plan)
        except Exception as exc:
            log.exception("engine thread failed")
            self._failure = f"{type(exc).__name__}: {exc}"
        finally:
            self._stop()

    def _idle(self) -> bool:
        assert self._scheduler is not None
        return self._scheduler.num_running == 0 and not self._waiting

    def _decide(self) -> tuple[StepPlan | None, float | None]:
        """Under the lock: apply cancellations and deadlines, then ask the scheduler."""
        assert self._scheduler is not None
        now = time.monotonic()
        out: Delivery = []
        self._apply_cancellations(out)
        self._expire_deadlines(now, out)
        stopping = self._state == "stopping"
        if stopping and not self._drain:
            self._refuse_unscheduled(out)
        self._send(out)
        plan = self._scheduler.schedule(now, self._config, flush=stopping)
        if plan is not None:
            return plan, None
        deadlines = [s.deadline for s in self._waiting if s.deadline and s.first_scheduled is None]
        wakes = [t for t in (self._scheduler.wake_at(self._config), *deadlines) if t is not None]
        return None, min(wakes) if wakes else None

    def _apply_cancellations(self, out: Delivery) -> None:
        assert self._scheduler is not None
        cancelled, self._cancelled = self._cancelled, []
        for seq in cancelled:
            if seq.status is Status.FINISHED:
                continue
            if seq in self._waiting:
                self._waiting.remove(seq)
                seq.status = Status.FINISHED
            elif seq.status is Status.RUNNING:
                self._final_events.pop(seq, None)  # a dynamic batch may hold its last event
                self._release(self._scheduler.cancel(seq), time.monotonic(), out)
                seq.status = Status.FINISHED

    def _expire_deadlines(self, now: float, out: Delivery) -> None:
        expired = [
            s
            for s in self._waiting
            if s.first_scheduled is None and s.deadline is not None and now >= s.deadline
        ]
        for seq in expired:
            self._waiting.remove(seq)
            waited, allowed = now - seq.arrival, (seq.deadline or now) - seq.arrival
            message = (
                f"request waited {waited:.3f}s in the queue without being scheduled "
                f"(deadline {allowed:.3f}s)"
            )
            self._end(seq, DeadlineExceededError(message), out)

    def _refuse_unscheduled(self, out: Delivery) -> None:
        for seq in [s for s in self._waiting if s.first_scheduled is None]:
            self._waiting.remove(seq)
            self._end(seq, EngineStoppedError("engine is shutting down; request not started"), out)

    def _end(self, seq: Sequence, error: EngineError, out: Delivery) -> None:
        seq.status = Status.FINISHED
        stream = self._streams.pop(seq, None)
        if stream is not None:
            out.append((stream, error))

    def _execute(self, plan: StepPlan) -> None:
        """Outside the lock: run the plan's forwards and hand out their tokens."""
        assert self._runner is not None and self._scheduler is not None
        observer = self._observer
        start = time.monotonic()
        for _ in plan.preempted:
            self._preemptions += 1
            observer.on_preemption()
        for seq in plan.prefill:
            if seq.first_scheduled is None:
                seq.first_scheduled = start
                observer.on_scheduled(start - seq.arrival)
        if plan.fired:
            observer.on_batch(plan.fired)
        elif self.mode == "continuous":
            observer.on_batch(plan.size)
        self._steps += 1
        events: list[tuple[Sequence, TokenEvent]] = []
        runner = self._runner
        prefill = partial(runner.prefill, chunks=plan.chunks)
        for seqs, forward in ((plan.prefill, prefill), (plan.decode, runner.decode)):
            if seqs:
                began = time.perf_counter()
                logits = forward(seqs)
                # a prefill chunk that leaves part of its prompt for later samples nothing
                ready = [seq for seq in seqs if seq.ready_to_sample]
                if ready:
                    tokens, logprobs = sample(logits, ready)
                    events += self._append(ready, tokens, logprobs)
                observer.on_step(len(seqs), time.perf_counter() - began)
        self._publish(events)

    def _append(
        self, seqs: list[Sequence], tokens: list[int], logprobs: list[float]
    ) -> list[tuple[Sequence, TokenEvent]]:
        events = []
        eos, step = self.tokenizer.eos_ids, self._steps
        for seq, token, logprob in zip(seqs, tokens, logprobs, strict=True):
            seq.token_ids.append(token)
            reason = seq.finish_reason_after(token, eos)
            seq.finish_reason = reason
            events.append((seq, TokenEvent(token, seq.num_output - 1, reason, logprob, step)))
        return events

    def _publish(self, events: list[tuple[Sequence, TokenEvent]]) -> None:
        assert self._scheduler is not None
        out: Delivery = []
        now = time.monotonic()
        finished = [seq for seq, event in events if event.finish_reason is not None]
        with self._cond:
            for seq, event in events:
                stream = self._streams.get(seq)
                if event.finish_reason is not None:
                    seq.finished_at = now
                    self._final_events[seq] = event  # completes when the scheduler says so
                elif stream is not None:
                    out.append((stream, event))
            self._release(self._scheduler.finish(finished), now, out)
        self._send(out)

    def _release(self, done: list[Sequence], now: float, out: Delivery) -> None:
        """Complete the responses of sequences the scheduler let go."""
        for seq in done:
            seq.status = Status.FINISHED
            event = self._final_events.pop(seq, None)
            stream = self._streams.pop(seq, None)
            if event is None:
                continue
            if self.mode == "dynamic" and seq.finished_at is not None:
                self._observer.on_hostage(now - seq.finished_at)
            if stream is not None:
                out += [(stream, replace(event, step=self._steps)), (stream, _END)]

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

    def _stop(self) -> None:
        """Thread exit: every stream still open ends with an error."""
        if self._runner is not None:
            self._runner.close()
        with self._cond:
            self._state = "stopped"
            error = EngineStoppedError(self._stopped_message())
            out: Delivery = [(stream, error) for stream in self._streams.values()]
            self._streams.clear()
            self._waiting.clear()
        self._send(out)
