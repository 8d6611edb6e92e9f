"""The Llama-family decoder the engine runs, its specs and the `tiny` preset.

One module covers Llama (2, 3, 3.x, SmolLM, TinyLlama), Mistral, Qwen2 (q/k/v
bias) and Qwen3 (per-head q/k RMSNorm): RMSNorm, RoPE (default or `llama3`
scaling), grouped-query attention, SwiGLU, optionally tied embeddings. The
arithmetic follows transformers' modeling_llama / qwen2 / qwen3 op for op, so
float32 logits agree with it to rounding.

The decoder does not own a KV cache: each layer applies RoPE (and Qwen3's q/k
norm) and then asks an `Attention` strategy (full causal, paged prefill, paged
decode) to mix q/k/v, so one set of weights serves the reference recompute,
the engine and the benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from batchpilot_server.tokenizer import ByteTokenizer
from torch import nn

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class UnsupportedModelError(ValueError):
    """The checkpoint describes a model this decoder cannot run."""


def check_architecture(architecture: str) -> None:
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"architecture {architecture!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )


@dataclass(frozen=True)
class Llama3RopeScaling:
    """transformers' `rope_type: llama3` (Llama 3.1+): long wavelengths stretched by `factor`."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class RopeFrequencyFactors:
    """llama.cpp's form of the same scaling: a divisor per frequency (GGUF `rope_freqs`)."""

    factors: tuple[float, ...]


RopeScaling = Llama3RopeScaling | RopeFrequencyFactors
Device = torch.device | str | None


@dataclass(frozen=True)
class ModelSpec:
    name: str
    architecture: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_seq_len: int
    d_ff: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (Qwen3)

    def __post_init__(self) -> None:
        check_architecture(self.architecture)
        if self.n_heads % self.n_kv_heads:
            raise UnsupportedModelError(
                f"{self.n_heads} attention heads do not split into groups over "
                f"{self.n_kv_heads} key/value heads"
            )


PRESETS: dict[str, ModelSpec] = {
    # random weights: for tests and the demo; two query heads per KV head so every
    # attention path is exercised with grouped-query attention
    "tiny": ModelSpec(
        name="tiny",
        architecture="LlamaForCausalLM",
        vocab_size=ByteTokenizer.vocab_size,
        d_model=256,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        max_seq_len=1024,
        d_ff=1024,
    ),
}


def get_spec(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(PRESETS))}") from None


def resolve_device(device: str) -> str:
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda requested but torch sees no CUDA device")
    return device


class Attention(Protocol):
    """Mixes one layer's q [batch, tokens, n_heads, head_dim] with k, v [batch, tokens,
    n_kv_heads, head_dim] into [batch, tokens, n_heads, head_dim], in q's dtype.

    Query head h reads KV head h // (n_heads // n_kv_heads), as in transformers."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class CausalAttention:
    """Plain causal self-attention over the given tokens only (no cache)."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            is_causal=True,
            enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device: Device = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # in float32 whatever the weights' dtype, as transformers does; F.rms_norm is
        # the same arithmetic (x * rsqrt(mean(x^2) + eps), bit for bit on the CPU) in one
        # call instead of five: per-op dispatch is most of a batch-1 step's overhead
        h = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * h.to(x.dtype)


def inverse_frequencies(spec: ModelSpec) -> torch.Tensor:
    """RoPE's inverse frequencies [head_dim / 2], float32, as transformers computes them."""
    dim = spec.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (spec.rope_theta**steps)
    scaling = spec.rope_scaling
    if isinstance(scaling, RopeFrequencyFactors):
        return inv_freq / torch.tensor(scaling.factors, dtype=torch.float32)
    if isinstance(scaling, Llama3RopeScaling):
        return _llama3_scaled(inv_freq, scaling)
    return inv_freq


