"""Text out of token ids, over real HTTP: stop strings across token boundaries, and
streams that never split a character.

A model's output cannot be chosen, so these tests put the real app in front of
an engine that answers every request with a chosen list of token ids, and read
what the app makes of them with the tiny model's byte tokenizer and with
SmolLM2's real one (multi-character tokens, characters spread over tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from batchpilot_server.batching_config import BatchingConfig
from batchpilot_server.engine.gguf_checkpoint import GGUFCheckpoint
from batchpilot_server.engine_api import EngineStats, SamplingParams, TokenEvent
from batchpilot_server.http.app import create_app
from batchpilot_server.http.metrics import ServerMetrics
from batchpilot_server.http.protocol import Limits
from batchpilot_server.tokenizer import ByteTokenizer, Tokenizer

from tests.support.servers import stream_events
from tests.support.smollm2 import gguf_path

pytestmark = pytest.mark.timeout(120)

TEXT = "The quick brown fox — naïve café 🚀 日本語 ok!"


class ScriptedStream:
    def __init__(self, ids: list[int]) -> None:
        self._events = iter(
            TokenEvent(token_id, index, "length" if index == len(ids) - 1 else None)
            for index, token_id in enumerate(ids)
        )

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self) -> TokenEvent:
        try:
            return next(self._events)
        except StopIteration:
            raise StopAsyncIteration from None

    def cancel(self) -> None:
        self._events = iter(())


class ScriptedEngine:
    """Answers every request with `script` (cut to its max_tokens)."""

    def __init__(self, tokenizer: Tokenizer, script: list[int]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.config = BatchingConfig()
        self.max_model_len = 4096
        self.failure = None

    async def start(self) -> None:
        pass

    async def shutdown(self) -> None:
        pass

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        deadline_s: float | None,
        slo_class: str = "default",
        priority: int = 0,
    ) -> ScriptedStream:
        return ScriptedStream(self.script[: params.max_tokens])

    def reconfigure(self, config: BatchingConfig) -> None:
        self.config = config

    def stats(self) -> EngineStats:
        return EngineStats(running=0, waiting=0, kv_blocks_total=1, kv_blocks_used=0)


@contextlib.asynccontextmanager
async def serve_script(tokenizer: Tokenizer, text: str) -> AsyncIterator[str]:
    engine = ScriptedEngine(tokenizer, tokenizer.encode(text, add_special_tokens=False))
    metrics = ServerMetrics(model="scripted", mode="continuous")
    app = create_app(engine, metrics=metrics, admin_token=None, limits=Limits())
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


@pytest.fixture(scope="module", params=["bytes", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> Iterator[Tokenizer]:
    if request.param == "bytes":
        yield ByteTokenizer()
    else:
        yield GGUFCheckpoint(gguf_path()).tokenizer()


ENDPOINTS = {
    "/v1/completions": ({"prompt": "x"}, lambda choice: choice["text"]),
    "/v1/chat/completions": (
        {"messages": [{"role": "user", "content": "x"}]},
        lambda choice: choice["delta"].get("content", "") if "delta" in choice
        else choice["message"]["content"],
    ),
}  # fmt: skip


async def generate(
    url: str, path: str, stop: list[str], stream: bool
) -> tuple[list[str], str | None]:
    """The text pieces the answer carries (one per event when streamed) and its finish reason."""
    body, text_of = ENDPOINTS[path]
    request = {**body, "max_tokens": 200, "stop": stop, "stream": stream}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + path, json=request) as response,
    ):
        assert response.status == 200, await response.text()
        if not stream:
            choice = (await response.json())["choices"][0]
            return [text_of(choice)], choice["finish_reason"]
        events = await stream_events(response)
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events if isinstance(e, dict) and e["choices"]]
    return [text_of(choice) for choice in choices], choices[-1]["finish_reason"]


def assert_pieces_are_whole_text(pieces: list[str]) -> None:
    for piece in pieces:
        assert "\ufffd" not in piece, pieces  # a character cut between two events
        piece.encode("utf-8")  # and never half of a surrogate pair


def test_the_texts_cover_both_kinds_of_token_boundary() -> None:
    """What the cases below rely on: SmolLM2 has tokens of several characters and
    characters of several tokens in TEXT; the byte tokenizer splits every character
    of more than one byte."""
    real = GGUFCheckpoint(gguf_path()).tokenizer()
    pieces = [real.decode([i]) for i in real.encode(TEXT, add_special_tokens=False)]
    assert any(len(p) > 1 and "\ufffd" not in p for p in pieces)
    assert any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_every_character_arrives_whole(tokenizer: Tokenizer, path: str, stream: bool):
    async with serve_script(tokenizer, TEXT) as url:
        pieces, finish = await generate(url, path, [], stream)
    assert_pieces_are_whole_text(pieces)
    assert "".join(pieces) == TEXT
    assert finish == "length"


# stops that span several tokens and several multi-byte characters, end inside a
# token, or start like TEXT but part from it (held back, then sent after all)
STOPS: list[tuple[list[str], str, str]] = [
    (["🚀 日本"], TEXT[: TEXT.index("🚀 日本")], "stop"),
    (["quick brown"], "The ", "stop"),
    (["qu"], "The ", "stop"),
    (["e ca", "ïve"], TEXT[: TEXT.index("ïve")], "stop"),
    (["🚀 日本人"], TEXT, "length"),
    (["ok!?"], TEXT, "length"),
]


@pytest.mark.parametrize("path", ENDPOINTS)
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("stop", "expected", "finish"), STOPS)
async def test_stop_strings_across_token_boundaries(
    tokenizer: Tokenizer,
    path: str,
    stream: bool,
    stop: list[str],
    expected: str,
    finish: str,
) -> None:
    async with serve_script(tokenizer, TEXT) as url:
        pieces, finish_reason = await generate(url, path, stop, stream)
    assert_pieces_are_whole_text(pieces)
    assert "".join(pieces) == expected
    assert finish_reason == finish

