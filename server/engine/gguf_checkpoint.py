"""Reading a GGUF file (llama.cpp's format) as a Hugging Face-style checkpoint.

The metadata becomes a transformers-style config dict, the tensors get
transformers' names and are dequantized with `gguf.quants.dequantize` into
float32 at load; the vocabulary becomes a `TextTokenizer`. llama.cpp's
converter permutes the rows of every Q and K weight of `llama`-architecture
files for its RoPE layout (convert_hf_to_gguf.py, LlamaModel.permute); that is
undone here so the weights match the checkpoint they came from.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from batchpilot_server.engine.models import RopeFrequencyFactors, UnsupportedModelError
from batchpilot_server.tokenizer import GGUFVocabulary, TextTokenizer
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize

# general.architecture -> the transformers class it was converted from (Mistral's
# files say `llama`)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

# llama.cpp tensor names -> transformers' (per layer: blk.N. -> model.layers.N.)
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_REQUIRED = object()  # _get's default: the key must be there
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class GGUFError(ValueError):
    """The file is not a GGUF model this loader can read."""


class GGUFCheckpoint:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.reader = GGUFReader(path)
        except (ValueError, OSError) as exc:
            raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None
        self.arch = self._get("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {self.arch!r} is not supported; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        self.tensors: dict[str, ReaderTensor] = {
            _hf_name(t.name): t for t in self.reader.tensors if _hf_name(t.name)
        }

    def _get(self, key: str, default: Any = _REQUIRED) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is _REQUIRED:
                raise GGUFError(f"{self.path}: metadata key {key!r} is missing")
            return default
        return field.contents()

    def _arch(self, key: str, default: Any = _REQUIRED) -> Any:
        return self._get(f"{self.arch}.{key}", default)

    def config(self) -> dict[str, Any]:
        """The metadata as transformers' config.json keys."""
        scaling = self._arch("rope.scaling.type", "none")
        if scaling not in ("none", "default"):
            raise UnsupportedModelError(
                f"rope scaling {scaling!r} is not supported; supported: default, llama3"
            )
        heads = self._arch("attention.head_count")
        hidden = self._arch("embedding_length")
        return {
            "architectures": [ARCHITECTURES[self.arch]],
            "hidden_size": hidden,
            "intermediate_size": self._arch("feed_forward_length"),
            "num_hidden_layers": self._arch("block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._arch("attention.head_count_kv", heads),
            "head_dim": self._arch("attention.key_length", hidden // heads),
            "max_position_embeddings": self._arch("context_length"),
            "rms_norm_eps": self._arch("attention.layer_norm_rms_epsilon"),
            "rope_theta": self._arch("rope.freq_base", 10000.0),
            "vocab_size": self._arch("vocab_size", None) or len(self._get("tokenizer.ggml.tokens")),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "hidden_act": "silu",
        }

    def rope_frequency_factors(self) -> RopeFrequencyFactors | None:
        """llama.cpp stores Llama 3.1's rope scaling as one divisor per frequency."""
        tensor = next((t for t in self.reader.tensors if t.name == "rope_freqs.weight"), None)
        if tensor is None:
            return None
        return RopeFrequencyFactors(
            tuple(float(f) for f in dequantize(tensor.data, tensor.tensor_type))
        )

    def tensor(self, name: str, num_heads: int, num_kv_heads: int) -> torch.Tensor | None:
        """The float32 tensor called `name` in transformers, or None if the file has none."""
        tensor = self.tensors.get(name)
        if tensor is None:
            return None
        try:
            values = dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise GGUFError(
                f"{self.path}: tensor {tensor.name} has type {tensor.tensor_type.name}, which "
                "gguf cannot dequantize"
            ) from None
        values = values.reshape(tuple(reversed([int(n) for n in tensor.shape])))
        if self.arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = num_heads if name.endswith("q_proj.weight") else num_kv_heads
            values = _unpermute(values, heads)
        # the reader memory-maps the file read-only; torch wants memory it may write
        return torch.from_numpy(np.array(values, dtype=np.float32, copy=True))

    def vocabulary(self) -> GGUFVocabulary:
        model = self._get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported; supported: gpt2 "
                "(byte-level BPE). Serve the model's Hugging Face directory instead"
            )
        return GGUFVocabulary(
            tokens=self._get("tokenizer.ggml.tokens"),
            merges=self._get("tokenizer.ggml.merges"),
            token_types=self._get("tokenizer.ggml.token_type", []),
            pre=self._get("tokenizer.ggml.pre", "default"),
            bos_id=self._get("tokenizer.ggml.bos_token_id", None),
            eos_id=self._get("tokenizer.ggml.eos_token_id", None),
            add_bos=bool(self._get("tokenizer.ggml.add_bos_token", False)),
            chat_template=self._get("tokenizer.chat_template", None),
        )

    def tokenizer(self) -> TextTokenizer:
        return TextTokenizer.from_gguf_vocabulary(self.vocabulary())


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _LAYER_NAMES:
        return None
    return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}.{match[3]}"


def _unpermute(weights: np.ndarray, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's `permute`: it interleaves the two rotary halves of each head."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
