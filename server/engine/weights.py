"""One loading path for every model: a preset name, a Hugging Face model directory
or a GGUF file -> a `Decoder` on the device, in the dtype, with its tokenizer.

    loaded = load_model("/models/SmolLM2-135M-Instruct", device="cpu", dtype="auto",
                        seed=0, max_model_len=None)

A model directory holds config.json, model.safetensors (or shards listed in
model.safetensors.index.json), tokenizer.json, tokenizer_config.json (chat
template, special tokens) and optionally generation_config.json (every EOS id).
Each stage logs its duration, so a slow load shows where the time goes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import torch
from batchpilot_server.engine.gguf_checkpoint import GGUFCheckpoint
from batchpilot_server.engine.linear_kernels import packed_bfloat16_available, swap_linear_kernels
from batchpilot_server.engine.models import (
    Decoder,
    Llama3RopeScaling,
    ModelSpec,
    UnsupportedModelError,
    check_architecture,
    get_spec,
    random_decoder,
)
from batchpilot_server.engine_api import DTYPES, QUANTIZATIONS, DTypeName, Quantization
from batchpilot_server.model_presets import PRESET_NAMES
from batchpilot_server.tokenizer import ByteTokenizer, TextTokenizer, Tokenizer
from safetensors import SafetensorError, safe_open

log = logging.getLogger(__name__)

KernelChoice = Literal["fast", "plain"]


class ModelLoadError(ValueError):
    """The model reference or its files cannot be loaded; the message says which and why."""


@dataclass(frozen=True)
class LoadedModel:
    model: Decoder
    tokenizer: Tokenizer
    spec: ModelSpec

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


def load_model(
    source: str,
    *,
    device: str,
    dtype: DTypeName = "auto",
    quantization: Quantization = "none",
    seed: int = 0,
    max_model_len: int | None = None,
    kernels: KernelChoice = "fast",
) -> LoadedModel:
    """`source`: a preset name, a model directory or a .gguf file. `seed` draws a
    preset's random weights; `max_model_len` caps the context (None: the model's).
    `kernels`: "fast" swaps every projection for its fastest kernel (linear_kernels:
    prepacked oneDNN weights on the CPU, or int8); "plain" keeps nn.Linear (the
    reference the fast kernels are tested and benchmarked against; no int8)."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}"
        )
    if quantization != "none" and device != "cpu":
        raise ModelLoadError(
            f"quantization {quantization} runs on the CPU only; use --dtype bfloat16"
        )
    if quantization != "none" and kernels == "plain":
        raise ModelLoadError(f"quantization {quantization} needs its own kernel (kernels='fast')")
    torch_dtype = resolve_dtype(dtype, device, quantization, source)
    loaded = _load(source, device, torch_dtype, seed, max_model_len)
    if kernels == "fast":
        with _stage(f"lay out the projections for their kernels ({quantization})"):
            swap_linear_kernels(loaded.model, quantization)
    return loaded


def _load(
    source: str, device: str, torch_dtype: torch.dtype, seed: int, max_model_len: int | None
) -> LoadedModel:
    path = Path(source)
    if source in PRESET_NAMES:
        spec = _capped(get_spec(source), max_model_len)
        model = random_decoder(spec, seed).to(device=device, dtype=torch_dtype)
        return LoadedModel(model.eval().requires_grad_(False), ByteTokenizer(), spec)
    if path.is_dir():
        return _load_directory(path, device, torch_dtype, max_model_len)
    if path.suffix == ".gguf" and path.is_file():
        return _load_gguf(path, device, torch_dtype, max_model_len)
    raise ModelLoadError(
        f"model {source!r} is neither a preset ({', '.join(PRESET_NAMES)}), a model "
        "directory nor a .gguf file"
    )


def resolve_dtype(
    dtype: str, device: str, quantization: Quantization = "none", source: str | None = None
) -> torch.dtype:
    """`auto`: bfloat16 on a GPU that has it (else float16). On the CPU: bfloat16
    where the CPU has native bfloat16 dot products (AVX512-BF16 or AMX) and the
    weights are a real checkpoint; else float32.

    bfloat16 is the fastest CPU mode within weight_quality.BOUND (docs/benchmarks.md,
    "Quality per weight mode": SmolLM2-135M, mean KL 0.002 nats, 97% top-1 against
    float32) and decodes about 2x faster than float32 at batch 1. A preset's random
    weights have no quality to measure and the tests compare them with float32
    references, so presets stay float32; int8 weights compute in bfloat16 where the
    CPU has it; int4 weights always compute in bfloat16 (torch's 4-bit CPU kernel
    takes nothing else). `--dtype float32` gives the same tokens as transformers'."""
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantization == "int4":
        if dtype not in ("auto", "bfloat16"):
            raise ModelLoadError(
                f"quantization int4 computes in bfloat16 (torch's 4-bit CPU kernel); "
                f"use --dtype auto or bfloat16, not {dtype}"
            )
        return torch.bfloat16
    if dtype != "auto":
        return getattr(torch, dtype)
    if device == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    native_bf16 = packed_bfloat16_available()
    checkpoint = source is not None and source not in PRESET_NAMES
    if native_bf16 and (checkpoint or quantization == "int8"):
        return torch.bfloat16
    return torch.float32


