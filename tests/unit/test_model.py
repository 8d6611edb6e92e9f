"""The decoder and its paged forwards, below the engine: the tiny preset, and each
supported architecture against transformers with random weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from batchpilot_server.engine.models import (
    PRESETS,
    RMSNorm,
    apply_rope,
    apply_rope_,
    build_model,
    get_spec,
    resolve_device,
)
from batchpilot_server.engine.weights import load_model, spec_from_config
from tokenizers import Tokenizer as Pipeline
from tokenizers.models import WordLevel

from tests.support.engine_helpers import ATTENTIONS, paged_against_full_recompute

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_presets_and_their_errors() -> None:
    spec = get_spec("tiny")
    shape = (spec.d_model, spec.n_layers, spec.n_heads, spec.n_kv_heads, spec.head_dim)
    assert shape == (256, 4, 4, 2, 64) and spec.architecture == "LlamaForCausalLM"
    with pytest.raises(ValueError, match="unknown model 'huge'; known: tiny"):
        get_spec("huge")
    with pytest.raises(ValueError, match="auto, cpu or cuda"):
        resolve_device("tpu")
    assert resolve_device("auto") in ("cpu", "cuda") and set(PRESETS) >= {"tiny"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fewer_op_layer_math_is_transformers_arithmetic_bit_for_bit(dtype: torch.dtype) -> None:
    """In-place RoPE over a view of the fused q/k/v buffer and RMSNorm through
    F.rms_norm round exactly as transformers' out-of-place formulas do."""
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(3, 2, 15, 64, generator=generator).to(dtype)
    cos, sin = (torch.randn(3, 2, 1, 64, generator=generator).to(dtype) for _ in range(2))
    expected = apply_rope(qkv[:, :, :12], cos, sin)
    untouched = qkv[:, :, 12:].clone()
    apply_rope_(qkv[:, :, :12], cos, sin)
    assert torch.equal(qkv[:, :, :12], expected)
    assert torch.equal(qkv[:, :, 12:], untouched), "RoPE wrote past q and k into v"

    norm = RMSNorm(64, 1e-5)
    norm.weight.data = torch.randn(64, generator=generator).to(dtype)
    h = qkv.float()
    reference = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    assert torch.equal(norm(qkv), reference)


def test_weights_come_from_the_seed() -> None:
    ids = [256, 1, 2, 3]
    same = build_model("tiny", "cpu", seed=0).full_logits(ids)
    assert torch.equal(build_model("tiny", "cpu", seed=0).full_logits(ids), same)
    assert not torch.allclose(build_model("tiny", "cpu", seed=1).full_logits(ids), same)


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_paged_forwards_match_full_recompute_with_scattered_blocks(attention: str) -> None:
    """A ragged batch whose blocks are interleaved in the pool (as after churn),
    through the C kernel and through the torch fallback."""
    prompts = [[256, *range(1, 3 + 11 * n)] for n in range(4)]
    worst = paged_against_full_recompute(build_model("tiny", "cpu"), attention, prompts, 30)
    assert worst <= 1e-4


# Small random configs of each architecture, with what sets it apart: llama3 rope
# scaling, untied embeddings; Qwen2's q/k/v bias; Qwen3's q/k norm with a head_dim
# other than hidden_size / heads. Mistral's sliding window is off (a window caps
# the context instead: test_sliding_window_caps_the_context).
SMALL = {
    "vocab_size": 64,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
ARCHITECTURES = {
    "llama3": ("LlamaConfig", {"rope_scaling": LLAMA3_ROPE, "rope_theta": 500000.0}),
    "mistral": ("MistralConfig", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", {"head_dim": 32}),
}


@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_each_architecture_matches_transformers(architecture: str, tmp_path: Path) -> None:
    """Same logits as transformers' own model from the same checkpoint directory
    (measured: bit for bit in float32). Qwen3's is written in shards."""
    config_class, extra = ARCHITECTURES[architecture]
    config = getattr(transformers, config_class)(**SMALL, **extra)
    reference = _random_reference(config)
    shard = "20KB" if architecture == "qwen3" else "1GB"
    reference.save_pretrained(tmp_path, max_shard_size=shard)
    assert (tmp_path / "model.safetensors.index.json").exists() == (architecture == "qwen3")
    Pipeline(WordLevel({"a": 0}, unk_token="a")).save(str(tmp_path / "tokenizer.json"))
    loaded = load_model(str(tmp_path), device="cpu", dtype="float32")
    ids = torch.randint(0, SMALL["vocab_size"], (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ours = loaded.model.full_logits(ids[0].tolist())
        theirs = reference(ids).logits[0]
    assert loaded.spec.architecture == config.architectures[0]
    assert float((ours - theirs).abs().max()) <= 1e-5


def _random_reference(config: transformers.PretrainedConfig) -> torch.nn.Module:
    """transformers' model with random weights, norms and biases included (their
    defaults, ones and zeros, would hide a norm or bias left out)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    param.normal_(1.0 if "norm" in name else 0.0, 0.1)
    config.architectures = [type(model).__name__]
    return model


def test_sliding_window_caps_the_context() -> None:
    config = {**SMALL, "architectures": ["MistralForCausalLM"], "sliding_window": 32}
    assert spec_from_config(config, "m").max_seq_len == 32
    assert spec_from_config({**config, "sliding_window": None}, "m").max_seq_len == 128
