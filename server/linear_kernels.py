"""The matmul kernel each projection runs, chosen once at load.

On the CPU, `F.linear` over a plain row-major weight is slow at the batch sizes a
decode step has: float32 goes through MKL's sgemm, whose small-M path on AMD EPYC
costs twice as much at 2-4 rows as at one (the weights are read once either way),
and bfloat16 goes through oneDNN with the weight reordered on every call. oneDNN
with the weight reordered once, at load, into its blocked layout
(`mkldnn._reorder_linear_weight`, what inductor's freezing pass does) reads the
weights at memory speed: a bfloat16 step at 1-4 rows costs the same, and about
half a float32 one (docs/benchmarks.md, "Small batches").

`--quantization int8`: weight-only int8 with one float scale per output channel,
computed by torch's own `_weight_int8pack_mm` (no extra dependency; torchao's
int8 weight-only layout calls the same kernel on the CPU once compiled, and
dequantizes per call without a compiler). Activations stay in the model's
dtype, bfloat16 being the fast one.

CUDA keeps `F.linear` (cuBLAS has no such small-batch gap).
"""

from __future__ import annotations

import torch
from batchpilot_server.engine_api import Quantization
from torch import nn

# the batch size oneDNN lays the float32 weight out for; bfloat16's layout is the
# same for every batch. 32 keeps the 1-4 row steps as fast as a layout for 1 does
# (measured: 1.0x at 1 row, 0.5x the time at 4 rows against a layout for 1)
PACK_FOR_ROWS = 32


def packed_kernels_available(device: torch.device) -> bool:
    """oneDNN's prepacked linear: a CPU build of torch with oneDNN."""
    return device.type == "cpu" and torch.backends.mkldnn.is_available()


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


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: scale = max |w| / 127 (float32 math)."""
    w = weight.float()
    scales = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    qweight = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return qweight.contiguous(), scales


def kernel_for(linear: nn.Linear, quantization: Quantization) -> nn.Module:
    """The module that computes `linear` fastest on its device in its dtype."""
    weight, bias = linear.weight.detach(), linear.bias
    bias = None if bias is None else bias.detach()
    if quantization == "int8":
        return Int8Linear(weight, bias)
    if packed_kernels_available(weight.device) and (
        weight.dtype == torch.float32
        # oneDNN packs bfloat16 only where the CPU computes it (AVX512-BF16, AMX or
        # AVX-NE-CONVERT); elsewhere torch's own bfloat16 matmul runs it
        or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    ):
        return PackedLinear(weight, bias)
    return linear


def swap_linear_kernels(model: nn.Module, quantization: Quantization) -> None:
    """Replace every nn.Linear of `model` (projections and the LM head) in place by
    its kernel module. A tied LM head gets its own packed copy; the embedding keeps
    the plain weight it looks rows up in."""
    for name, child in list(model.named_children()):
        if isinstance(child, nn.Linear):
            setattr(model, name, kernel_for(child, quantization))
        else:
            swap_linear_kernels(child, quantization)
