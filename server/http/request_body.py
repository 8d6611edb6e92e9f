"""A request's body: read, its Content-Encoding undone within the size limit, and
parsed as JSON, every failure a 400 naming what is wrong."""

from __future__ import annotations

import json
import re
import zlib
from typing import Any

from aiohttp import web
from batchpilot_server.http.protocol import ApiError, invalid
from batchpilot_server.http.request_validation import printable
from batchpilot_server.http.server_state import STATE

# zlib's window bits per HTTP content coding (RFC 9110 8.4.1)
_CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def decode_body(raw: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The body with its Content-Encoding undone (the server reads bodies raw so that a
    body that is not what its header says gets a 400 here, and a small compressed body
    cannot unpack past `max_bytes`)."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    for coding in reversed([c for c in codings if c and c != "identity"]):
        if coding not in _CODINGS:
            raise ApiError(
                415,
                f"Content-Encoding {printable(coding)!r} is not supported; send the body "
                "as is, or with gzip or deflate",
                code="unsupported_content_encoding",
            )
        raw = _decompress(raw, coding, max_bytes)
    return raw


def _decompress(raw: bytes, coding: str, max_bytes: int) -> bytes:
    decompressor = zlib.decompressobj(_CODINGS[coding])
    try:
        data = decompressor.decompress(raw, max_bytes + 1)
    except zlib.error as exc:
        raise invalid(
            f"request body is not {coding} data, as its Content-Encoding says: {exc}",
            code="invalid_content_encoding",
        ) from None
    if len(data) > max_bytes:
        raise ApiError(
            413,
            f"request body unpacks to more than the limit of {max_bytes} bytes",
            code="body_too_large",
        )
    if not decompressor.eof or decompressor.unused_data:
        raise invalid(
            f"request body is not one whole {coding} stream, as its Content-Encoding says",
            code="invalid_content_encoding",
        )
    return data


_JSON_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


def parse_json_body(raw: bytes) -> Any:
    if not raw.strip():
        raise invalid("request body is empty; send a JSON object", code="invalid_json")
    try:
        return json.loads(raw, parse_int=_parse_int)
    except RecursionError:
        field = _deepest_field(raw.decode("utf-8", errors="replace"))
        where = f"field {field}" if field else "request body"
        raise invalid(
            f"{where} is nested too deeply to read; this API's JSON nests a few levels at most",
            code="nesting_too_deep",
            param=field,
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise invalid(f"request body is not valid JSON: {exc}", code="invalid_json") from None


def _parse_int(literal: str) -> int:
    try:
        return int(literal)
    except ValueError:
        # Beyond Python's int/str digit limit: its magnitude is all any limit here
        # needs, and the field it sits in gets the error that names it.
        digits = len(literal.lstrip("-"))
        return (-1 if literal.startswith("-") else 1) * 10 ** (digits - 1)


def _deepest_field(text: str) -> str | None:
    """The top-level key whose value nests deepest (None: not an object, or the body
    itself). The last string met at depth 1 before a nested value opens is its key."""
    depth, key, deepest, deepest_key = 0, None, 0, None
    in_object = text.lstrip().startswith("{")
    for match in _JSON_TOKENS.finditer(text):
        token = match.group()
        if token.startswith('"'):
            if depth == 1 and in_object:
                key = token
        elif token in "[{":
            depth += 1
            if depth > deepest:
                deepest, deepest_key = depth, key if depth > 1 else None
        else:
            depth -= 1
    if deepest_key is None:
        return None
    try:
        return printable(json.loads(deepest_key))
    except ValueError:
        return None


async def read_json(request: web.Request) -> Any:
    """The request's JSON body, its Content-Encoding undone."""
    try:
        raw = await request.read()
    except web.RequestPayloadError as exc:  # e.g. a body shorter than its Content-Length
        raise invalid(f"request body could not be read: {exc}", code="invalid_body") from exc
    limit = request.app[STATE].limits.max_body_bytes
    return parse_json_body(decode_body(raw, request.headers.get("Content-Encoding"), limit))
