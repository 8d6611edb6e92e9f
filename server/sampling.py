"""Next-token choice: greedy at temperature ~0 (below GREEDY_BELOW_TEMPERATURE), else
temperature / top-p sampling with each request's own seeded generator (a seeded
request is reproducible)."""

from __future__ import annotations

import torch
from batchpilot_server.engine_api import GREEDY_BELOW_TEMPERATURE, SamplingParams
from batchpilot_server.sequence import Sequence


def make_generator(params: SamplingParams, device: str) -> torch.Generator | None:
    """A private generator for a sampled request; None for greedy ones."""
    if params.temperature < GREEDY_BELOW_TEMPERATURE:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed)
    return generator


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [len(seqs), vocab] and its log-probability
    under the model's raw distribution (before temperature and top-p)."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.argmax(dim=-1)
    for row, seq in enumerate(seqs):
        if seq.generator is not None:
            chosen[row] = _sample_row(logits[row], seq.params, seq.generator)
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    return chosen.tolist(), picked.tolist()


def _sample_row(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> torch.Tensor:
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p, always the top token: a
        # top_p that float32 rounds to 0 would mask it too, and multinomial over all
        # zeros raises in the engine thread
        outside = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        outside[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(outside, 0.0))
    return torch.multinomial(probs, 1, generator=generator)[0]
