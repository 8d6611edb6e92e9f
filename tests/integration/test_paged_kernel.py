"""The native paged-attention kernel: built with the system compiler into the
user's cache, reused when unchanged, and a clear error or the torch fallback
where it cannot be built. And both paged attention paths (the kernel and torch)
against full causal attention for grouped-query shapes, dtypes and chunked
prefill, below the model: an `AttentionProbe` feeds them fixed random q/k/v."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from batchpilot_server.engine.attention_kernel_build import (
    KernelUnavailableError,
    library_path,
    paged_decode_kernel,
    shares_torch_openmp,
)
from batchpilot_server.engine.block_pool import KVAccountingError
from batchpilot_server.engine.kv_cache import KVCache
from batchpilot_server.engine.model_runner import ModelRunner
from batchpilot_server.engine.models import (
    Attention,
    CausalAttention,
    ModelSpec,
    build_model,
    get_spec,
)
from batchpilot_server.engine.sequence import Sequence
from batchpilot_server.engine_api import SamplingParams
from batchpilot_server.serve import main as serve_main

from tests.support import runner_steps
from tests.support.engine_helpers import ATTENTIONS, requires_c_compiler

LOAD = (
    "from batchpilot_server.engine.attention_kernel_build import paged_decode_kernel; "
    "paged_decode_kernel()"
)


@pytest.fixture
def fresh_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty kernel cache, and no kernel loaded in this process yet."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    paged_decode_kernel.cache_clear()
    yield tmp_path / "batchpilot"
    paged_decode_kernel.cache_clear()


def runner(attention: str, dtype: torch.dtype = torch.float32) -> ModelRunner:
    cache = KVCache(get_spec("tiny"), num_blocks=8, block_size=16, device="cpu", dtype=dtype)
    return ModelRunner(build_model("tiny", "cpu"), cache, attention)  # type: ignore[arg-type]


@requires_c_compiler
def test_built_once_into_the_cache_then_reused(fresh_cache: Path) -> None:
    env = {**os.environ, "XDG_CACHE_HOME": str(fresh_cache.parent)}
    subprocess.run([sys.executable, "-c", LOAD], env=env, check=True, timeout=120)
    built = library_path()
    assert built.parent == fresh_cache and built.exists()
    first = built.stat().st_mtime_ns
    # a second process must load the same file, not rebuild it: with no compiler at
    # all it still succeeds
    env["CC"] = "/nonexistent/cc"
    subprocess.run([sys.executable, "-c", LOAD], env=env, check=True, timeout=120)
    assert built.stat().st_mtime_ns == first
    assert [p.name for p in fresh_cache.iterdir()] == [built.name]  # no temporary left


@requires_c_compiler
def test_a_library_others_could_replace_is_refused(fresh_cache: Path) -> None:
    runner("native")  # builds it
    library = library_path()
    assert stat.S_IMODE(library.stat().st_mode) == 0o755  # other users may load it
    fresh_cache.chmod(0o777)
    paged_decode_kernel.cache_clear()
    with pytest.raises(KernelUnavailableError, match=r"refusing to load the kernel: .* mode 777"):
        runner("native")
    assert runner("auto").attention == "torch"
    fresh_cache.chmod(0o755)
    library.chmod(0o766)
    paged_decode_kernel.cache_clear()
    with pytest.raises(KernelUnavailableError, match=r"paged_attention-.*\.so is owned by"):
        runner("native")


def test_native_without_a_compiler_is_a_clear_error(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.raises(KernelUnavailableError, match=r"no C compiler .*'/nonexistent/cc' not"):
        runner("native")


def test_a_failing_compiler_shows_its_message(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'fatal: no space left on device' >&2\nexit 3\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    with pytest.raises(KernelUnavailableError, match=r"failed .*exit 3.*no space left on device"):
        runner("native")
    assert [p.name for p in fresh_cache.iterdir()] == []  # no half-built library


def test_auto_falls_back_to_torch_and_says_why(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING):
        assert runner("auto").attention == "torch"
    assert "using the slower torch path: no C compiler" in caplog.text


@requires_c_compiler
def test_backend_choice_and_its_errors(fresh_cache: Path) -> None:
    assert runner("auto").attention == "native"
    assert runner("torch").attention == "torch"
    with pytest.raises(ValueError, match="attention must be one of auto, native, torch"):
        runner("fast")
    assert runner("native", torch.bfloat16).attention == "native"
    with pytest.raises(ValueError, match="over a float32 or bfloat16 cache; this cache is cpu"):
        runner("native", torch.float64)
    assert runner("auto", torch.float64).attention == "torch"


def test_serve_without_the_kernel_exits_1_with_the_reason(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CC", "/nonexistent/cc")
    code = serve_main(["--device", "cpu", "--threads", "1", "--attention", "native", "--port", "0"])
    assert code == 1
    assert "cannot start the engine: no C compiler" in capsys.readouterr().err


@requires_c_compiler
def test_a_table_too_short_for_its_tokens_is_refused_before_c_reads_it() -> None:
    native = runner("native")
    seq = Sequence("short", [256, *range(1, 20)], SamplingParams(max_tokens=4), 0.0, None, None)
    assert native.cache.pool.grow(seq.block_table, 16)  # one block for 20 tokens
    with pytest.raises(KVAccountingError, match="fewer blocks than its tokens need"):
        runner_steps.decode(native, [seq])


@requires_c_compiler
def test_the_kernel_binds_to_torchs_openmp_runtime_not_a_second_one() -> None:
    # Two runtimes would be two pools of threads on the same cores, each spinning for
    # the cores the other needs: the kernel must share torch's. A fresh process, as the
    # server loads it (other wheels bring their own renamed libgomp copies).
    mapped = (
        f"{LOAD}; from pathlib import Path; "
        "print('\\n'.join(sorted({l.split()[-1] for l in "
        "Path('/proc/self/maps').read_text().splitlines() if 'gomp' in l or 'libomp' in l})))"
    )
    done = subprocess.run([sys.executable, "-c", mapped], capture_output=True, text=True,
                          check=True, timeout=120)  # fmt: skip
    runtimes = done.stdout.split()
    assert len(runtimes) == 1 and runtimes[0].startswith(str(Path(torch.__file__).parent))
    assert shares_torch_openmp()
    needed = subprocess.run(["readelf", "-d", str(library_path())], capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    assert "libgomp.so.1" in needed


@requires_c_compiler
def test_rows_split_across_threads_decode_exactly_as_one_thread() -> None:
    model = build_model("tiny", "cpu")
    outputs = []
    for threads in (1, 3):
        cache = KVCache(get_spec("tiny"), num_blocks=64, block_size=16, device="cpu")
        runner = ModelRunner(model, cache, "native", threads)
        assert runner.kernel is not None and runner.kernel.threads == threads
        params = SamplingParams(max_tokens=8)
        # 5 rows of 60-96 cached tokens: enough for the kernel to share them out
        seqs = [
            Sequence(str(n), [256, *range(1, 60 + 9 * n)], params, 0.0, None, None)
            for n in range(5)
        ]
        for seq in seqs:
            assert cache.pool.grow(seq.block_table, seq.max_total_tokens)
        # the same torch threads for both runners: only the kernel's split differs
        torch.set_num_threads(3)
        logits = [runner_steps.prefill(runner, seqs)]
        for _ in range(6):
            for seq, row in zip(seqs, logits[-1], strict=True):
                seq.token_ids.append(int(row.argmax()))
            logits.append(runner_steps.decode(runner, seqs))
        outputs.append(torch.stack(logits))
    assert torch.equal(outputs[0], outputs[1])


def heads(n_heads: int, n_kv_heads: int, head_dim: int) -> ModelSpec:
    """A two-layer spec with these attention heads (all the KV cache reads of it)."""
    return replace(
        get_spec("tiny"), n_layers=2, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )


class AttentionProbe:
    """Stands in for the decoder under `ModelRunner`: layer l's q/k/v at position p of
    sequence n are fixed random tensors, every token id of sequence n is n (so a row
    finds its own), and `hidden` returns each layer's attention output side by side
    for every token (kept in `last`: the runner's logits hold only each row's last
    token; `logits` is the identity)."""

    def __init__(self, spec: ModelSpec, sequences: int, length: int, dtype: torch.dtype) -> None:
        generator = torch.Generator().manual_seed(0)

        def draw(n_heads: int) -> torch.Tensor:
            shape = (spec.n_layers, sequences, length, n_heads, spec.head_dim)
            return torch.randn(shape, generator=generator).to(dtype)

        self.q, self.k, self.v = draw(spec.n_heads), draw(spec.n_kv_heads), draw(spec.n_kv_heads)
        self.device = torch.device("cpu")  # ModelRunner reads the model's device
        self.last = torch.empty(0)

    def hidden(
        self, token_ids: torch.Tensor, positions: torch.Tensor, attention: Attention
    ) -> torch.Tensor:
        mixed = [
            attention(
                layer, q[token_ids, positions], k[token_ids, positions], v[token_ids, positions]
            )
            for layer, (q, k, v) in enumerate(zip(self.q, self.k, self.v, strict=True))
        ]
        self.last = torch.cat([out.flatten(2) for out in mixed], -1)
        return self.last

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def reference(self, sequence: int) -> torch.Tensor:
        """`CausalAttention` (full recompute, no cache) of every layer at every position
        of one sequence, in float32: [positions, features]."""
        length = self.q.shape[2]
        return self.hidden(
            torch.full((1, length), sequence),
            torch.arange(length)[None],
            lambda layer, q, k, v: CausalAttention()(layer, q.float(), k.float(), v.float()),
        )[0]


def probe_runner(
    attention: str,
    spec: ModelSpec,
    probe: AttentionProbe,
    num_blocks: int = 64,
    cache_dtype: torch.dtype = torch.float32,
) -> ModelRunner:
    """A runner over the probe whose pool hands out blocks in a scrambled order, as
    after churn, so no sequence's cache is contiguous."""
    cache = KVCache(spec, num_blocks, block_size=16, device="cpu", dtype=cache_dtype)
    scattered: list[int] = []
    cache.pool.grow(scattered, num_blocks * 16)
    cache.pool.release(np.random.default_rng(1).permutation(scattered).tolist())
    return ModelRunner(probe, cache, attention)  # type: ignore[arg-type]


