"""The OpenAI-compatible API over real HTTP against the real app and engine."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from batchpilot_server import metric_names as names
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.models import get_spec
from batchpilot_server.engine_api import EngineOptions
from batchpilot_server.http.server_state import STATE
from openapi_spec_validator import validate

from tests.support.servers import complete, scrape, serve_in_process, stream_events

pytestmark = pytest.mark.timeout(60)


async def test_openai_client_completes_streaming_and_not() -> None:
    async with serve_in_process() as server:
        client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        try:
            plain = await client.completions.create(
                model="tiny",
                prompt="Hello",
                max_tokens=12,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            stream = await client.completions.create(
                model="tiny",
                prompt="Hello",
                max_tokens=12,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = [chunk async for chunk in stream]
            with_usage = await client.completions.create(
                model="tiny",
                prompt="Hello",
                max_tokens=3,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage_chunks = [chunk async for chunk in with_usage]
        finally:
            await client.close()
    assert plain.usage is not None
    assert plain.usage.completion_tokens == 12
    assert plain.usage.prompt_tokens == len("Hello") + 1  # bytes + BOS
    assert plain.choices[0].finish_reason == "length"
    # Greedy decoding: the streamed pieces add up to the same text.
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text
    assert len(chunks) == 12  # one event per token
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    # stream_options.include_usage: one more event, with no choices, carrying the usage.
    assert usage_chunks[-1].choices == []
    assert usage_chunks[-1].usage is not None
    assert usage_chunks[-1].usage.total_tokens == usage_chunks[-1].usage.prompt_tokens + sum(
        1 for c in usage_chunks[:-1]
    )


@pytest.mark.parametrize("mode", ["continuous", "dynamic"])
async def test_64_concurrent_requests_complete_with_their_token_counts(mode: str) -> None:
    max_tokens = [1 + i % 12 for i in range(64)]
    prompts = [f"request {i}" for i in range(64)]
    async with (
        serve_in_process(mode=mode, max_batch_size=16) as server,
        aiohttp.ClientSession() as session,
    ):
        answers = await asyncio.gather(
            *(
                complete(session, server.url, prompt=p, max_tokens=n, ignore_eos=True)
                for p, n in zip(prompts, max_tokens, strict=True)
            )
        )
        metrics = await scrape(session, server.url)
    assert [status for status, _, _ in answers] == [200] * 64
    assert [body["usage"]["completion_tokens"] for _, body, _ in answers] == max_tokens
    # /metrics agrees with what was served.
    prompt_tokens = sum(len(p.encode()) + 1 for p in prompts)
    assert metrics[(f"{names.REQUESTS_TOTAL}", "ok")] == 64
    assert metrics[(names.REQUESTS_ARRIVED_TOTAL, "")] == 64
    for outcome in ("rejected", "timeout", "error"):
        assert metrics[(names.REQUESTS_TOTAL, outcome)] == 0
    assert metrics[(names.PROMPT_TOKENS_TOTAL, "")] == prompt_tokens
    assert metrics[(names.GENERATION_TOKENS_TOTAL, "")] == sum(max_tokens)
    assert metrics[(f"{names.REQUEST_DURATION}_count", "")] == 64
    assert metrics[(f"{names.TIME_TO_FIRST_TOKEN}_count", "")] == 64
    assert metrics[(f"{names.INTER_TOKEN_LATENCY}_count", "")] == sum(n - 1 for n in max_tokens)
    assert metrics[(f"{names.QUEUE_WAIT}_count", "")] == 64
    assert metrics[(f"{names.BATCH_SIZE}_count", "")] > 0
    assert metrics[(f"{names.STEP_DURATION}_count", "")] > 0
    assert metrics[(names.REQUESTS_RUNNING, "")] == 0
    assert metrics[(names.REQUESTS_WAITING, "")] == 0
    assert metrics[(names.KV_CACHE_USAGE, "")] == 0
    if mode == "dynamic":
        assert metrics[(f"{names.HOSTAGE}_count", "")] > 0


async def test_stop_string_truncates_and_streams_the_same_text() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        _, free, _ = await complete(
            session, server.url, prompt="abc", max_tokens=24, ignore_eos=True, temperature=0
        )
        text = free["choices"][0]["text"]
        stop = text[5:7]  # some piece the greedy output is known to contain
        expected = text[: text.find(stop)]
        _, stopped, _ = await complete(
            session,
            server.url,
            prompt="abc",
            max_tokens=24,
            ignore_eos=True,
            stop=[stop],
            temperature=0,
        )
        body = {
            "prompt": "abc", "max_tokens": 24, "ignore_eos": True, "stop": stop, "temperature": 0
        }  # fmt: skip
        async with session.post(
            f"{server.url}/v1/completions", json={**body, "stream": True}
        ) as response:
            events = await stream_events(response)
    assert stopped["choices"][0] == {
        "index": 0, "text": expected, "logprobs": None, "finish_reason": "stop"
    }  # fmt: skip
    assert stopped["usage"]["completion_tokens"] < 24
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_seeded_sampling_is_reproducible() -> None:
    body = {"prompt": "xyz", "max_tokens": 16, "temperature": 1.0, "top_p": 0.9, "seed": 7}
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        first = await complete(session, server.url, **body, ignore_eos=True)
        second = await complete(session, server.url, **body, ignore_eos=True)
    assert first[1]["choices"][0]["text"] == second[1]["choices"][0]["text"]


def _huge_prompt_ids(count: int) -> list[int]:
    return [65] * count


# (name, method, path, body: JSON-able, raw bytes or None, status, error type, code)
BAD_INPUTS: list[tuple[str, str, str, Any, int, str, str | None]] = [
    ("malformed JSON", "POST", "/v1/completions", b"{not json", 400,
     "invalid_request_error", "invalid_json"),
    ("empty body", "POST", "/v1/completions", b"", 400, "invalid_request_error", "invalid_json"),
    ("body is a list", "POST", "/v1/completions", [1, 2], 400,
     "invalid_request_error", "invalid_type"),
    ("missing prompt", "POST", "/v1/completions", {"max_tokens": 3}, 400,
     "invalid_request_error", "missing_field"),
    ("empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400,
     "invalid_request_error", "invalid_value"),
    ("empty token list", "POST", "/v1/completions", {"prompt": []}, 400,
     "invalid_request_error", "invalid_value"),
    ("prompt wrong type", "POST", "/v1/completions", {"prompt": 42}, 400,
     "invalid_request_error", "invalid_type"),
    ("unknown token id", "POST", "/v1/completions", {"prompt": [1, 99999]}, 400,
     "invalid_request_error", "invalid_token_id"),
    ("negative token id", "POST", "/v1/completions", {"prompt": [-1]}, 400,
     "invalid_request_error", "invalid_token_id"),
    ("a prompt in a batch empty", "POST", "/v1/completions", {"prompt": ["a", ""]}, 400,
     "invalid_request_error", "invalid_value"),
    ("prompts mixed", "POST", "/v1/completions", {"prompt": ["a", [1]]}, 400,
     "invalid_request_error", "invalid_type"),
    ("too many sequences", "POST", "/v1/completions", {"prompt": ["a"] * 5, "n": 16}, 400,
     "invalid_request_error", "invalid_value"),
    ("max_tokens negative", "POST", "/v1/completions", {"prompt": "a", "max_tokens": -5}, 400,
     "invalid_request_error", "invalid_value"),
    ("max_tokens zero", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400,
     "invalid_request_error", "invalid_value"),
    ("max_tokens huge", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 10**9}, 400,
     "invalid_request_error", "context_length_exceeded"),
    ("max_tokens string", "POST", "/v1/completions", {"prompt": "a", "max_tokens": "5"}, 400,
     "invalid_request_error", "invalid_type"),
    ("max_tokens bool", "POST", "/v1/completions", {"prompt": "a", "max_tokens": True}, 400,
     "invalid_request_error", "invalid_type"),
    ("temperature negative", "POST", "/v1/completions", {"prompt": "a", "temperature": -1},
     400, "invalid_request_error", "invalid_value"),
    ("temperature string", "POST", "/v1/completions", {"prompt": "a", "temperature": "hot"},
     400, "invalid_request_error", "invalid_type"),
    ("top_p above 1", "POST", "/v1/completions", {"prompt": "a", "top_p": 1.5}, 400,
     "invalid_request_error", "invalid_value"),
    ("seed float", "POST", "/v1/completions", {"prompt": "a", "seed": 1.5}, 400,
     "invalid_request_error", "invalid_type"),
    ("stop wrong type", "POST", "/v1/completions", {"prompt": "a", "stop": 3}, 400,
     "invalid_request_error", "invalid_type"),
    ("stream not bool", "POST", "/v1/completions", {"prompt": "a", "stream": "yes"}, 400,
     "invalid_request_error", "invalid_type"),
    ("ignore_eos not bool", "POST", "/v1/completions", {"prompt": "a", "ignore_eos": 1}, 400,
     "invalid_request_error", "invalid_type"),
    ("n above the cap", "POST", "/v1/completions", {"prompt": "a", "n": 17}, 400,
     "invalid_request_error", "invalid_value"),
    ("best_of unlike n", "POST", "/v1/completions", {"prompt": "a", "best_of": 3}, 400,
     "invalid_request_error", "unsupported"),
    ("suffix", "POST", "/v1/completions", {"prompt": "a", "suffix": "end"}, 400,
     "invalid_request_error", "invalid_value"),
    ("logprobs above the cap", "POST", "/v1/completions", {"prompt": "a", "logprobs": 21},
     400, "invalid_request_error", "invalid_value"),
    ("logit_bias not a token id", "POST", "/v1/completions",
     {"prompt": "a", "logit_bias": {"x": 1}}, 400, "invalid_request_error", "invalid_token_id"),
    ("logit_bias out of range", "POST", "/v1/completions",
     {"prompt": "a", "logit_bias": {"5": 101}}, 400, "invalid_request_error", "invalid_value"),
    ("top_k below -1", "POST", "/v1/completions", {"prompt": "a", "top_k": -2}, 400,
     "invalid_request_error", "invalid_value"),
    ("min_p above 1", "POST", "/v1/completions", {"prompt": "a", "min_p": 1.5}, 400,
     "invalid_request_error", "invalid_value"),
    ("repetition_penalty zero", "POST", "/v1/completions",
     {"prompt": "a", "repetition_penalty": 0}, 400, "invalid_request_error", "invalid_value"),
    ("presence_penalty above 2", "POST", "/v1/completions",
     {"prompt": "a", "presence_penalty": 2.5}, 400, "invalid_request_error", "invalid_value"),
    ("min_tokens above max_tokens", "POST", "/v1/completions",
     {"prompt": "a", "max_tokens": 2, "min_tokens": 3}, 400, "invalid_request_error",
     "invalid_value"),
    ("stop_token_ids unknown", "POST", "/v1/completions",
     {"prompt": "a", "stop_token_ids": [99999]}, 400, "invalid_request_error",
     "invalid_token_id"),
    ("unknown model", "POST", "/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404,
     "not_found_error", "model_not_found"),
    ("prompt over context", "POST", "/v1/completions", {"prompt": _huge_prompt_ids(100_000)},
     400, "invalid_request_error", "context_length_exceeded"),
    ("oversized body", "POST", "/v1/completions", b'{"prompt": "' + b"a" * (1 << 21) + b'"}',
     413, "invalid_request_error", "body_too_large"),
    ("unknown route", "GET", "/v1/chat/nothing", None, 404, "not_found_error",
     "route_not_found"),
    ("wrong method", "GET", "/v1/completions", None, 405, "invalid_request_error",
     "method_not_allowed"),
]  # fmt: skip


async def test_bad_inputs_get_their_exact_error_and_the_server_keeps_serving() -> None:
    assert len(BAD_INPUTS) >= 15
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        seen = []
        for name, method, path, body, _, _, _ in BAD_INPUTS:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
            async with session.request(method, f"{server.url}{path}", data=data) as response:
                error = (await response.json())["error"]
                seen.append((name, response.status, error["type"], error["code"]))
                assert error["message"], name
        status, answer, _ = await complete(session, server.url, prompt="still here", max_tokens=3)
        metrics = await scrape(session, server.url)
    assert seen == [(name, s, t, c) for name, _, _, _, s, t, c in BAD_INPUTS]
    assert status == 200 and answer["usage"]["completion_tokens"] >= 1
    completion_errors = sum(1 for case in BAD_INPUTS if case[2] == "/v1/completions"
                            and case[1] == "POST")  # fmt: skip
    assert metrics[(names.REQUESTS_TOTAL, "rejected")] == completion_errors
    # arrivals count what the tuner must carry: refused requests too, and the good one
    assert metrics[(names.REQUESTS_ARRIVED_TOTAL, "")] == completion_errors + 1
    assert metrics[(names.REQUESTS_TOTAL, "error")] == 0


async def test_server_limits_on_prompt_and_max_tokens() -> None:
    async with (
        serve_in_process(max_prompt_tokens=8, max_tokens=4) as server,
        aiohttp.ClientSession() as session,
    ):
        long_prompt = await complete(session, server.url, prompt="x" * 8, max_tokens=2)
        many_tokens = await complete(session, server.url, prompt="x", max_tokens=5)
        within = await complete(session, server.url, prompt="x" * 7, max_tokens=4)
        # the default of 16 is no request of the caller: it shrinks to the limit
        default = await complete(session, server.url, prompt="x", ignore_eos=True)
    assert long_prompt[0] == 400
    assert long_prompt[1]["error"]["message"] == (
        "prompt has 9 tokens; this server accepts at most 8"
    )
    assert many_tokens[0] == 400
    assert many_tokens[1]["error"]["message"] == ("max_tokens is 5; this server allows at most 4")
    assert within[0] == 200
    assert default[0] == 200 and default[1]["usage"]["completion_tokens"] == 4


async def test_a_small_kv_pool_caps_the_context_so_the_chat_default_fits() -> None:
    """1 MiB holds 256 of tiny's 1024 tokens: the context served is 256, a longer
    request gets a 400 at once, and a chat without max_tokens (what the context
    leaves after the prompt) is served rather than refused."""
    async with serve_in_process(kv_cache_mb=1) as server, aiohttp.ClientSession() as session:
        pool_tokens = server.app[STATE].engine.stats().kv_blocks_total * EngineOptions.block_size
        async with session.get(f"{server.url}/v1/models") as models:
            listed = (await models.json())["data"][0]["max_model_len"]
        status, answer, _ = await complete(
            session, server.url, prompt="x" * pool_tokens, max_tokens=16
        )
        chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        async with session.post(f"{server.url}/v1/chat/completions", json=chat) as response:
            chat_status, chat_answer = response.status, await response.json()
    assert pool_tokens < get_spec("tiny").max_seq_len
    assert listed == pool_tokens
    assert status == 400
    assert answer["error"]["code"] == "context_length_exceeded"
    assert f"maximum context length is {pool_tokens} tokens" in answer["error"]["message"]
    assert chat_status == 200, chat_answer
    assert chat_answer["usage"]["total_tokens"] == pool_tokens


async def test_openapi_document_is_valid_and_covers_every_route() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/openapi.json") as response:
            document = await response.json()
        routes = {
            (route.resource.canonical, route.method.lower())
            for route in server.app.router.routes()
            if route.resource is not None and route.method != "HEAD"
        }
    validate(document)
    documented = {(path, method) for path, ops in document["paths"].items() for method in ops}
    assert documented == routes
    completion_errors = document["paths"]["/v1/completions"]["post"]["responses"]
    assert {"400", "404", "413", "429", "503", "504"} <= set(completion_errors)


async def test_a_dead_engine_fails_liveness_and_readiness_with_the_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fault in the model step kills the engine thread; the probes must say so,
    or Kubernetes would keep a pod that can never answer again."""

    def broken_step(self: ModelRunner, *args: Any) -> None:
        raise RuntimeError("injected fault in the model step")

    monkeypatch.setattr(ModelRunner, "step", broken_step)
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/healthz") as health:
            assert health.status == 200  # nothing has run yet
        status, body, _ = await complete(session, server.url, prompt="hi", max_tokens=4)
        assert status == 503 and body["error"]["code"] == "engine_failed"
        assert "internal error: RuntimeError: injected fault" in body["error"]["message"]
        async with session.get(f"{server.url}/healthz") as health:
            assert health.status == 503
            assert (await health.json()) == {
                "status": "failed",
                "reason": "engine stopped after an internal error: "
                "RuntimeError: injected fault in the model step",
            }
        async with session.get(f"{server.url}/readyz") as ready:
            assert ready.status == 503
            assert "injected fault" in (await ready.json())["reason"]


async def test_probes_and_models() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        async with session.get(f"{server.url}/healthz") as health:
            assert health.status == 200
        async with session.get(f"{server.url}/readyz") as ready:
            assert ready.status == 200 and (await ready.json())["ready"] is True
        async with session.get(f"{server.url}/v1/models") as models:
            listing = await models.json()
    assert [m["id"] for m in listing["data"]] == ["tiny"]
    assert listing["data"][0]["max_model_len"] == server.app[STATE].engine.max_model_len
