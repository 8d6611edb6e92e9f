"""Grammar-constrained decoding, the HTTP layer's side: compiling what a request's
`response_format` or forced tool call asks for into the engine's `Grammar`.

xgrammar compiles a JSON schema against the model's vocabulary into a grammar whose
matcher says, token by token, which next tokens keep the output inside the schema. The
request handler compiles (`GrammarCompiler.compile`) in a worker thread with a time
limit, never on the event loop or the engine thread; a schema past the caps below, one
that does not compile, or one that does not compile in time is a 400 naming the request
field; compiled grammars are cached by schema text (xgrammar's own cache, bounded in
bytes). The engine then only masks with the compiled state (grammar.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch
import xgrammar as xgr
from batchpilot_server.engine.grammar import CLOSERS, Grammar, Vocabulary
from batchpilot_server.http.grammar_request import GrammarRequest
from batchpilot_server.http.protocol import ApiError, invalid
from batchpilot_server.tokenizer import Tokenizer

# Caps on what one schema may ask of the compiler (docs/api.md): its JSON text, how
# deep it nests, how many enum/const values it lists in all, and how long it compiles.
MAX_SCHEMA_BYTES = 32 * 1024
MAX_SCHEMA_DEPTH = 32
MAX_ENUM_VALUES = 1024
COMPILE_TIMEOUT_S = 10.0
# compilations running at once: a pathological schema that runs past its time limit
# keeps its thread (a compile cannot be interrupted) and takes no more than one
COMPILE_WORKERS = 2
# compiled grammars kept (xgrammar's cache), and schemas remembered as refused
CACHE_LIMIT_BYTES = 256 * 2**20
MAX_REMEMBERED_FAILURES = 256


class Histogram(Protocol):
    def observe(self, amount: float) -> None: ...


class GrammarCompiler:
    """The server's grammar compiler for one model's vocabulary (built on first use)."""

    def __init__(self, tokenizer: Tokenizer, compile_seconds: Histogram, mask_seconds: Histogram):
        self._tokenizer = tokenizer
        self._compile_seconds = compile_seconds
        self._mask_seconds = mask_seconds
        self._pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="grammar")
        self._compiler: xgr.GrammarCompiler | None = None
        self._vocab: Vocabulary | None = None
        self._lock = threading.Lock()
        self._failures: OrderedDict[str, str] = OrderedDict()

    async def compile(self, request: GrammarRequest) -> Grammar:
        """The grammar, or an ApiError (400) naming `request.param`."""
        check_caps(request)
        key = request.key
        if (reason := self._failures.get(key)) is not None:
            raise invalid(reason, code="invalid_schema", param=request.param)
        loop = asyncio.get_running_loop()
        job = loop.run_in_executor(self._pool, self._compile, request)
        try:
            compiled = await asyncio.wait_for(job, COMPILE_TIMEOUT_S)
        except TimeoutError:
            reason = (
                f"{request.param}: the schema did not compile within {COMPILE_TIMEOUT_S:g} s; "
                "simplify it (fewer nested or alternative parts)"
            )
            raise self._refused(key, reason, request.param) from None
        except (RuntimeError, ValueError) as exc:  # xgrammar's words for a bad schema
            reason = f"{request.param}: the schema cannot be compiled: {_first_line(exc)}"
            raise self._refused(key, reason, request.param) from None
        assert self._vocab is not None  # built with the compiler
        return Grammar(compiled, self._vocab, self._mask_seconds.observe)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _refused(self, key: str, reason: str, param: str) -> ApiError:
        self._failures[key] = reason
        while len(self._failures) > MAX_REMEMBERED_FAILURES:
            self._failures.popitem(last=False)
        return invalid(reason, code="invalid_schema", param=param)

    def _compile(self, request: GrammarRequest) -> xgr.CompiledGrammar:
        began = time.perf_counter()
        compiler = self._xgrammar_compiler()
        # No free whitespace between tokens: a small model would pad with it forever.
        # strict_mode: no property or item beyond the schema's, so the output validates.
        compiled = compiler.compile_json_schema(
            request.key or '{"type": "object"}',
            any_whitespace=False,
            strict_mode=request.schema is not None,
        )
        self._compile_seconds.observe(time.perf_counter() - began)
        return compiled

    def _xgrammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                vocab = vocabulary_bytes(self._tokenizer)
                spelled = {raw: token_id for token_id, raw in reversed(list(enumerate(vocab)))}
                eos = sorted(self._tokenizer.eos_ids)
                closers = (*eos[:1], *(spelled[c] for c in CLOSERS if c in spelled))
                forbidden = [i for i, raw in enumerate(vocab) if not _whole_text(raw)]
                self._vocab = Vocabulary(len(vocab), closers, torch.tensor(forbidden))
                info = xgr.TokenizerInfo(
                    vocab, xgr.VocabType.RAW, vocab_size=len(vocab), stop_token_ids=eos
                )
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES
                )
            return self._compiler


def vocabulary_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """The vocabulary as xgrammar reads it (RAW): each token's own bytes; special
    tokens empty, which xgrammar never allows (EOS is its stop token)."""
    special = special_token_ids(tokenizer)
    return [
        b"" if token_id in special else tokenizer.token_bytes(token_id)
        for token_id in range(tokenizer.vocab_size)
    ]


def _whole_text(raw: bytes) -> bool:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return not any(ord(char) < 0x20 for char in text)


def special_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Control tokens (<|im_end|>, BOS): markup the decoded text leaves out."""
    pipeline = getattr(tokenizer, "pipeline", None)
    ids = set(tokenizer.eos_ids)
    if tokenizer.bos_id is not None:
        ids.add(tokenizer.bos_id)
    if pipeline is not None:
        ids |= {i for i, token in pipeline.get_added_tokens_decoder().items() if token.special}
    return frozenset(ids)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[-1][:300] if text else type(exc).__name__


