"""The int4 projection (linear_kernels.Int4Linear): a GGUF Q4_1 block comes back as its
own codes, scale and minimum, and the 4-bit kernel (few rows) and the bfloat16 copy
(many rows) compute the same product as float32 math over the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from batchpilot_server.engine.linear_kernels import (
    INT4_GROUP,
    INT4_MAX_ROWS,
    Int4Linear,
    int4_fits,
    quantize_int4_groups,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")
OUT, IN = 48, 4 * INT4_GROUP


def q4_1_weights(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights d * q + m per group of 32 as a Q4_1 file holds them (d, m float16;
    codes spanning 0..15 in every group, as llama.cpp's quantizer makes them)."""
    generator = torch.Generator().manual_seed(seed)
    groups = IN // INT4_GROUP
    codes = torch.randint(0, 16, (OUT, groups, INT4_GROUP), generator=generator)
    codes[..., 0], codes[..., 1] = 0, 15
    d = (torch.rand(OUT, groups, generator=generator) * 0.01 + 1e-3).half().float()
    m = (torch.randn(OUT, groups, generator=generator) * 0.05).half().float()
    weight = (codes * d[..., None] + m[..., None]).reshape(OUT, IN)
    return weight, codes.reshape(OUT, IN), d, m


def test_a_q4_1_block_comes_back_as_its_own_codes_scale_and_minimum() -> None:
    weight, codes, d, m = q4_1_weights(0)
    got_codes, scales, minimums = quantize_int4_groups(weight)
    assert torch.equal(got_codes, codes.to(torch.int32))
    torch.testing.assert_close(scales, d, rtol=1e-6, atol=0)
    torch.testing.assert_close(minimums, m, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, INT4_MAX_ROWS, INT4_MAX_ROWS + 1, 40])
@torch.inference_mode()
def test_both_kernels_compute_the_dequantized_product(rows: int) -> None:
    weight, _, _, _ = q4_1_weights(1)
    bias = torch.randn(OUT)
    linear = Int4Linear(weight, bias, INT4_MAX_ROWS)
    x = torch.randn(rows, IN).to(torch.bfloat16)
    expected = x.float() @ weight.T + bias.to(torch.bfloat16).float()
    got = linear(x[None])[0].float()
    # bfloat16 activations, scales and outputs: a few units of bfloat16's 2^-8
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= 0.02 * scale
    assert got.shape == (rows, OUT)


def test_shapes_outside_the_int4_layout_are_not_taken() -> None:
    assert int4_fits(torch.zeros(OUT, IN))
    assert not int4_fits(torch.zeros(OUT, IN + 1))  # not whole groups of inputs
    assert not int4_fits(torch.zeros(OUT + 8, IN))  # outputs not in sixteens