# ---- model directories ------------------------------------------------------


def _load_directory(
    path: Path, device: str, dtype: torch.dtype, max_model_len: int | None
) -> LoadedModel:
    with _stage(f"read {path}/config.json and tokenizer"):
        config = _read_json(path / "config.json")
        spec = _capped(spec_from_config(config, path.name), max_model_len)
        tokenizer = _directory_tokenizer(path)
    stage = _stage(f"load {spec.n_layers}-layer weights from safetensors as {dtype}")
    with stage, SafetensorsFiles(path) as files:
        model = build_decoder(spec, files.get, device, dtype)
    return LoadedModel(model, tokenizer, spec)


def _directory_tokenizer(path: Path) -> TextTokenizer:
    _require(path / "tokenizer.json")
    config_path = path / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.exists() else {}
    generation_path = path / "generation_config.json"
    generation = _read_json(generation_path) if generation_path.exists() else {}
    eos = generation.get("eos_token_id")
    eos_ids = frozenset(eos if isinstance(eos, list) else [] if eos is None else [eos])
    try:
        return TextTokenizer.from_directory(path, config, eos_ids)
    except Exception as exc:  # tokenizers raises bare Exceptions for a bad file
        raise ModelLoadError(f"{path / 'tokenizer.json'}: cannot be read ({exc})") from None


class SafetensorsFiles:
    """The tensors of model.safetensors or of the shards model.safetensors.index.json lists."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelLoadError(f"{index}: no weight_map object")
            self.where = {name: path / file for name, file in weight_map.items()}
        else:
            single = _require(path / "model.safetensors")
            with self._open(single) as file:
                self.where = dict.fromkeys(file.keys(), single)
        self.path = path
        self._open_files: dict[Path, Any] = {}

    def __enter__(self) -> SafetensorsFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        for file in self._open_files.values():
            file.__exit__(None, None, None)
        self._open_files.clear()

    def _open(self, file: Path) -> Any:
        try:
            return safe_open(str(_require(file)), framework="pt")
        except SafetensorError as exc:
            raise ModelLoadError(f"{file}: not a readable safetensors file ({exc})") from None

    def get(self, name: str) -> torch.Tensor | None:
        file = self.where.get(name)
        if file is None:
            return None
        if file not in self._open_files:
            self._open_files[file] = self._open(file).__enter__()
        return self._open_files[file].get_tensor(name)


def spec_from_config(config: dict[str, Any], name: str) -> ModelSpec:
    """A ModelSpec from transformers' config.json keys; refuses what the decoder lacks."""
    architectures = config.get("architectures") or [config.get("model_type", "unknown")]
    architecture = str(architectures[0])
    check_architecture(architecture)

    def need(key: str) -> Any:
        if key not in config:
            raise ModelLoadError(f"config.json of {name} lacks {key!r}")
        return config[key]

    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {config['hidden_act']!r} is not supported")
    if architecture != "Qwen2ForCausalLM" and config.get("attention_bias"):
        raise UnsupportedModelError("attention_bias (biased q/k/v/o projections) is not supported")
    if config.get("mlp_bias"):
        raise UnsupportedModelError("mlp_bias is not supported")
    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    rope = config.get("rope_parameters") or {}
    return ModelSpec(
        name=name,
        architecture=architecture,
        vocab_size=need("vocab_size"),
        d_model=hidden,
        n_layers=need("num_hidden_layers"),
        n_heads=heads,
        n_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads,
        max_seq_len=_context_length(config, architecture, need("max_position_embeddings")),
        d_ff=need("intermediate_size"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=config.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        rope_scaling=rope_scaling_from_config(config.get("rope_scaling") or rope),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=architecture == "Qwen2ForCausalLM",
        qk_norm=architecture == "Qwen3ForCausalLM",
    )


def _context_length(config: dict[str, Any], architecture: str, max_positions: int) -> int:
    """Positions the model attends over in full. A sliding window is full attention
    up to its width, so the context is capped there instead of emulating it."""
    window = config.get("sliding_window")
    uses_window = architecture == "MistralForCausalLM" or config.get("use_sliding_window")
    if uses_window and isinstance(window, int) and window < max_positions:
        log.info("context capped at the sliding window of %d tokens", window)
        return window
    return max_positions


def rope_scaling_from_config(scaling: dict[str, Any]) -> Llama3RopeScaling | None:
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind != "llama3":
        raise UnsupportedModelError(
            f"rope scaling {kind!r} is not supported; supported: default, llama3"
        )
    try:
        return Llama3RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling["low_freq_factor"]),
            high_freq_factor=float(scaling["high_freq_factor"]),
            original_max_position_embeddings=int(scaling["original_max_position_embeddings"]),
        )
    except KeyError as exc:
        raise ModelLoadError(f"llama3 rope scaling lacks {exc.args[0]!r}") from None


