"""The admin API's wire format: what a PUT /admin/batching may carry (admin.py reads it;
openapi.py publishes it beside the OpenAI routes' models of protocol.py)."""

from __future__ import annotations

from typing import Annotated, Required

from batchpilot_server.batching_config import (
    CLASS_NAME_PATTERN,
    MAX_BATCH_SIZE_LIMIT,
    MAX_BATCH_TIMEOUT_MS,
    MAX_CLASS_PRIORITY,
    MAX_PREFILL_TOKEN_BUDGET,
    MAX_QUEUE_SIZE_LIMIT,
    MAX_SLO_CLASSES,
    MAX_SLO_TARGET_MS,
    MAX_SPECULATIVE_TOKENS,
)
from pydantic import ConfigDict, Field
from typing_extensions import TypedDict

# a target in milliseconds; null: not stated
SloTargetMs = Annotated[float | None, Field(gt=0.0, le=MAX_SLO_TARGET_MS)]


class SloClassUpdate(TypedDict, total=False):
    """A named class of requests with targets of its own (at least one) and a priority
    (higher is served first, an InferenceObjective's meaning)."""

    __pydantic_config__ = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # type: ignore[misc]
    name: Required[Annotated[str, Field(pattern=f"^{CLASS_NAME_PATTERN.pattern}$", max_length=63)]]
    priority: Annotated[int, Field(ge=-MAX_CLASS_PRIORITY, le=MAX_CLASS_PRIORITY)]
    ttft_ms: SloTargetMs
    tpot_ms: SloTargetMs
    e2e_ms: SloTargetMs


class SloUpdate(TypedDict, total=False):
    """The SLO targets a PUT sets, all together: a target left out (or null) is not
    stated; `{}` states none, and nothing is judged. The top-level targets are the class
    `default`'s (a request naming no class); `classes` are the named ones beside it."""

    __pydantic_config__ = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)  # type: ignore[misc]
    ttft_ms: SloTargetMs
    tpot_ms: SloTargetMs
    e2e_ms: SloTargetMs
    classes: Annotated[list[SloClassUpdate], Field(max_length=MAX_SLO_CLASSES)]


class BatchingUpdate(TypedDict, total=False):
    """A PUT /admin/batching body: the fields to change."""

    __pydantic_config__ = ConfigDict(  # type: ignore[misc]
        extra="forbid", strict=True, allow_inf_nan=False, json_schema_extra={"minProperties": 1}
    )
    max_batch_size: Annotated[int, Field(ge=1, le=MAX_BATCH_SIZE_LIMIT)]
    batch_timeout_ms: Annotated[float, Field(ge=0.0, le=MAX_BATCH_TIMEOUT_MS)]
    max_queue_size: Annotated[int, Field(ge=1, le=MAX_QUEUE_SIZE_LIMIT)]
    prefill_token_budget: Annotated[int, Field(ge=1, le=MAX_PREFILL_TOKEN_BUDGET)]
    num_speculative_tokens: Annotated[int, Field(ge=0, le=MAX_SPECULATIVE_TOKENS)]
    slo: SloUpdate
