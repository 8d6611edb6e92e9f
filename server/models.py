"""Model presets and the GPT-style decoder the engine runs.

The decoder does not own a KV cache: each attention layer asks an `Attention`
strategy (full causal, paged prefill, paged decode) to mix q/k/v, so one set
of weights serves the reference recompute, the engine and the benchmarks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from batchpilot_server.tokenizer import ByteTokenizer
from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    name: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    max_seq_len: int
    d_ff: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


PRESETS: dict[str, ModelSpec] = {
    "tiny": ModelSpec(
        name="tiny",
        vocab_size=ByteTokenizer.vocab_size,
        d_model=256,
        n_layers=4,
        n_heads=4,
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
    """Mixes one layer's q, k, v ([batch, tokens, heads, head_dim]) into its output."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class CausalAttention:
    """Plain causal self-attention over the given tokens only (no cache)."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return out.transpose(1, 2)


class DecoderBlock(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.n_heads = spec.n_heads
        self.ln1 = nn.LayerNorm(spec.d_model)
        self.qkv = nn.Linear(spec.d_model, 3 * spec.d_model)
        self.proj = nn.Linear(spec.d_model, spec.d_model)
        self.ln2 = nn.LayerNorm(spec.d_model)
        self.fc1 = nn.Linear(spec.d_model, spec.d_ff)
        self.fc2 = nn.Linear(spec.d_ff, spec.d_model)

    def forward(self, x: torch.Tensor, layer: int, attention: Attention) -> torch.Tensor:
        batch, tokens, d_model = x.shape
        qkv = self.qkv(self.ln1(x)).view(batch, tokens, 3, self.n_heads, -1)
        q, k, v = qkv.unbind(2)
        mixed = attention(layer, q, k, v).reshape(batch, tokens, d_model)
        x = x + self.proj(mixed)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class Decoder(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok_emb = nn.Embedding(spec.vocab_size, spec.d_model)
        self.pos_emb = nn.Embedding(spec.max_seq_len, spec.d_model)
        self.blocks = nn.ModuleList(DecoderBlock(spec) for _ in range(spec.n_layers))
        self.ln_f = nn.LayerNorm(spec.d_model)
        self.lm_head = nn.Linear(spec.d_model, spec.vocab_size, bias=False)

    def hidden(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        """Final hidden states [batch, tokens, d_model] of `token_ids` [batch, tokens]."""
        x = self.tok_emb(token_ids) + self.pos_emb(positions)
        for layer, block in enumerate(self.blocks):
            x = block(x, layer, attention)
        return self.ln_f(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def full_logits(self, token_ids: list[int]) -> torch.Tensor:
        """Reference: logits [tokens, vocab] of one sequence recomputed from scratch."""
        device = self.lm_head.weight.device
        ids = torch.tensor([token_ids], device=device)
        positions = torch.arange(len(token_ids), device=device)[None]
        return self.logits(self.hidden(ids, positions, CausalAttention()))[0]


def build_model(name: str, device: str, seed: int = 0) -> Decoder:
    """The preset's decoder with random weights drawn from `seed` (same on every device)."""
    spec = get_spec(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Decoder(spec)
    return model.to(device).eval().requires_grad_(False)
