"""The README's "Calling the server" examples, run as written against a real `tiny` server:
its `curl` block with bash and curl, its Python block with the official `openai` client."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.support import ROOT
from tests.support.servers import ServerProcess, scrape, spawn_server

SECTION = "## Calling the server"
README_URL = "http://localhost:8000"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
RUN_DEADLINE_S = 60


def section_blocks() -> dict[str, str]:
    """The section's code blocks by language (one each)."""
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    blocks = BLOCK.findall(text[start : end if end != -1 else None])
    languages = [language for language, _ in blocks]
    assert sorted(languages) == ["python", "sh"], languages
    return {language: code for language, code in blocks}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with spawn_server(tmp_path=tmp_path_factory.mktemp("readme"), admin_token=None) as process:
        yield process


def on(server: ServerProcess, code: str) -> str:
    assert README_URL in code, f"the examples call {README_URL}"
    return code.replace(README_URL, server.url)


def run(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=RUN_DEADLINE_S)
    assert done.returncode == 0, f"{command[0]} exited {done.returncode}:\n{done.stderr}"
    return done.stdout


def json_documents(text: str) -> list[Any]:
    """Every JSON value printed one after another (curl adds no newline between them)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while at < len(text.rstrip()):
        value, at = decoder.raw_decode(text, at)
        found.append(value)
        while at < len(text) and text[at].isspace():
            at += 1
    return found


async def ok_requests(server: ServerProcess) -> float:
    async with aiohttp.ClientSession() as session:
        return (await scrape(session, server.url))[("batchpilot_requests_total", "ok")]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl not installed")
async def test_the_curl_examples_answer_a_completion_and_a_chat(server: ServerProcess) -> None:
    before = await ok_requests(server)
    script = on(server, section_blocks()["sh"])
    completion, chat = json_documents(run(["bash", "-euo", "pipefail", "-c", script]))
    assert completion["object"] == "text_completion", completion
    assert completion["model"] == "tiny" and 1 <= completion["usage"]["completion_tokens"] <= 16
    assert isinstance(completion["choices"][0]["text"], str)
    assert chat["object"] == "chat.completion", chat
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert await ok_requests(server) == before + 2


async def test_the_openai_example_runs_completions_chat_and_a_stream(
    server: ServerProcess, tmp_path: Path
) -> None:
    before = await ok_requests(server)
    script = tmp_path / "readme_example.py"
    script.write_text(on(server, section_blocks()["python"]))
    out = run([sys.executable, str(script)])
    assert out.endswith("\n") and out.strip(), out
    # completions, chat and the streamed chat: three answered requests
    assert await ok_requests(server) == before + 3
