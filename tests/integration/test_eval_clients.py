"""Evaluation and load-test clients, unmodified, as their own command lines against a real
server behind an API key: lm-evaluation-harness's `local-completions` log-likelihood path
on SmolLM2-135M (its scores against transformers' own, float32), and an AIPerf profile on
the tiny preset (every request answered, its counts agreeing with the server's metrics).

Both run as subprocesses, exactly as docs/api.md ("Clients tested") shows them.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests
import torch
from batchpilot_server.metric_names import GENERATION_TOKENS_TOTAL, REQUESTS_TOTAL
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support import ROOT
from tests.support.servers import scrape, serve_on_thread
from tests.support.smollm2 import LOGPROB_TOLERANCE

pytestmark = [pytest.mark.timeout(420), pytest.mark.usefixtures("one_torch_thread")]

API_KEY = "eval-clients-key"
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASK = "batchpilot_facts"
CLIENT_DEADLINE_S = 360  # both import a large stack before their first request
BIN = Path(sys.executable).parent


def model_name(url: str) -> str:
    response = requests.get(
        f"{url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30
    )
    assert response.status_code == 200, response.text
    return response.json()["data"][0]["id"]


def run_client(cmd: list[str], *, cwd: Path, env: dict[str, str]) -> None:
    done = subprocess.run(
        cmd, cwd=cwd, env={**os.environ, **env}, capture_output=True, text=True,
        timeout=CLIENT_DEADLINE_S, check=False,
    )  # fmt: skip
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stderr[-4000:]}"


# --- lm-evaluation-harness ----------------------------------------------------------


def task_items() -> list[dict[str, Any]]:
    lines = (TASK_DIR / "facts.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def transformers_loglikelihoods(model_dir: Path, items: list[dict[str, Any]]) -> list[list[float]]:
    """Per item, per choice: log P(" " + choice | question), summed over the choice's
    tokens, from transformers in float32 (the split of tokens as every log-likelihood
    evaluation makes it: the context's tokens, then what the whole adds to them)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    scores = []
    with torch.inference_mode():
        for item in items:
            context = tokenizer(item["question"], add_special_tokens=False).input_ids
            row = []
            for choice in item["choices"]:
                whole = tokenizer(f"{item['question']} {choice}", add_special_tokens=False)
                ids = whole.input_ids
                assert ids[: len(context)] == context, (item, choice)
                logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
                row.append(
                    sum(float(logprobs[i - 1, ids[i]]) for i in range(len(context), len(ids)))
                )
            scores.append(row)
    return scores


def accuracy(scores: list[list[float]], items: list[dict[str, Any]]) -> float:
    right = [row.index(max(row)) == item["answer"] for row, item in zip(scores, items, strict=True)]
    return sum(right) / len(right)


@pytest.fixture(scope="module")
def smollm2_url(smollm2_gguf: Path) -> Iterator[str]:
    with serve_on_thread(
        model=str(smollm2_gguf), kv_cache_mb=32, api_key=API_KEY, dtype="float32"
    ) as url:
        yield url


def test_lm_eval_loglikelihoods_and_accuracy_are_transformers(
    smollm2_url: str, smollm2_dir: Path, tmp_path: Path
) -> None:
    items = task_items()
    reference = transformers_loglikelihoods(smollm2_dir, items)
    # each item's best choice leads by more than the scores may differ: the accuracy is
    # then the same for any scores within the tolerance, and comparing it means something
    for item, row in zip(items, reference, strict=True):
        best, second = sorted(row, reverse=True)[:2]
        assert best - second > 8 * LOGPROB_TOLERANCE, (item, row)
    expected_accuracy = accuracy(reference, items)
    assert 0 < expected_accuracy < 1  # the task has items the model gets wrong

    model_args = ",".join([
        f"model={model_name(smollm2_url)}",
        f"base_url={smollm2_url}/v1/completions",
        f"tokenizer={smollm2_dir}",
        "tokenizer_backend=huggingface",
        "num_concurrent=1",
        "max_retries=1",
    ])  # fmt: skip
    output = tmp_path / "lm_eval"
    run_client(
        [str(BIN / "lm_eval"), "run", "--model", "local-completions", "--model_args", model_args,
         "--tasks", TASK, "--include_path", ".", "--batch_size", "4",
         "--output_path", str(output), "--log_samples"],
        cwd=TASK_DIR,
        env={"OPENAI_API_KEY": API_KEY, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
             "HF_DATASETS_CACHE": str(tmp_path / "datasets")},
    )  # fmt: skip

    (results_file,) = output.glob("*/results_*.json")
    reported = json.loads(results_file.read_text())["results"][TASK]
    (samples_file,) = output.glob(f"*/samples_{TASK}_*.jsonl")
    samples = sorted(
        (json.loads(line) for line in samples_file.read_text().splitlines()),
        key=lambda s: s["doc_id"],
    )
    assert [s["doc"] for s in samples] == items
    for sample, row in zip(samples, reference, strict=True):
        scored = [float(loglikelihood) for loglikelihood, _greedy in sample["filtered_resps"]]
        assert scored == pytest.approx(row, abs=4 * LOGPROB_TOLERANCE), sample["doc"]
    assert reported["acc,none"] == pytest.approx(expected_accuracy, abs=1e-9)


# --- AIPerf -----------------------------------------------------------------------

PROFILE_REQUESTS = 24
PROFILE_TOKENS = 8


def scraped(url: str) -> dict[tuple[str, str], float]:
    async def once() -> dict[tuple[str, str], float]:
        async with aiohttp.ClientSession() as session:
            return await scrape(session, url)

    return asyncio.run(once())


@pytest.fixture(scope="module")
def tiny_url() -> Iterator[str]:
    with serve_on_thread(api_key=API_KEY, max_batch_size=8) as url:
        yield url


def test_aiperf_profile_succeeds_and_counts_what_the_server_counts(
    tiny_url: str, smollm2_dir: Path, tmp_path: Path
) -> None:
    before = scraped(tiny_url)
    output = tmp_path / "aiperf"
    # the tokenizer only shapes the synthetic prompts: the token counts are the
    # server's (`usage`), so they can be compared with its metrics. `ignore_eos`, as
    # benchmark clients send it: AIPerf counts an answer with no text as an error, and
    # the tiny preset's random weights sometimes draw EOS as the first token
    run_client(
        [str(BIN / "aiperf"), "profile", "--model", model_name(tiny_url), "--url", tiny_url,
         "--endpoint-type", "completions", "--streaming", "--api-key", API_KEY,
         "--tokenizer", str(smollm2_dir), "--use-server-token-count",
         "--request-count", str(PROFILE_REQUESTS), "--concurrency", "4",
         "--isl", "16", "--osl", str(PROFILE_TOKENS), "--extra-inputs", '{"ignore_eos": true}',
         "--ui", "none", "--output-artifact-dir", str(output)],
        cwd=tmp_path,
        env={},
    )  # fmt: skip
    after = scraped(tiny_url)

    profile = json.loads((output / "profile_export_aiperf.json").read_text())
    assert profile["error_summary"] == [], profile["error_summary"]
    assert profile["request_count"]["avg"] == PROFILE_REQUESTS
    assert profile["request_throughput"]["unit"] == "requests/sec"
    assert profile["request_throughput"]["avg"] > 0
    served = after[(REQUESTS_TOTAL, "ok")] - before.get((REQUESTS_TOTAL, "ok"), 0.0)
    assert served == PROFILE_REQUESTS
    generated = after[(GENERATION_TOKENS_TOTAL, "")] - before.get((GENERATION_TOKENS_TOTAL, ""), 0)
    assert profile["total_usage_completion_tokens"]["avg"] == generated
    assert generated == PROFILE_REQUESTS * PROFILE_TOKENS  # every answer ran to its length