# --- caps -----------------------------------------------------------------------


def check_caps(request: GrammarRequest) -> None:
    """Refuse, before any compile, a schema past the documented caps."""
    schema, param = request.schema, request.param
    if schema is None:
        return
    size = len(request.key.encode("utf-8"))
    if size > MAX_SCHEMA_BYTES:
        raise invalid(
            f"{param}: the schema is {size} bytes of JSON; at most {MAX_SCHEMA_BYTES}",
            code="schema_too_large",
            param=param,
        )
    depth, values = 0, 0
    for level, node in _walk(schema):
        depth = max(depth, level)
        if isinstance(node, dict):
            if isinstance(node.get("enum"), list):
                values += len(node["enum"])
            values += "const" in node
    if depth > MAX_SCHEMA_DEPTH:
        raise invalid(
            f"{param}: the schema nests {depth} levels deep; at most {MAX_SCHEMA_DEPTH}",
            code="schema_too_deep",
            param=param,
        )
    if values > MAX_ENUM_VALUES:
        raise invalid(
            f"{param}: the schema lists {values} enum/const values; at most {MAX_ENUM_VALUES}",
            code="schema_too_large",
            param=param,
        )
    if (cycle := _ref_cycle(schema)) is not None:
        raise invalid(
            f"{param}: the schema refers to itself ({cycle}); recursive schemas are not "
            "supported (their output has no bound)",
            code="recursive_schema",
            param=param,
        )


def _walk(node: Any, level: int = 1) -> Iterator[tuple[int, Any]]:
    """Every JSON value of `node` with its depth, iteratively (no recursion limit)."""
    stack = [(level, node)]
    while stack:
        depth, value = stack.pop()
        yield depth, value
        children = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict | list):
            stack += [(depth + 1, child) for child in children]


def _local_refs(node: Any) -> set[str]:
    return {
        value["$ref"]
        for _, value in _walk(node)
        if isinstance(value, dict) and isinstance(value.get("$ref"), str)
    }


def _ref_cycle(schema: dict[str, Any]) -> str | None:
    """A `$ref` that leads back to itself (or to the root), if any."""

    def target(ref: str) -> Any:
        if ref == "#":
            return schema
        if not ref.startswith("#/"):
            return None
        node: Any = schema
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    edges: dict[str, set[str]] = {}
    pending = list(_local_refs(schema))
    while pending:
        ref = pending.pop()
        if ref in edges:
            continue
        node = target(ref)
        edges[ref] = _local_refs(node) if node is not None else set()
        pending += edges[ref]
    for start in edges:
        seen, stack = set(), list(edges[start])
        while stack:
            ref = stack.pop()
            if ref == start or ref == "#":
                return ref
            if ref not in seen:
                seen.add(ref)
                stack += edges.get(ref, ())
    return None
