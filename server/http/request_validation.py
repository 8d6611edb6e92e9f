"""A parsed body checked against its wire model (protocol.py): the first field at
fault as OpenAI's error shape, and a log line naming the fields no model declares."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any, TypeVar

from batchpilot_server.batching_config import brief
from batchpilot_server.http.protocol import ApiError, invalid
from pydantic import BaseModel, TypeAdapter, ValidationError

log = logging.getLogger("batchpilot.server")


def printable(text: str) -> str:
    """`text` with lone surrogates spelled out, so that it can travel in a UTF-8 answer."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


T = TypeVar("T")


def validate(adapter: TypeAdapter[T], body: Any) -> T:
    """`body` as the declared type, or the ApiError naming the first field at fault."""
    try:
        return adapter.validate_python(body)
    except ValidationError as exc:
        raise _api_error(exc, adapter) from None


def _api_error(exc: ValidationError, adapter: TypeAdapter[Any]) -> ApiError:
    # Never str(exc): it prints the input, which may be an integer of thousands of
    # digits (Python refuses to) or nested a thousand levels deep.
    errors = exc.errors(include_url=False)
    wrong = [e for e in errors if e["type"] not in ("missing", "extra_forbidden")]
    unknown = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
    if unknown and not wrong:
        # A typo (`max_token`) shows as an unknown field and often a missing one: name the
        # unknown first. A wrong value of a known field comes before both.
        names = [_param(loc) for loc in unknown]
        allowed = f"; allowed: {', '.join(known_fields(adapter))}" if len(unknown[0]) == 1 else ""
        verb = "is not a known field" if len(names) == 1 else "are not known fields"
        return invalid(f"{', '.join(names)} {verb}{allowed}", code="unknown_field", param=names[0])
    first = (wrong or errors)[0]
    param = _param(first["loc"]) or None
    code, predicate = _describe(first)
    return invalid(f"{param or 'request body'} {predicate}", code=code, param=param)


@cache
def known_fields(adapter: TypeAdapter[Any]) -> tuple[str, ...]:
    return tuple(sorted(adapter.json_schema().get("properties", {})))


def _param(loc: tuple[int | str, ...]) -> str:
    """`messages[0].content`: the error's location without the union tags (`<list>`)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not part.startswith("<"):
            path += f".{printable(part)}" if path else printable(part)
    return path


_TYPE_PREDICATES = {
    "int_type": "must be an integer",
    "int_from_float": "must be an integer",
    "float_type": "must be a number",
    "bool_type": "must be true or false",
    "string_type": "must be a string",
    "list_type": "must be a list",
    "dict_type": "must be a JSON object",
    "model_type": "must be a JSON object",
    "model_attributes_type": "must be a JSON object",
    "none_required": "must be null",
}


def _describe(error: Any) -> tuple[str, str]:
    """(code, predicate) for one pydantic error: 'must be at least 1, got 0'."""
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        return "missing_field", "is required"
    if kind == "float_type" and isinstance(value, int) and not isinstance(value, bool):
        return "invalid_value", f"is out of range, got {brief(value)}"
    if kind == "string_unicode":  # pydantic meets a lone surrogate in a field name
        return "invalid_unicode", "holds a field name that is not valid Unicode (a lone surrogate)"
    if kind == "finite_number":
        return "invalid_value", "must be a finite number"
    if kind in _TYPE_PREDICATES:
        return "invalid_type", _TYPE_PREDICATES[kind]
    got = f", got {brief(value)}"
    bounds = {
        "greater_than_equal": ("must be at least", "ge"),
        "greater_than": ("must be greater than", "gt"),
        "less_than_equal": ("must be at most", "le"),
        "less_than": ("must be less than", "lt"),
    }
    if kind in bounds:
        words, key = bounds[kind]
        return "invalid_value", f"{words} {ctx[key]}{got}"
    if kind in ("string_too_short", "too_short") and ctx.get("min_length") == 1:
        return "invalid_value", "must not be empty"
    if kind == "string_too_short":
        return "invalid_value", f"must hold at least {ctx['min_length']} characters"
    if kind == "string_too_long":
        return "invalid_value", f"must hold at most {ctx['max_length']} characters"
    if kind == "too_short":
        return "invalid_value", f"must hold at least {ctx['min_length']} items"
    if kind == "too_long":
        return "invalid_value", f"must hold at most {ctx['max_length']} items"
    if kind == "literal_error":
        return "invalid_value", f"must be {ctx['expected']}"
    # PydanticCustomError from the validators above: the type is the code.
    custom = kind in ("invalid_unicode", "invalid_type", "unsupported")
    return (kind if custom else "invalid_value"), error["msg"]


# --- fields this server does not know ------------------------------------------------

# the log line names this many unknown fields at most, each cut to this length
MAX_NAMED_UNKNOWN = 16
MAX_UNKNOWN_NAME = 64


def unknown_fields(model: BaseModel, path: str = "") -> list[str]:
    """The paths of every field no model declares (`messages[0].reasoning`), in order."""
    names = [_join(path, key) for key in model.model_extra or {}]
    for name in type(model).model_fields:
        names += _unknown_in(getattr(model, name), _join(path, name))
    return names


def _unknown_in(value: Any, path: str) -> list[str]:
    if isinstance(value, BaseModel):
        return unknown_fields(value, path)
    if isinstance(value, list) and value and isinstance(value[0], BaseModel | list):
        # (a prompt of token ids is a long list of plain integers: not walked)
        return [name for i, item in enumerate(value) for name in _unknown_in(item, f"{path}[{i}]")]
    return []


def _join(path: str, key: str) -> str:
    # escaped: a name may hold a newline or a lone surrogate, and the log line is one line
    key = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in key[:MAX_UNKNOWN_NAME])
    return f"{path}.{key}" if path else key


def log_unknown_fields(model: BaseModel, route: str) -> None:
    """One log line per request naming what was ignored, as vLLM logs it."""
    names = unknown_fields(model)
    if not names:
        return
    more = len(names) - MAX_NAMED_UNKNOWN
    listed = ", ".join(names[:MAX_NAMED_UNKNOWN]) + (f" and {more} more" if more > 0 else "")
    log.warning("%s: ignored request fields this server does not know: %s", route, listed)
