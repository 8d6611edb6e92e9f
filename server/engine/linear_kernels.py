"""The matmul kernel each projection runs, chosen once at load.

On the CPU, `F.linear` over a plain row-major weight is slow at the batch sizes a
decode step has: float32 goes through MKL's sgemm, whose small-M path on AMD EPYC
costs twice as much at 2-4 rows as at one (the weights are read once either way),
and bfloat16 goes through oneDNN with the weight reordered on every call. oneDNN
with the weight reordered once, at load, into its blocked layout
(`mkldnn._reorder_linear_weight`, what inductor's freezing pass does) reads the
weights at memory speed: a bfloat16 step at 1-4 rows costs the same, and about
half a float32 one (docs/benchmarks.md, "Small batches").

bfloat16 steps of at most FP16_MAX_ROWS rows (a decode step of a few sequences) run
FBGEMM's GEMM over the same weights held as float16 (`quantized.linear_dynamic_fp16`,
float32 activations): at 1-2 rows oneDNN's bfloat16 kernel reads the weights at about
half the memory's speed and FBGEMM's at all of it; from about 5 rows oneDNN is faster.
A bfloat16 weight is exactly a float16 one (float16 has the longer mantissa) unless it
lies outside float16's range, which an LLM's weights do not; such a weight keeps the
oneDNN path alone. The price is a second copy of the weights in memory.

`--quantization int8`: weight-only int8 with one float scale per output channel,
computed by torch's own `_weight_int8pack_mm` (no extra dependency; torchao's
int8 weight-only layout calls the same kernel on the CPU once compiled, and
dequantizes per call without a compiler). Activations stay in the model's
dtype, bfloat16 being the fast one.

`--quantization int4`: weight-only 4-bit codes with a scale and a minimum per 32
inputs (llama.cpp's Q4_1 block, so a Q4_1 GGUF's weights are held exactly), computed
by torch's own `_weight_int4pack_mm_for_cpu` over bfloat16 activations for the small
row counts of a decode step, where a step is bound by reading the weights; from
INT4_MAX_ROWS rows up the same weights, dequantized once to bfloat16, run oneDNN's
packed kernel (the 4-bit kernel does not block over rows and falls behind there).

CUDA keeps `F.linear` (cuBLAS has no such small-batch gap).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from batchpilot_server.engine_api import Quantization
from torch import nn

# the batch size oneDNN lays the float32 weight out for; bfloat16's layout is the
# same for every batch. 32 keeps the 1-4 row steps as fast as a layout for 1 does
# (measured: 1.0x at 1 row, 0.5x the time at 4 rows against a layout for 1)
PACK_FOR_ROWS = 32
# llama.cpp's Q4_0/Q4_1 block: a scale and a minimum per 32 consecutive inputs
INT4_GROUP = 32
# the most rows the 4-bit kernel computes: 30 SmolLM2-135M layers' projections, 2
# threads, ms per step (4-bit against packed bfloat16): 4.8/12.3 at 1 row, 7.6/12.1
# at 4, 14.5/15.5 at 8, 25.4/16.6 at 16, 50.6/24.9 at 32
INT4_MAX_ROWS = 8
# the most rows FBGEMM's float16-weight kernel computes: one decode step of SmolLM2-135M
# bfloat16, 1 thread, ms (FBGEMM up to this many rows against oneDNN alone): 22.4/31.7 at
# 1 row, 28.9/44.5 at 2, 33.1/42.0 at 3, 27.4/31.3 at 4, 39.4/29.4 at 6
FP16_MAX_ROWS = 4
# float16's largest finite value: a weight beyond it would saturate
FP16_MAX = 65504.0


@dataclass(frozen=True)
class RowLimits:
    """The most rows each few-row kernel computes before its dense copy takes over
    (None: that kernel for every row count)."""

    int4: int | None = INT4_MAX_ROWS
    fp16: int | None = FP16_MAX_ROWS


ROW_LIMITS = RowLimits()


def packed_kernels_available(device: torch.device) -> bool:
    """oneDNN's prepacked linear: a CPU build of torch with oneDNN."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


def packed_bfloat16_available() -> bool:
    """oneDNN packs bfloat16 only where the CPU computes it (AVX512-BF16, AMX, or
    AVX512BW/VL/DQ or AVX-NE-CONVERT); elsewhere `mkldnn._reorder_linear_weight` raises."""
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def dense_bfloat16(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    """A bfloat16 projection for every row count: oneDNN's packed kernel where the CPU
    has it, else torch's own bfloat16 matmul over the plain weight."""
    if packed_kernels_available(weight.device) and packed_bfloat16_available():
        return PackedLinear(weight, bias)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None,
                       device=weight.device, dtype=weight.dtype)  # fmt: skip
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


