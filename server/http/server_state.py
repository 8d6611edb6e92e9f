"""What the app's parts share: the engine it serves, its metrics and limits,
readiness and draining, and the requests in flight."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web
from batchpilot_server.batching_config import DEFAULT_CLASS, BatchingConfig
from batchpilot_server.engine_api import EngineStats, SamplingParams, TokenEvent
from batchpilot_server.http.generation_defaults import MODEL_NEUTRAL, GenerationDefaults
from batchpilot_server.http.grammar_compiler import GrammarCompiler
from batchpilot_server.http.metrics import ServerMetrics
from batchpilot_server.http.protocol import Limits
from batchpilot_server.http.protocol_parse import Served
from batchpilot_server.tokenizer import Tokenizer


class RequestStream(Protocol):
    def __aiter__(self) -> RequestStream: ...
    async def __anext__(self) -> TokenEvent: ...
    def cancel(self) -> None: ...


class EngineLike(Protocol):
    """The part of `batchpilot_server.engine.core.Engine` the app uses."""

    @property
    def config(self) -> BatchingConfig:
        """The batching config in force: the app keeps no copy."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def failure(self) -> str | None: ...

    async def start(self) -> None: ...
    async def shutdown(self) -> None: ...
    def abort(self, reason: str) -> None: ...
    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        deadline_s: float | None,
        slo_class: str = DEFAULT_CLASS,
        priority: int = 0,
    ) -> RequestStream: ...
    def reconfigure(self, config: BatchingConfig) -> None: ...
    def stats(self) -> EngineStats: ...


@dataclass(frozen=True)
class ClassKey:
    """An API key bound to an SLO class: its requests are judged (and served) in that
    class whatever header or priority they send, so that a tenant cannot promote itself."""

    slo_class: str
    key: Callable[[], str]  # the key in force (TokenFile.current)


class InFlight:
    """Counts completion requests in progress, so that shutdown can wait for them."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True when every request finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True


@dataclass
class ServerState:
    engine: EngineLike
    metrics: ServerMetrics
    limits: Limits
    admin_token: Callable[[], str] | None  # the token in force now (TokenFile.current)
    api_key: Callable[[], str] | None = None  # the OpenAI routes' bearer key; None: open
    # keys bound to an SLO class (--api-key-class); any of them also opens the routes
    class_keys: tuple[ClassKey, ...] = ()
    chat_template: str | None = None  # --chat-template: replaces the model's at start
    defaults: GenerationDefaults = MODEL_NEUTRAL
    # response_format and forced tool calls: compiled once the engine has its tokenizer
    structured: GrammarCompiler | None = None
    config_version: int = 1  # of the engine's config: increases with every accepted PUT
    ready: bool = False
    draining: bool = False
    inflight: InFlight = field(default_factory=InFlight)

    @property
    def model_name(self) -> str:
        return self.metrics.model

    def served(self) -> Served:
        """The bounds a request is read against, from the engine as it is now."""
        engine = self.engine
        return Served(
            self.model_name, engine.max_model_len, engine.tokenizer, self.limits, self.defaults
        )


STATE = web.AppKey("batchpilot_state", ServerState)
