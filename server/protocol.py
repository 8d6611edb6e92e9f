"""Parsing and validation of the OpenAI-compatible wire format.

Every mistake of the caller becomes an `ApiError` with a 4xx status and
OpenAI's error shape `{"error": {"message", "type", "code"}}`, never a 500.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Protocol

# OpenAI's default when a request names no `max_tokens`.
DEFAULT_MAX_TOKENS = 16
MAX_STOP_SEQUENCES = 4
MAX_STOP_LENGTH = 256

# Fields a /v1/completions body may carry. Others are refused so that a typo
# (`max_token`) fails loudly instead of being silently ignored.
ALLOWED_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "ignore_eos",
        "n",
        "user",
    }
)


class IncrementalDecoder(Protocol):
    def decode(self, ids: list[int], final: bool = False) -> str: ...


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...
    def incremental_decoder(self) -> IncrementalDecoder: ...


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; the CLI and tests choose them."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = None  # None: bounded by the model's context only
    max_tokens: int | None = None  # None: bounded by the model's context only
    queue_timeout_s: float = 30.0  # how long a request may wait unscheduled
    retry_after_s: int = 1  # what a 429 / 503 tells the caller to wait


class ApiError(Exception):
    """An error answer in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type_: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        outcome: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.code = code
        self.param = param
        self.headers = headers or {}
        # The requests_total outcome this error counts as (see metrics.py).
        self.outcome = outcome or _default_outcome(status)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "code": self.code,
                "param": self.param,
            }
        }


def _default_outcome(status: int) -> str:
    if status == 504:
        return "timeout"
    return "error" if status >= 500 else "rejected"


def invalid(message: str, *, code: str = "invalid_value", param: str | None = None) -> ApiError:
    return ApiError(400, message, code=code, param=param)


@dataclass(frozen=True)
class CompletionRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage_chunk: bool = False
    ignore_eos: bool = False


def parse_json_body(raw: bytes) -> Any:
    if not raw.strip():
        raise invalid("request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from exc


def parse_completion(
    body: Any,
    *,
    tokenizer: Tokenizer,
    model_name: str,
    max_model_len: int,
    limits: Limits,
) -> CompletionRequest:
    if not isinstance(body, dict):
        raise invalid("request body must be a JSON object", code="invalid_type")
    unknown = sorted(set(body) - ALLOWED_FIELDS)
    if unknown:
        raise invalid(
            f"unknown field(s): {', '.join(unknown)}; allowed: {', '.join(sorted(ALLOWED_FIELDS))}",
            code="unknown_field",
            param=unknown[0],
        )
    _check_model(body.get("model"), model_name)
    if body.get("n", 1) != 1:
        raise invalid("only n=1 is supported", code="unsupported", param="n")
    prompt_ids = _prompt_ids(body, tokenizer)
    max_tokens = _max_tokens(body.get("max_tokens"), len(prompt_ids), max_model_len, limits)
    if limits.max_prompt_tokens is not None and len(prompt_ids) > limits.max_prompt_tokens:
        raise invalid(
            f"prompt has {len(prompt_ids)} tokens; this server accepts at most "
            f"{limits.max_prompt_tokens}",
            code="context_length_exceeded",
            param="prompt",
        )
    stream = _bool(body, "stream", False)
    return CompletionRequest(
        prompt_ids=prompt_ids,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, low=0.0, high=2.0),
        top_p=_top_p(body),
        seed=_seed(body.get("seed")),
        stop=_stop(body.get("stop")),
        stream=stream,
        include_usage_chunk=_include_usage(body.get("stream_options"), stream),
        ignore_eos=_bool(body, "ignore_eos", False),
    )


def _check_model(model: Any, model_name: str) -> None:
    if model is None:
        return
    if not isinstance(model, str):
        raise invalid("model must be a string", code="invalid_type", param="model")
    if model != model_name:
        raise ApiError(
            404,
            f"model {model!r} does not exist; this server serves {model_name!r}",
            type_="not_found_error",
            code="model_not_found",
            param="model",
        )