def fp16_kernel_fits(weight: torch.Tensor) -> bool:
    """FBGEMM's float16-weight GEMM: a build of torch with FBGEMM (x86), and weights
    float16 holds."""
    return "fbgemm" in torch.backends.quantized.supported_engines and bool(
        weight.abs().max() <= FP16_MAX
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W in oneDNN's blocked layout (CPU, float32 or bfloat16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.dtype = weight.dtype
        # plain attributes, not buffers: the opaque oneDNN tensor cannot be moved or
        # cast, and the module is built on its final device and dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_FOR_ROWS)
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class FewRowsLinear(nn.Module):
    """bfloat16 y = x W^T + b: up to `max_rows` rows through FBGEMM over W as float16
    (float32 math, the result rounded to bfloat16), more through oneDNN's packed
    bfloat16 kernel (None: FBGEMM for every row count; the quality tests measure it
    alone that way)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None
    ) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.dtype = weight.dtype
        self.dense = PackedLinear(weight, bias)
        self.half = torch.ops.quantized.linear_prepack_fp16(
            weight.float(), None if bias is None else bias.float()
        )
        self.max_rows = sys.maxsize if max_rows is None else max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self.max_rows * x.shape[-1]:
            return self.dense(x)
        return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.half).to(x.dtype)


class Int8Linear(nn.Module):
    """y = (x Q^T) * scale + b: Q int8 [out, in], one scale per output row."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.dtype = weight.dtype
        qweight, scales = quantize_per_channel(weight)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scales", scales.to(weight.dtype))
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch._weight_int8pack_mm(flat, self.qweight, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """y = x W^T + b, W as 4-bit codes q with w = (q - 8) * scale + zero per group of
    INT4_GROUP inputs (torch's int4 CPU layout), bfloat16 activations. Above
    `max_rows` rows the bfloat16 copy of the same weights runs (None: never; the
    quality benchmark measures the 4-bit kernel alone that way)."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, max_rows: int | None
    ) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        self.dtype = torch.bfloat16
        codes, scales, minimums = quantize_int4_groups(weight)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
        # the kernel adds `zero` to (q - 8) * scale; the groups' minimum is q = 0
        zeros = minimums + 8 * scales
        pairs = torch.stack((scales, zeros), -1).transpose(0, 1)  # [groups, out, 2]
        self.scales_and_zeros = pairs.to(torch.bfloat16).contiguous()
        self.bias = None if bias is None else bias.to(torch.bfloat16)
        self.max_rows = sys.maxsize if max_rows is None else max_rows
        self.dense: nn.Module | None = None
        if max_rows is not None:
            dequantized = codes.view(*scales.shape, INT4_GROUP) * scales[..., None]
            dequantized = (dequantized + minimums[..., None]).view_as(weight)
            self.dense = dense_bfloat16(dequantized.to(torch.bfloat16), self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.dense is not None and len(flat) > self.max_rows:
            return self.dense(x)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, INT4_GROUP, self.scales_and_zeros
        )
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)


def int4_fits(weight: torch.Tensor) -> bool:
    """The int4 layout's shapes: whole groups of inputs, outputs in sixteens."""
    return weight.shape[1] % INT4_GROUP == 0 and weight.shape[0] % 16 == 0


def quantize_int4_groups(
    weight: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit codes per INT4_GROUP inputs, as llama.cpp's Q4_1 does: scale =
    (max - min) / 15, code = round((w - min) / scale), float32 math. Codes [out, in]
    int32 in 0..15; scales and minimums [out, in / INT4_GROUP]. A Q4_1 block (32
    weights d * q + m whose codes span 0..15) comes back as its own d, m and q."""
    groups = weight.float().reshape(weight.shape[0], -1, INT4_GROUP)
    minimums, maximums = groups.amin(-1), groups.amax(-1)
    scales = (maximums - minimums) / 15
    steps = scales.clamp(min=1e-30)[..., None]
    codes = torch.round((groups - minimums[..., None]) / steps).clamp(0, 15)
    return codes.to(torch.int32).reshape(weight.shape), scales, minimums


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: scale = max |w| / 127 (float32 math)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight.contiguous(), scales


def kernel_for(
    linear: nn.Linear, quantization: Quantization, max_rows: RowLimits = ROW_LIMITS
) -> nn.Module:
    """The module that computes `linear` fastest on its device in its dtype."""
    weight, bias = linear.weight.detach(), linear.bias
    bias = None if bias is None else bias.detach()
    if quantization == "int4" and int4_fits(weight):
        return Int4Linear(weight, bias, max_rows.int4)
    if quantization == "int8":
        return Int8Linear(weight, bias)
    if not packed_kernels_available(weight.device):
        return linear
    if weight.dtype == torch.float32:
        return PackedLinear(weight, bias)
    # elsewhere torch's own bfloat16 matmul runs it
    if weight.dtype == torch.bfloat16 and packed_bfloat16_available():
        if fp16_kernel_fits(weight):
            return FewRowsLinear(weight, bias, max_rows.fp16)
        return PackedLinear(weight, bias)
    return linear


def swap_linear_kernels(
    model: nn.Module, quantization: Quantization, max_rows: RowLimits = ROW_LIMITS
) -> None:
    """Replace every nn.Linear of `model` (projections and the LM head) in place by
    its kernel module. A tied LM head gets its own packed copy; the embedding keeps
    the plain weight it looks rows up in. int4 leaves the LM head in bfloat16: GGUF's
    Q4 files keep the output matrix at 8 bits or more (the wheel's Q4_1 file holds it
    as Q8_0), and 4-bit codes of it would be a second, coarser quantization."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            mode = "none" if quantization == "int4" and name == "lm_head" else quantization
            setattr(model, name, kernel_for(child, mode, max_rows))
        else:
            swap_linear_kernels(child, quantization, max_rows)
