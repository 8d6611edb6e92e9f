"""The engine's fast kernels (linear_kernels: oneDNN-prepacked weights, int8, int4)
against the plain nn.Linear path, on SmolLM2-135M: float32 gives the same logits within
FAST_TOLERANCE and the same greedy tokens; bfloat16 (FBGEMM's float16-weight kernel for
few rows, oneDNN for many) and int4 (its 4-bit kernel, and its bfloat16 copy for many
rows) stay within the quality bound `--dtype auto` relies on
(weight_quality.BOUND) and int8 within its regression guard (INT8_BOUND) on a short
real text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from batchpilot_server.engine.linear_kernels import (
    FewRowsLinear,
    Int4Linear,
    RowLimits,
    fp16_kernel_fits,
    packed_bfloat16_available,
    swap_linear_kernels,
)
from batchpilot_server.engine.weight_quality import BOUND, INT8_BOUND, compare
from batchpilot_server.engine.weights import LoadedModel, ModelLoadError, load_model, resolve_dtype
from batchpilot_server.engine_api import DTypeName, Quantization
from torch import nn

from tests.support.smollm2 import LOGIT_TOLERANCE, load_float32

# The kernel a bfloat16 projection gets: FBGEMM's few-row one beside oneDNN's packed one
# where the CPU computes bfloat16 (AVX512-BF16, AMX, ...), torch's own matmul elsewhere.
NATIVE_BFLOAT16 = packed_bfloat16_available() and fp16_kernel_fits(torch.zeros(1))
BFLOAT16_KERNEL: type[nn.Module] = FewRowsLinear if NATIVE_BFLOAT16 else nn.Linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = Path(__file__).resolve().parents[2] / "bench" / "data" / "public_domain.txt"
TEXT_TOKENS = 256
GREEDY_TOKENS = 24


@pytest.fixture(scope="module")
def plain(smollm2_dir: Path) -> LoadedModel:
    return load_model(str(smollm2_dir), device="cpu", dtype="float32", kernels="plain")


@pytest.fixture(scope="module")
def text_ids(plain: LoadedModel) -> list[int]:
    tokenizer = plain.tokenizer
    ids = tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False)
    return [tokenizer.bos_id or 0, *ids[: TEXT_TOKENS - 1]]


@torch.inference_mode()
def greedy(loaded: LoadedModel, prompt: list[int], tokens: int) -> list[int]:
    ids = list(prompt)
    for _ in range(tokens):
        ids.append(int(loaded.model.full_logits(ids)[-1].argmax()))
    return ids[len(prompt) :]


@torch.inference_mode()
def test_float32_kernels_match_plain_linear(
    smollm2_dir: Path, plain: LoadedModel, text_ids: list[int]
) -> None:
    fast = load_float32(str(smollm2_dir))  # what the engine loads: the fast kernels
    assert type(fast.model.lm_head) is not type(plain.model.lm_head)  # not the same path
    difference = (fast.model.full_logits(text_ids) - plain.model.full_logits(text_ids)).abs()
    assert difference.max().item() <= LOGIT_TOLERANCE
    prompt = text_ids[:32]
    assert greedy(fast, prompt, GREEDY_TOKENS) == greedy(plain, prompt, GREEDY_TOKENS)


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("bfloat16", "none"), ("bfloat16", "int8"), ("bfloat16", "int4")]
)
@torch.inference_mode()
def test_16_and_8_bit_weights_stay_within_the_quality_bound(
    smollm2_dir: Path,
    plain: LoadedModel,
    text_ids: list[int],
    dtype: DTypeName,
    quantization: Quantization,
) -> None:
    mode = load_model(str(smollm2_dir), device="cpu", dtype=dtype, quantization=quantization)
    reference = torch.log_softmax(plain.model.full_logits(text_ids), -1)[:-1]
    ours = torch.log_softmax(mode.model.full_logits(text_ids).float(), -1)[:-1]
    quality = compare(reference, ours, torch.tensor(text_ids[1:]))
    bound = INT8_BOUND if quantization == "int8" else BOUND
    assert quality.within_bound(bound), f"{dtype}/{quantization}: {quality}"


@pytest.mark.parametrize(
    ("quantization", "limits", "kernel"),
    [
        ("int4", RowLimits(int4=None), Int4Linear),
        pytest.param(
            "none", RowLimits(fp16=None), FewRowsLinear,
            marks=pytest.mark.skipif(not NATIVE_BFLOAT16, reason="the CPU has no native "
                                     "bfloat16: bfloat16 projections keep torch's matmul"),
        ),
    ],
)
@torch.inference_mode()
def test_few_row_kernels_alone_stay_within_the_quality_bound(
    smollm2_dir: Path,
    plain: LoadedModel,
    text_ids: list[int],
    quantization: Quantization,
    limits: RowLimits,
    kernel: type,
) -> None:
    """Every row through the kernel a decode step of a few rows runs (the 4-bit one up
    to INT4_MAX_ROWS rows, FBGEMM's float16-weight one up to FP16_MAX_ROWS); the test
    above measures the many-row prefill's bfloat16 copy."""
    mode = load_model(str(smollm2_dir), device="cpu", dtype="bfloat16", kernels="plain")
    swap_linear_kernels(mode.model, quantization, limits)
    projection = mode.model.layers[0].gate_up_proj
    assert isinstance(projection, kernel)
    assert projection.max_rows > TEXT_TOKENS  # no row count reaches the dense copy
    reference = torch.log_softmax(plain.model.full_logits(text_ids), -1)[:-1]
    ours = torch.log_softmax(mode.model.full_logits(text_ids).float(), -1)[:-1]
    quality = compare(reference, ours, torch.tensor(text_ids[1:]))
    assert quality.within_bound(BOUND), f"{kernel.__name__} alone: {quality}"


def test_bfloat16_loads_few_row_kernels_and_int4_keeps_a_16_bit_head(smollm2_dir: Path) -> None:
    bf16 = load_model(str(smollm2_dir), device="cpu", dtype="bfloat16")
    layer = bf16.model.layers[0]
    for projection in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert type(projection) is BFLOAT16_KERNEL
    assert type(bf16.model.lm_head) is BFLOAT16_KERNEL
    loaded = load_model(str(smollm2_dir), device="cpu", quantization="int4")
    layer = loaded.model.layers[0]
    for projection in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
        assert isinstance(projection, Int4Linear)
    head = loaded.model.lm_head
    assert type(head) is BFLOAT16_KERNEL
    assert (head.dtype if isinstance(head, FewRowsLinear) else head.weight.dtype) == torch.bfloat16


def test_auto_dtype_is_bfloat16_for_checkpoints_only(smollm2_dir: Path) -> None:
    expected = torch.bfloat16 if packed_bfloat16_available() else torch.float32
    assert resolve_dtype("auto", "cpu", source=str(smollm2_dir)) == expected
    assert resolve_dtype("auto", "cpu", source="tiny") == torch.float32
    assert resolve_dtype("float32", "cpu", source=str(smollm2_dir)) == torch.float32


def test_quantization_refusals_say_why() -> None:
    with pytest.raises(ModelLoadError, match="quantization must be one of none, int8, int4"):
        load_model("tiny", device="cpu", quantization="int2")  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError, match="int8 runs on the CPU only"):
        load_model("tiny", device="cuda", quantization="int8")
    with pytest.raises(ModelLoadError, match="int4 runs on the CPU only"):
        load_model("tiny", device="cuda", quantization="int4")
    with pytest.raises(ModelLoadError, match=r"int4 computes in bfloat16.*not float32"):
        load_model("tiny", device="cpu", dtype="float32", quantization="int4")