def _prompt_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    if "prompt" not in body:
        raise invalid("prompt is required", code="missing_field", param="prompt")
    prompt = body["prompt"]
    if isinstance(prompt, str):
        if not prompt:
            raise invalid("prompt must not be empty", param="prompt")
        return list(tokenizer.encode(prompt))
    if isinstance(prompt, list):
        if not prompt:
            raise invalid("prompt must not be empty", param="prompt")
        if all(_is_int(t) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < tokenizer.vocab_size]
            if bad:
                raise invalid(
                    f"prompt holds unknown token id(s) {bad[:5]}; valid ids are "
                    f"0..{tokenizer.vocab_size - 1}",
                    code="invalid_token_id",
                    param="prompt",
                )
            return list(prompt)
        if all(isinstance(p, str | list) for p in prompt):
            raise invalid(
                "batched prompts are not supported; send one prompt per request",
                code="unsupported",
                param="prompt",
            )
    raise invalid(
        "prompt must be a string or a list of integer token ids",
        code="invalid_type",
        param="prompt",
    )


def _max_tokens(value: Any, prompt_len: int, max_model_len: int, limits: Limits) -> int:
    if value is None:
        value = DEFAULT_MAX_TOKENS
    if not _is_int(value):
        raise invalid("max_tokens must be an integer", code="invalid_type", param="max_tokens")
    if value < 1:
        raise invalid(f"max_tokens must be at least 1, got {value}", param="max_tokens")
    if limits.max_tokens is not None and value > limits.max_tokens:
        raise invalid(
            f"max_tokens is {value}; this server allows at most {limits.max_tokens}",
            param="max_tokens",
        )
    if prompt_len + value > max_model_len:
        raise invalid(
            f"this model's maximum context length is {max_model_len} tokens, however you "
            f"requested {prompt_len + value} tokens ({prompt_len} in the prompt, {value} for "
            "the completion); shorten the prompt or lower max_tokens",
            code="context_length_exceeded",
            param="max_tokens",
        )
    return int(value)


def _number(body: dict[str, Any], name: str, default: float, *, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise invalid(f"{name} must be a number", code="invalid_type", param=name)
    if not low <= value <= high:
        raise invalid(f"{name} must be between {low:g} and {high:g}, got {value}", param=name)
    return float(value)


def _top_p(body: dict[str, Any]) -> float:
    top_p = _number(body, "top_p", 1.0, low=0.0, high=1.0)
    if top_p == 0.0:
        raise invalid("top_p must be greater than 0", param="top_p")
    return top_p


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value):
        raise invalid("seed must be an integer", code="invalid_type", param="seed")
    return int(value)


def _stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid(
            "stop must be a string or a list of strings", code="invalid_type", param="stop"
        )
    if len(stops) > MAX_STOP_SEQUENCES:
        raise invalid(f"stop takes at most {MAX_STOP_SEQUENCES} sequences", param="stop")
    if any(not s or len(s) > MAX_STOP_LENGTH for s in stops):
        raise invalid(
            f"each stop sequence must be 1..{MAX_STOP_LENGTH} characters", param="stop"
        )
    return tuple(stops)


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(f"{name} must be true or false", code="invalid_type", param=name)
    return value


def _include_usage(value: Any, stream: bool) -> bool:
    if value is None:
        return False
    if not stream:
        raise invalid(
            "stream_options is only allowed when stream is true", param="stream_options"
        )
    if not isinstance(value, dict) or not isinstance(value.get("include_usage", False), bool):
        raise invalid(
            'stream_options must be an object like {"include_usage": true}',
            code="invalid_type",
            param="stream_options",
        )
    return bool(value.get("include_usage", False))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class StopMatcher:
    """Finds stop sequences in a growing completion text.

    `feed` returns the text that is safe to send now: the tail that could
    still be the start of a stop sequence is held back until it is decided.
    """

    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0
        self.stopped = False

    def feed(self, full_text: str) -> str:
        """`full_text` is the whole completion so far; returns the new text to emit."""
        self.text = full_text
        cut = min((i for i in (full_text.find(s) for s in self._stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text = full_text[:cut]
            self.stopped = True
            safe_end = cut
        else:
            safe_end = len(full_text) - self._holdback
            # A partial UTF-8 character decodes to U+FFFD until its last byte arrives.
            while safe_end > self.sent and full_text[safe_end - 1] == "\ufffd":
                safe_end -= 1
        return self._emit(max(safe_end, self.sent))

    def flush(self) -> str:
        """The held-back text, once the completion has ended without a stop."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        chunk = self.text[self.sent : end]
        self.sent = end
        return chunk