# ---- GGUF files -------------------------------------------------------------


def _load_gguf(
    path: Path, device: str, dtype: torch.dtype, max_model_len: int | None
) -> LoadedModel:
    with _stage(f"read {path.name} metadata and vocabulary"):
        checkpoint = GGUFCheckpoint(path)
        spec = spec_from_config(checkpoint.config(), path.stem)
        factors = checkpoint.rope_frequency_factors()
        spec = _capped(replace(spec, rope_scaling=factors) if factors else spec, max_model_len)
        tokenizer = checkpoint.tokenizer()
    with _stage(f"dequantize {len(checkpoint.tensors)} GGUF tensors to {dtype}"):
        model = build_decoder(
            spec,
            lambda name: checkpoint.tensor(name, spec.n_heads, spec.n_kv_heads),
            device,
            dtype,
        )
    return LoadedModel(model, tokenizer, spec)


# ---- shared -----------------------------------------------------------------


def build_decoder(
    spec: ModelSpec,
    tensor: Callable[[str], torch.Tensor | None],
    device: str,
    dtype: torch.dtype,
) -> Decoder:
    """The decoder with the weights `tensor` returns by transformers' names; each
    is moved to the device and dtype as it is read, so the float32 copy of the
    whole model never exists at once."""

    def get(name: str) -> torch.Tensor:
        value = tensor(name)
        if value is None:
            raise ModelLoadError(f"the checkpoint of {spec.name} has no tensor {name!r}")
        return value.to(device=device, dtype=dtype)

    state = {"embed_tokens.weight": get("model.embed_tokens.weight")}
    state["norm.weight"] = get("model.norm.weight")
    tied = spec.tie_word_embeddings
    state["lm_head.weight"] = state["embed_tokens.weight"] if tied else get("lm_head.weight")
    for layer in range(spec.n_layers):
        state.update(_layer_state(spec, layer, get))
    return Decoder.from_state(spec, state, device, dtype)


def _layer_state(
    spec: ModelSpec, layer: int, get: Callable[[str], torch.Tensor]
) -> dict[str, torch.Tensor]:
    hf, ours = f"model.layers.{layer}.", f"layers.{layer}."
    attn = [f"{hf}self_attn.{p}_proj" for p in "qkv"]
    state = {
        f"{ours}input_layernorm.weight": get(f"{hf}input_layernorm.weight"),
        f"{ours}qkv_proj.weight": torch.cat([get(f"{name}.weight") for name in attn]),
        f"{ours}o_proj.weight": get(f"{hf}self_attn.o_proj.weight"),
        f"{ours}post_attention_layernorm.weight": get(f"{hf}post_attention_layernorm.weight"),
        f"{ours}gate_up_proj.weight": torch.cat(
            [get(f"{hf}mlp.gate_proj.weight"), get(f"{hf}mlp.up_proj.weight")]
        ),
        f"{ours}down_proj.weight": get(f"{hf}mlp.down_proj.weight"),
    }
    if spec.attention_bias:
        state[f"{ours}qkv_proj.bias"] = torch.cat([get(f"{name}.bias") for name in attn])
    if spec.qk_norm:
        state[f"{ours}q_norm.weight"] = get(f"{hf}self_attn.q_norm.weight")
        state[f"{ours}k_norm.weight"] = get(f"{hf}self_attn.k_norm.weight")
    return state


def _capped(spec: ModelSpec, max_model_len: int | None) -> ModelSpec:
    if max_model_len is None:
        return spec
    if not 0 < max_model_len <= spec.max_seq_len:
        raise ModelLoadError(
            f"max_model_len {max_model_len} must be between 1 and the model's context "
            f"of {spec.max_seq_len} tokens"
        )
    return replace(spec, max_seq_len=max_model_len)


def _require(path: Path) -> Path:
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing")
    return path


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(_require(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: expected a JSON object")
    return value


@contextmanager
def _stage(what: str) -> Iterator[None]:
    began = time.perf_counter()
    yield
    log.info("%s: %.2fs", what, time.perf_counter() - began)
