"""A request's sampling fields as the engine's SamplingParams: the model's defaults
where the request says nothing, logit_bias keys read as token ids."""

from __future__ import annotations

from batchpilot_server.batching_config import brief
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.http.generation_defaults import GenerationDefaults
from batchpilot_server.http.protocol import SamplingFields, invalid
from batchpilot_server.http.request_validation import printable


def sampling_params(
    request: SamplingFields,
    defaults: GenerationDefaults,
    vocab_size: int,
    max_tokens: int,
    *,
    logprobs: int | None,
    prompt_logprobs: int | None,
) -> SamplingParams:
    """`defaults`: the model's, for the fields the request leaves out."""
    top_k = defaults.top_k if request.top_k is None else request.top_k
    min_tokens = request.min_tokens or 0
    if min_tokens > max_tokens:
        raise invalid(
            f"min_tokens is {brief(min_tokens)}, more than the {max_tokens} tokens asked for",
            param="min_tokens",
        )
    stop_ids = tuple(request.stop_token_ids or ())
    check_token_ids(list(stop_ids), vocab_size, "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_default(request.temperature, defaults.temperature),
        top_p=_default(request.top_p, defaults.top_p),
        seed=request.seed,
        stop_token_ids=stop_ids,
        ignore_eos=bool(request.ignore_eos),
        top_k=0 if top_k < 0 or top_k >= vocab_size else top_k,  # -1, 0, all: every token
        min_p=_default(request.min_p, defaults.min_p),
        repetition_penalty=_default(request.repetition_penalty, defaults.repetition_penalty),
        frequency_penalty=request.frequency_penalty or 0.0,
        presence_penalty=request.presence_penalty or 0.0,
        logit_bias=_logit_bias(request.logit_bias, vocab_size),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )


def _default(value: float | None, default: float) -> float:
    return default if value is None else value


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias} with its keys read as the ids they spell."""
    entries = []
    for key, value in (bias or {}).items():
        param = f"logit_bias.{printable(key)}"
        if not (key.isascii() and key.isdigit()) or int(key) >= vocab_size:
            raise invalid(
                f"{param}: {brief(printable(key))} is not a token id of this model's "
                f"vocabulary 0..{vocab_size - 1}",
                code="invalid_token_id",
                param=param,
            )
        if value:
            entries.append((int(key), value))
    return tuple(entries)


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    for index, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise invalid(
                f"{field}[{index}] is {brief(token)}, not a token id of this model's "
                f"vocabulary 0..{vocab_size - 1}",
                code="invalid_token_id",
                param=f"{field}[{index}]",
            )
