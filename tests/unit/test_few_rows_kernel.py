"""The bfloat16 projection of few-row steps (linear_kernels.FewRowsLinear): up to
FP16_MAX_ROWS rows FBGEMM computes it over the weights held as float16, more rows
oneDNN's packed bfloat16 kernel; both give the product float32 math gives over the
same bfloat16 weights, and weights float16 cannot hold keep the oneDNN kernel alone."""

from __future__ import annotations

import pytest
import torch
from batchpilot_server.engine.linear_kernels import (
    FP16_MAX_ROWS,
    FewRowsLinear,
    PackedLinear,
    fp16_kernel_fits,
    kernel_for,
)
from torch import nn
from torch.profiler import ProfilerActivity, profile

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        not fp16_kernel_fits(torch.zeros(1)) or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        reason="needs torch with FBGEMM and a CPU with bfloat16 dot products",
    ),
]
OUT, IN = 48, 96


def bfloat16_linear(seed: int) -> nn.Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = nn.Linear(IN, OUT, dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(OUT, IN, generator=generator) * 0.05)
        linear.bias.copy_(torch.randn(OUT, generator=generator))
    return linear


@pytest.mark.parametrize("rows", [1, FP16_MAX_ROWS, FP16_MAX_ROWS + 1, 40])
@torch.inference_mode()
def test_either_kernel_computes_the_bfloat16_weights_product(rows: int) -> None:
    linear = bfloat16_linear(rows)
    kernel = kernel_for(linear, "none")
    assert isinstance(kernel, FewRowsLinear)
    x = torch.randn(2, rows, IN).to(torch.bfloat16)  # [batch, tokens, features]
    expected = x.float() @ linear.weight.float().T + linear.bias.float()
    got = kernel(x)
    assert got.dtype == torch.bfloat16 and got.shape == (2, rows, OUT)
    # float32 sums rounded once to bfloat16 (2^-8 relative), by either kernel
    scale = expected.abs().max().item()
    assert (got.float() - expected).abs().max().item() <= 2**-7 * scale


def kernels_run(kernel: nn.Module, rows: int) -> set[str]:
    """The matmul ops one call over `rows` rows runs, as torch's profiler records them."""
    x = torch.randn(rows, IN).to(torch.bfloat16)
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        kernel(x)
    names = {event.key for event in prof.key_averages()}
    return names & {"quantized::linear_dynamic_fp16", "mkldnn::_linear_pointwise"}


def test_few_rows_take_the_float16_kernel_and_many_the_packed_one() -> None:
    kernel = FewRowsLinear(bfloat16_linear(0).weight.detach(), None, FP16_MAX_ROWS)
    for rows in (1, FP16_MAX_ROWS):
        assert kernels_run(kernel, rows) == {"quantized::linear_dynamic_fp16"}
    assert kernels_run(kernel, FP16_MAX_ROWS + 1) == {"mkldnn::_linear_pointwise"}
    always = FewRowsLinear(bfloat16_linear(0).weight.detach(), None, None)
    assert kernels_run(always, 64) == {"quantized::linear_dynamic_fp16"}


def test_weights_float16_cannot_hold_keep_the_packed_kernel() -> None:
    linear = bfloat16_linear(1)
    with torch.no_grad():
        linear.weight[0, 0] = 1e6  # beyond float16's 65504: it would saturate
    assert not fp16_kernel_fits(linear.weight)
    assert isinstance(kernel_for(linear, "none"), PackedLinear)
