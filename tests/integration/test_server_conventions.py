"""What gateways and clients expect of an inference server beyond the OpenAI bodies: an
API key, vLLM's metric names, a chat template given at start."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import openai
import pytest
import requests
from batchpilot_server import metric_names as names
from batchpilot_server.serve_options import API_KEY_ENV, UsageError, api_key, parser
from prometheus_client.parser import text_string_to_metric_families

from tests.support.servers import serve_in_process, spawn_server

pytestmark = pytest.mark.timeout(120)

KEY = "sk-test-key-0123456789"
USER = [{"role": "user", "content": "hi"}]


async def test_an_api_key_guards_the_openai_routes_only(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG):
        async with (
            serve_in_process(api_key=KEY) as server,
            aiohttp.ClientSession() as session,
        ):
            right = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
            wrong = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
            try:
                answer = await right.completions.create(model="tiny", prompt="a", max_tokens=2)
                with pytest.raises(openai.AuthenticationError) as refused:
                    await wrong.chat.completions.create(model="tiny", messages=USER)  # type: ignore[arg-type]
            finally:
                await right.close()
                await wrong.close()
            statuses = {}
            for method, path in [
                ("POST", "/v1/completions"),
                ("GET", "/v1/models"),
                ("POST", "/tokenize"),
                ("POST", "/detokenize"),
                ("GET", "/healthz"),
                ("GET", "/readyz"),
                ("GET", "/health"),
                ("GET", "/metrics"),
                ("GET", "/version"),
                ("GET", "/openapi.json"),
                ("GET", "/admin/batching"),
            ]:
                async with session.request(method, server.url + path, json={}) as response:
                    statuses[path] = response.status
                    if response.status == 401:
                        missing = await response.json()
            # the admin API keeps its own token
            admin = {"Authorization": f"Bearer {server.token}"}
            async with session.put(
                f"{server.url}/admin/batching", json={"max_batch_size": 4}, headers=admin
            ) as response:
                admin_status = response.status
    assert answer.usage is not None and answer.usage.completion_tokens >= 1
    assert refused.value.status_code == 401
    assert refused.value.body == {  # OpenAI's error shape
        "message": "the API key is not valid",
        "type": "authentication_error",
        "code": "invalid_api_key",
        "param": None,
    }
    assert missing["error"]["code"] == "missing_api_key"
    keyed = {"/v1/completions", "/v1/models", "/tokenize", "/detokenize"}
    assert {path for path, status in statuses.items() if status == 401} == keyed
    assert all(statuses[path] == 200 for path in statuses if path not in keyed)
    assert admin_status == 200
    assert all(KEY not in record.getMessage() for record in caplog.records)


def test_the_api_key_comes_from_the_flag_the_file_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert api_key(parser().parse_args([])) is None
    assert api_key(parser().parse_args(["--api-key", KEY])) == KEY
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert api_key(parser().parse_args([])) == "from-env"
    assert api_key(parser().parse_args(["--api-key", KEY])) == KEY  # the flag wins
    key_file = tmp_path / "key"
    key_file.write_text(" in-file \n")
    from_file = api_key(parser().parse_args(["--api-key-file", str(key_file)]))
    assert not isinstance(from_file, str) and from_file is not None
    assert from_file.current() == "in-file"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(UsageError, match=r"API key file .* is empty"):
        api_key(parser().parse_args(["--api-key-file", str(empty)]))
    monkeypatch.setenv(API_KEY_ENV, " ")
    with pytest.raises(UsageError, match=f"\\${API_KEY_ENV} is empty"):
        api_key(parser().parse_args([]))


TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}>"


def test_a_served_chat_template_a_key_file_and_metrics_without_vllm_names(
    tmp_path: Path,
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(TEMPLATE)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    args = [
        "--chat-template", str(template), "--api-key-file", str(key_file),
        "--metrics-compat", "none",
    ]  # fmt: skip
    with spawn_server(tmp_path=tmp_path, extra_args=args) as server:
        headers = {"Authorization": f"Bearer {KEY}"}
        tokenized = requests.post(
            f"{server.url}/tokenize", json={"messages": USER}, headers=headers, timeout=30
        ).json()
        text = requests.post(
            f"{server.url}/detokenize", json={"tokens": tokenized["tokens"]}, headers=headers,
            timeout=30,
        ).json()["prompt"]  # fmt: skip
        unkeyed = requests.post(f"{server.url}/tokenize", json={"prompt": "a"}, timeout=30)
        metrics = requests.get(f"{server.url}/metrics", timeout=30).text
        stderr = server.stderr_tail(400)
    assert text == "[user] hi\n>"
    assert unkeyed.status_code == 401
    assert "vllm:" not in metrics and names.REQUESTS_RUNNING in metrics
    assert KEY not in stderr


def test_a_chat_template_that_does_not_compile_stops_the_start(tmp_path: Path) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}")
    with spawn_server(
        tmp_path=tmp_path, extra_args=["--chat-template", str(template)], wait=False
    ) as server:
        code = server.proc.wait(60)
    assert code == 2
    assert "--chat-template" in server.stderr_tail() and "not a valid jinja2" in (
        server.stderr_tail()
    )


VLLM_TWINS = {
    "vllm:num_requests_running": names.REQUESTS_RUNNING,
    "vllm:num_requests_waiting": names.REQUESTS_WAITING,
    "vllm:kv_cache_usage_perc": names.KV_CACHE_USAGE,
    "vllm:time_to_first_token_seconds_count": f"{names.TIME_TO_FIRST_TOKEN}_count",
    "vllm:inter_token_latency_seconds_count": f"{names.INTER_TOKEN_LATENCY}_count",
    "vllm:e2e_request_latency_seconds_count": f"{names.REQUEST_DURATION}_count",
    "vllm:request_queue_time_seconds_count": f"{names.QUEUE_WAIT}_count",
    "vllm:prompt_tokens_total": names.PROMPT_TOKENS_TOTAL,
    "vllm:generation_tokens_total": names.GENERATION_TOKENS_TOTAL,
}


async def test_vllm_metric_names_read_the_same_quantities() -> None:
    async with serve_in_process() as server, aiohttp.ClientSession() as session:
        for prompt in ("a", "bb", "ccc"):
            body = {"prompt": prompt, "max_tokens": 3, "ignore_eos": True}
            async with session.post(f"{server.url}/v1/completions", json=body) as response:
                assert response.status == 200
        async with session.get(f"{server.url}/metrics") as response:
            text = await response.text()
    samples = {}
    labels = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if "le" not in sample.labels:
                samples[sample.name] = sample.value
                labels[sample.name] = sample.labels
    for theirs, ours in VLLM_TWINS.items():
        assert samples[theirs] == samples[ours], theirs
        assert labels[theirs] == {"model_name": "tiny"}, theirs
    assert samples["vllm:generation_tokens_total"] == 9
    assert samples["vllm:time_to_first_token_seconds_count"] == 3
    info = labels["vllm:cache_config_info"]
    assert samples["vllm:cache_config_info"] == 1
    assert info["model_name"] == "tiny" and info["block_size"] == "16"
    assert int(info["num_gpu_blocks"]) > 0