def probe_sequences(runner: ModelRunner, lengths: list[int], decode_steps: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=decode_steps)
    seqs = [
        Sequence(str(n), [n] * length, params, 0.0, None, None) for n, length in enumerate(lengths)
    ]
    for seq in seqs:
        assert runner.cache.pool.grow(seq.block_table, seq.max_total_tokens)
    return seqs


def run_probe(
    runner: ModelRunner, probe: AttentionProbe, seqs: list[Sequence], decode_steps: int
) -> list[tuple[Sequence, int, torch.Tensor]]:
    """Prefill in two uneven chunked steps (some rows whole, some split inside and at
    a block boundary), then decode: the output of every token computed, with its
    sequence and position."""
    outputs = []

    def prefill(rows: list[Sequence], chunks: list[int]) -> None:
        starts = [seq.num_computed for seq in rows]
        runner_steps.prefill(runner, rows, chunks)
        outputs.extend(
            (seq, start + column, probe.last[row, column])
            for row, (seq, start, chunk) in enumerate(zip(rows, starts, chunks, strict=True))
            for column in range(chunk)
        )

    prefill(seqs, [len(seqs[0].token_ids), 10, 16, len(seqs[3].token_ids)])
    rest = [seq for seq in seqs if not seq.ready_to_sample]
    prefill(rest, [seq.num_uncomputed for seq in rest])
    for _ in range(decode_steps):
        for n, seq in enumerate(seqs):
            seq.token_ids.append(n)
        logits = runner_steps.decode(runner, seqs)
        outputs += [(seq, seq.num_tokens - 1, row) for seq, row in zip(seqs, logits, strict=True)]
    return outputs