def _llama3_scaled(inv_freq: torch.Tensor, scaling: Llama3RopeScaling) -> torch.Tensor:
    old_context = scaling.original_max_position_embeddings
    low_freq_wavelen = old_context / scaling.low_freq_factor
    high_freq_wavelen = old_context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_context / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_tables(spec: ModelSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [max_seq_len, head_dim] for every position, float32.

    Computed from float positions times the inverse frequencies exactly as
    transformers does per step, so a table lookup gives the same values."""
    positions = torch.arange(spec.max_seq_len, dtype=torch.int64).float()
    freqs = positions[:, None] * inverse_frequencies(spec)[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [batch, tokens, heads, head_dim]; cos, sin [batch, tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos) + (rotated * sin)


def apply_rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` written into `x` (a view): the same products and sum, rounded the
    same way, without a new tensor for the result."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1).mul_(sin)
    return x.mul_(cos).add_(rotated)


class DecoderLayer(nn.Module):
    """Pre-norm attention and SwiGLU MLP. q/k/v and gate/up are each one fused
    projection: one matmul instead of three (or two) per layer and token."""

    def __init__(self, spec: ModelSpec, device: Device = None) -> None:
        super().__init__()
        self.spec = spec
        d, hd, eps = spec.d_model, spec.head_dim, spec.rms_norm_eps
        self.split = (spec.n_heads, spec.n_kv_heads, spec.n_kv_heads)
        self.input_layernorm = RMSNorm(d, eps, device)
        self.qkv_proj = nn.Linear(d, sum(self.split) * hd, bias=spec.attention_bias, device=device)
        self.q_norm = RMSNorm(hd, eps, device) if spec.qk_norm else None
        self.k_norm = RMSNorm(hd, eps, device) if spec.qk_norm else None
        self.o_proj = nn.Linear(spec.n_heads * hd, d, bias=False, device=device)
        self.post_attention_layernorm = RMSNorm(d, eps, device)
        self.gate_up_proj = nn.Linear(d, 2 * spec.d_ff, bias=False, device=device)
        self.down_proj = nn.Linear(spec.d_ff, d, bias=False, device=device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer: int,
        attention: Attention,
    ) -> torch.Tensor:
        batch, tokens, _ = x.shape
        qkv = self.qkv_proj(self.input_layernorm(x)).view(batch, tokens, -1, self.spec.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, v = qkv.split(self.split, dim=2)
            q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        else:
            # q and k are neighbours in the fused projection: RoPE over both at once, in
            # place, so q, k and v stay views of one buffer (half the RoPE ops, and the
            # attention kernel reads k and v at one stride without copying them)
            heads, kv_heads, _ = self.split
            apply_rope_(qkv[:, :, : heads + kv_heads], cos, sin)
            q, k, v = qkv.split(self.split, dim=2)
        mixed = attention(layer, q, k, v).reshape(batch, tokens, -1)
        x = x + self.o_proj(mixed)
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)
        return x + self.down_proj(F.silu(gate) * up)


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec, device: Device = None) -> None:
        """`device` "meta": the shapes only, no memory and no random init."""
        super().__init__()
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.d_model, device=device)
        self.layers = nn.ModuleList(DecoderLayer(spec, device) for _ in range(spec.n_layers))
        self.norm = RMSNorm(spec.d_model, spec.rms_norm_eps, device)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False, device=device)
        self.tie_weights()
        cos, sin = (table.to(device) for table in rope_tables(spec))
        # buffers: they follow the model's device and dtype (transformers casts
        # cos/sin to the activations' dtype too)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @classmethod
    def from_state(
        cls, spec: ModelSpec, state: dict[str, torch.Tensor], device: str, dtype: torch.dtype
    ) -> Decoder:
        """A decoder around the given weights (this class's parameter names), built
        without first drawing random weights of its own."""
        # the device argument, not a `with torch.device("meta")` block: that one
        # routes every op through a torch-function mode and takes seconds
        model = cls(spec, device="meta")
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise ValueError(f"weights do not fit {spec.name}: {exc}") from None
        model.tie_weights()
        cos, sin = rope_tables(spec)
        model.rope_cos = cos.to(device=device, dtype=dtype)
        model.rope_sin = sin.to(device=device, dtype=dtype)
        return model.eval().requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (int8 weights compute in it too)."""
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def hidden(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """Final hidden states [batch, tokens, d_model] of `token_ids` [batch, tokens]."""
        x = self.embed_tokens(token_ids)
        cos, sin = self.rope_cos[positions][:, :, None], self.rope_sin[positions][:, :, None]
        for layer, block in enumerate(self.layers):
            x = block(x, cos, sin, layer, attention)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 whatever the weights' dtype: sampling and logprobs read them."""
        return self.lm_head(hidden).float()

    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Reference: logits [tokens, vocab] of one sequence recomputed from scratch."""
        device = self.device
        ids = torch.tensor([token_ids], device=device)
        positions = torch.arange(len(token_ids), device=device)[None]
        return self.logits(self.hidden(ids, positions, CausalAttention()))[0]


def random_decoder(spec: ModelSpec, seed: int) -> Decoder:
    """`spec` with torch's default random init drawn from `seed` on the CPU, so the
    weights are the same on every device."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Decoder(spec)


def build_model(name: str, device: str, seed: int = 0) -> Decoder:
    """The preset's decoder with random weights drawn from `seed` (same on every device)."""
    return random_decoder(get_spec(name), seed).to(device).eval().requires_grad_(False)
