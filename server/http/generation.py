"""One admitted generation request: its engine sequences, their deltas, its metrics."""

from __future__ import annotations

import asyncio
import time
import uuid

from batchpilot_server.engine_api import (
    DeadlineExceededError,
    EngineStoppedError,
    PromptTooLongError,
    QueueFullError,
    SamplingParams,
    TokenEvent,
)
from batchpilot_server.http.answers import Usage
from batchpilot_server.http.protocol import ApiError, invalid
from batchpilot_server.http.protocol_output import ChoiceDelta, ChoiceOutput, TokenSpeller
from batchpilot_server.http.protocol_parse import GenerationRequest
from batchpilot_server.http.server_state import RequestStream, ServerState
from batchpilot_server.http.slo_class import RequestClass
from batchpilot_server.http.slo_judge import RequestTiming
from batchpilot_server.http.tool_calls import ToolCallStream


class Generation:
    """One admitted request: its engine sequences (one per choice), their text deltas
    merged in the order they come, and the request's metrics."""

    def __init__(
        self,
        state: ServerState,
        parsed: GenerationRequest,
        timing: RequestTiming,
        id_prefix: str,
        slo_class: RequestClass,
    ) -> None:
        self.state = state
        self.parsed = parsed
        self.slo_class = slo_class
        self.timing = timing
        self.arrival = timing.arrival_s
        self.id = f"{id_prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = state.model_name
        tokenizer = state.engine.tokenizer
        self.speller = TokenSpeller(tokenizer)
        self.outputs: list[ChoiceOutput] = []
        self._streams: list[RequestStream] = []
        self._prompt_tokens: list[int] = []  # per choice
        self._last_token_at: dict[int, float] = {}
        self._first_token = True
        # the next event of each unfinished choice, awaited together
        self._pending: dict[asyncio.Task[TokenEvent], int] = {}
        # streamed with tools: each choice's text held back where it may be a call
        self._tool_streams: list[ToolCallStream] = []
        try:
            for index, prompt, params in parsed.sequences():
                self.outputs.append(
                    ChoiceOutput(
                        index,
                        tokenizer,
                        self.speller,
                        parsed.stop,
                        echo_text=prompt.text if parsed.echo else None,
                        prompt_ids=prompt.ids,
                        logprobs=parsed.logprobs is not None,
                        output=parsed.output,
                    )
                )
                if parsed.tool_names and parsed.stream:
                    self._tool_streams.append(ToolCallStream(parsed.tool_names))
                self._streams.append(self._submit(prompt.ids, params))
                self._prompt_tokens.append(len(prompt.ids))
                state.metrics.prompt_tokens.inc(len(prompt.ids))
        except ApiError:
            self.close()  # the choices admitted before a refused one end with it
            raise

    def _submit(self, prompt_ids: list[int], params: SamplingParams) -> RequestStream:
        limits = self.state.limits
        try:
            return self.state.engine.submit(
                prompt_ids,
                params,
                deadline_s=limits.queue_timeout_s,
                slo_class=self.slo_class.name,
                priority=self.slo_class.priority,
            )
        except QueueFullError as exc:
            raise ApiError(
                429,
                f"the waiting queue is full ({self.state.engine.config.max_queue_size} requests); "
                f"retry after {limits.retry_after_s} s",
                type_="rate_limit_error",
                code="queue_full",
                headers={"Retry-After": str(limits.retry_after_s)},
            ) from exc
        except PromptTooLongError as exc:  # protocol_parse refuses it first; the engine guards
            raise invalid(str(exc), code="context_length_exceeded", param="prompt") from exc
        except EngineStoppedError as exc:
            raise _engine_stopped(self.state, exc, "rejected") from exc

    @property
    def finished(self) -> bool:
        return all(output.finish_reason is not None for output in self.outputs)

    def usage(self) -> Usage:
        prompt = self.parsed.prompt_tokens
        completion = sum(output.completion_tokens for output in self.outputs)
        return Usage(
            prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion
        )

    async def next_delta(self) -> ChoiceDelta | None:
        """The next delta of any choice, in the order their tokens come; None once all
        finished."""
        if len(self.outputs) == 1:  # no tasks for the common case
            output = self.outputs[0]
            if output.finish_reason is not None:
                return None
            return self._record(0, await self._next_event(0))
        for index, output in enumerate(self.outputs):
            if output.finish_reason is None and index not in self._pending.values():
                self._pending[asyncio.ensure_future(self._next_event(index))] = index
        if not self._pending:
            return None
        done, _ = await asyncio.wait(self._pending, return_when=asyncio.FIRST_COMPLETED)
        task = min(done, key=lambda t: self._pending[t])  # one at a time, lowest index first
        index = self._pending.pop(task)
        return self._record(index, task.result())

    async def _next_event(self, index: int) -> TokenEvent:
        try:
            return await anext(self._streams[index])
        except StopAsyncIteration:
            raise ApiError(
                500, "the engine ended the request without a finish reason", type_="server_error"
            ) from None
        except DeadlineExceededError as exc:
            raise ApiError(
                504,
                f"the request waited longer than its deadline of "
                f"{self.state.limits.queue_timeout_s:g} s without being scheduled; the server "
                "is overloaded, retry later or on another replica",
                type_="timeout_error",
                code="queue_timeout",
                headers={"Retry-After": str(self.state.limits.retry_after_s)},
            ) from exc
        except EngineStoppedError as exc:
            raise _engine_stopped(self.state, exc, "error") from exc

    def _record(self, index: int, event: TokenEvent) -> ChoiceDelta:
        now = time.monotonic()
        metrics = self.state.metrics
        if self._first_token:
            metrics.ttft.observe(now - self.arrival, self.slo_class.name)
            self._first_token = False
        elif index in self._last_token_at:
            metrics.inter_token.observe(now - self._last_token_at[index], self.slo_class.name)
        self._last_token_at[index] = now
        self.timing.token(index, now)
        metrics.generation_tokens.inc()
        output = self.outputs[index]
        delta = output.feed(event)
        if self._tool_streams:
            tools = self._tool_streams[index]
            delta.text = tools.feed(delta.text)
            if delta.finish_reason is not None:
                rest, delta.tool_calls = tools.finish()
                delta.text += rest
                if delta.tool_calls:
                    delta.finish_reason = "tool_calls"
        if output.finish_reason is not None:
            self._streams[index].cancel()  # a stop string ends it before the engine does
            name = self.slo_class.name
            metrics.request_generation_tokens.observe(output.completion_tokens, name)
            metrics.request_prompt_tokens.observe(self._prompt_tokens[index], name)
        return delta

    def close(self) -> None:
        # Frees the request's KV blocks when it ends early (stop string, error,
        # client gone); a no-op for a finished request.
        for task in self._pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the request already ends with the first error
            task.cancel()
        for stream in self._streams:
            stream.cancel()


def _engine_stopped(state: ServerState, error: EngineStoppedError, outcome: str) -> ApiError:
    """503: the engine failed (the reason), or is shutting down (why this request ends)."""
    failure = state.engine.failure
    return ApiError(
        503,
        f"{failure or error}; retry on another replica",
        type_="service_unavailable_error",
        code="engine_failed" if failure else "shutting_down",
        headers={"Retry-After": str(state.limits.retry_after_s)},
        outcome=outcome,
    )