LENGTHS = [5, 37, 40, 33]  # ragged; the two chunked rows resume mid-block and on a boundary


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_paged_attention_matches_full_causal_attention_for_grouped_heads(
    attention: str, group: int, head_dim: int
) -> None:
    """Chunked prefill and decode, scattered blocks, n_heads / n_kv_heads = group."""
    spec = heads(2 * group, 2, head_dim)
    steps = 20
    probe = AttentionProbe(spec, len(LENGTHS), max(LENGTHS) + steps, torch.float32)
    runner = probe_runner(attention, spec, probe)
    assert runner.attention == attention
    seqs = probe_sequences(runner, LENGTHS, steps)
    references = [probe.reference(n) for n in range(len(seqs))]
    for seq, position, row in run_probe(runner, probe, seqs, steps):
        expected = references[int(seq.request_id)][position]
        torch.testing.assert_close(row, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_bfloat16_activations_over_either_cache(attention: str, cache_dtype: torch.dtype) -> None:
    """The model runs bfloat16 over a float32 or a bfloat16 cache: attention hands back
    bfloat16 within its tolerance of float32 attention."""
    spec = heads(9, 3, 64)
    steps = 12
    probe = AttentionProbe(spec, len(LENGTHS), max(LENGTHS) + steps, torch.bfloat16)
    runner = probe_runner(attention, spec, probe, cache_dtype=cache_dtype)
    assert runner.cache.k.dtype == cache_dtype and runner.attention == attention
    references = [probe.reference(n) for n in range(len(LENGTHS))]
    for seq, position, row in run_probe(
        runner, probe, probe_sequences(runner, LENGTHS, steps), steps
    ):
        assert row.dtype == torch.bfloat16
        expected = references[int(seq.request_id)][position].to(torch.bfloat16)
        torch.testing.assert_close(row, expected)  # bfloat16's own tolerance


@requires_c_compiler
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_a_bfloat16_cache_gives_a_bfloat16_model_the_float32_caches_outputs(
    head_dim: int,
) -> None:
    """A bfloat16 model's K/V are bfloat16 values, so a bfloat16 pool holds them exactly
    and the kernel (float32 arithmetic over either pool) gives the same bits as over a
    float32 pool, in half the memory."""
    spec = heads(9, 3, head_dim)
    steps = 12
    probe = AttentionProbe(spec, len(LENGTHS), max(LENGTHS) + steps, torch.bfloat16)
    outputs = []
    for dtype in (torch.float32, torch.bfloat16):
        runner = probe_runner("native", spec, probe, cache_dtype=dtype)
        assert runner.cache.k.dtype == dtype and runner.attention == "native"
        rows = run_probe(runner, probe, probe_sequences(runner, LENGTHS, steps), steps)
        outputs.append(torch.stack([row for _, _, row in rows]))
    assert torch.equal(outputs[0], outputs[1])


@requires_c_compiler
@pytest.mark.parametrize("head_dim", [64, 128, 40])
def test_the_kernel_and_the_torch_path_agree(head_dim: int) -> None:
    spec = heads(12, 4, head_dim)
    steps = 20
    probe = AttentionProbe(spec, len(LENGTHS), max(LENGTHS) + steps, torch.float32)
    outputs = []
    for attention in ("native", "torch"):
        runner = probe_runner(attention, spec, probe)
        rows = run_probe(runner, probe, probe_sequences(runner, LENGTHS, steps), steps)
        outputs.append(torch.stack([row for _, _, row in rows]))
    torch.testing.assert_close(outputs[0], outputs[1], atol=1e-5, rtol=0)
