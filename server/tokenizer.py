"""Tokenizers: text to ids and back, streaming decode, chat rendering.

Every tokenizer offers `vocab_size`, `bos_id`, `eos_ids`, `encode`, `decode`,
`incremental_decoder()` and `render_chat`:

- `ByteTokenizer` (the `tiny` preset): UTF-8 bytes, any text round-trips.
- `TextTokenizer`: a `tokenizers` pipeline, read from a model directory's
  `tokenizer.json` (`from_directory`) or built from a GGUF file's vocabulary
  and merges (`from_gguf_vocabulary`).

Chat templates (chat_template.py) render through jinja2 in the sandbox and with the
helpers that transformers' `apply_chat_template` gives them, so the prompt text is the same.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

from batchpilot_server.chat_template import CHATML_TEMPLATE, ChatTemplate
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as Pipeline

BYTE_VOCAB = 256


class IncrementalDecoder(Protocol):
    def decode(self, ids: list[int], final: bool = False) -> str: ...


class Tokenizer(Protocol):
    chat_template: ChatTemplate  # --chat-template replaces it once the model is loaded

    @property
    def vocab_size(self) -> int: ...
    @property
    def bos_id(self) -> int | None: ...
    @property
    def eos_ids(self) -> frozenset[int]: ...

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, as logprobs spell it (a special token: its text)."""
        ...

    def incremental_decoder(self) -> IncrementalDecoder: ...
    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


# ---- bytes (tiny) -----------------------------------------------------------


class ByteTokenizer:
    """Ids 0..255 are bytes; then BOS and EOS. Special ids decode to nothing."""

    bos_id = BYTE_VOCAB
    eos_id = BYTE_VOCAB + 1
    eos_ids = frozenset({eos_id})
    vocab_size = BYTE_VOCAB + 2
    chat_template = ChatTemplate(CHATML_TEMPLATE, {})

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int]) -> str:
        return _byte_string(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if 0 <= token_id < BYTE_VOCAB else b""

    def incremental_decoder(self) -> ByteDecoder:
        """For streaming: holds back a multi-byte character until it is complete."""
        return ByteDecoder()

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self.chat_template.render(messages, add_generation_prompt, tools)


class ByteDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, ids: list[int], final: bool = False) -> str:
        return self._utf8.decode(_byte_string(ids), final=final)


def _byte_string(ids: list[int]) -> bytes:
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB)


# ---- tokenizers pipelines (model directories, GGUF files) -------------------


class TextTokenizer:
    """A `tokenizers` pipeline with the model's BOS/EOS ids and chat template."""

    def __init__(
        self,
        pipeline: Pipeline,
        *,
        bos_id: int | None,
        eos_ids: frozenset[int],
        chat_template: ChatTemplate,
    ) -> None:
        self.pipeline = pipeline
        self.vocab_size = pipeline.get_vocab_size(with_added_tokens=True)
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.chat_template = chat_template

    @classmethod
    def from_directory(
        cls, directory: Path, config: Mapping[str, Any], eos_ids: frozenset[int]
    ) -> TextTokenizer:
        """`tokenizer.json`, with the chat template and special tokens of `config`
        (tokenizer_config.json); a newer `chat_template.jinja` file wins over the
        config's template.

        Whether BOS is added is the pipeline's own post-processor's business, as in
        transformers' fast tokenizers."""
        pipeline = Pipeline.from_file(str(directory / "tokenizer.json"))
        template_file = directory / "chat_template.jinja"
        source = (
            template_file.read_text(encoding="utf-8")
            if template_file.exists()
            else _default_template(config.get("chat_template"))
        )
        special = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(config.get(name))) is not None
        }
        bos = special.get("bos_token")
        bos_id = pipeline.token_to_id(bos) if bos is not None else None
        eos = special.get("eos_token")
        if not eos_ids and eos is not None and (eos_id := pipeline.token_to_id(eos)) is not None:
            eos_ids = frozenset({eos_id})
        return cls(
            pipeline, bos_id=bos_id, eos_ids=eos_ids, chat_template=ChatTemplate(source, special)
        )

    @classmethod
    def from_gguf_vocabulary(cls, vocabulary: GGUFVocabulary) -> TextTokenizer:
        pipeline = byte_level_pipeline(vocabulary)
        tokens = vocabulary.tokens
        special = {
            name: tokens[token_id]
            for name, token_id in (
                ("bos_token", vocabulary.bos_id),
                ("eos_token", vocabulary.eos_id),
            )
            if token_id is not None
        }
        return cls(
            pipeline,
            bos_id=vocabulary.bos_id,
            eos_ids=vocabulary.end_of_generation_ids(),
            chat_template=ChatTemplate(vocabulary.chat_template, special),
        )

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self.pipeline.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        # special tokens (<|im_end|>, BOS) are markup, not text, as in vLLM's output
        return self.pipeline.decode(ids, skip_special_tokens=True)

    def token_bytes(self, token_id: int) -> bytes:
        token = self.pipeline.id_to_token(token_id)
        if token is None:
            return b""
        if isinstance(self.pipeline.decoder, decoders.ByteLevel):
            # GPT-2's printable spelling back to the bytes (a special token: its text)
            spelling = _byte_spelling()
            if all(char in spelling for char in token):
                return bytes(spelling[char] for char in token)
            return token.encode("utf-8")
        return self.pipeline.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def incremental_decoder(self) -> WindowDecoder:
        return WindowDecoder(self.decode)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self.chat_template.render(messages, add_generation_prompt, tools)


class WindowDecoder:
    """Streams text from token ids, holding back a character until all its tokens came.

    A byte-level token may carry part of a UTF-8 character; decoding it alone
    gives U+FFFD. Each call decodes only a short window, from the token before
    the last emitted text to the newest token, and emits what that window adds
    once it no longer ends in a broken character (the approach of vLLM and TGI).
    Decoding the window rather than single tokens also keeps the spaces that
    decoders drop at the start of a text."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # window start: context for the decoder
        self._read = 0  # tokens up to here are already emitted

    def decode(self, ids: list[int], final: bool = False) -> str:
        self._ids += ids
        emitted = self._decode(self._ids[self._prefix : self._read])
        text = self._decode(self._ids[self._prefix :])
        if len(text) <= len(emitted) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self._ids)
        return text[len(emitted) :]


class GGUFVocabulary:
    """What a GGUF file says about its tokenizer (llama.cpp's `tokenizer.ggml.*` keys)."""

    # llama.cpp ends generation on these tokens too when the file has them
    END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|endoftext|>")

    def __init__(
        self,
        *,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int],
        pre: str,
        bos_id: int | None,
        eos_id: int | None,
        add_bos: bool,
        chat_template: str | None,
    ) -> None:
        self.tokens = list(tokens)
        self.merges = list(merges)
        self.token_types = list(token_types)
        self.pre = pre
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.add_bos = add_bos
        self.chat_template = chat_template

    def end_of_generation_ids(self) -> frozenset[int]:
        ids = {i for i, token in enumerate(self.tokens) if token in self.END_OF_GENERATION_TEXTS}
        return frozenset(ids | ({self.eos_id} if self.eos_id is not None else set()))


# token types in llama.cpp's vocabulary (llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# llama.cpp's pre-tokenizer names -> how the text is split before the merges
# (llama-vocab.cpp): each digit alone, then GPT-2's split, for SmolLM & co.
_DIGITS_THEN_GPT2 = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone")
_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3"), _LLAMA3_SPLIT),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}


def byte_level_pipeline(vocabulary: GGUFVocabulary) -> Pipeline:
    """A byte-level BPE `tokenizers` pipeline from a GGUF `gpt2`-model vocabulary, as
    transformers builds it from the same file (GPT2Tokenizer + special tokens) and
    with the pre-tokenizer llama.cpp uses for the file's `pre` name."""
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab = {
        token
        if set(token) <= spelled
        else "".join(alphabet[byte] for byte in token.encode("utf-8")): index
        for index, token in enumerate(vocabulary.tokens)
    }
    merges = [tuple(merge.split(" ", 1)) for merge in vocabulary.merges]
    pipeline = Pipeline(
        models.BPE(
            vocab,
            merges,  # type: ignore[arg-type]
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    )
    pipeline.pre_tokenizer = _pre_tokenizer(vocabulary.pre)
    pipeline.decoder = decoders.ByteLevel()
    types = vocabulary.token_types
    pipeline.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind in zip(vocabulary.tokens, types, strict=False)
            if kind == _CONTROL and set(token) <= spelled
        ]
    )
    pipeline.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind in zip(vocabulary.tokens, types, strict=False)
            if kind == _USER_DEFINED
        ]
    )
    if vocabulary.add_bos and vocabulary.bos_id is not None:
        bos = vocabulary.tokens[vocabulary.bos_id]
        pipeline.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocabulary.bos_id)]
        )
    return pipeline


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _SPLITS.get(pre)
    if split is None:  # gpt2, default: GPT-2's own split
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling = dict(zip(printable, map(chr, printable), strict=True))
    extra = 0
    for byte in range(256):
        if byte not in spelling:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return spelling


@lru_cache(maxsize=1)
def _byte_spelling() -> dict[str, int]:
    return {char: byte for byte, char in _byte_alphabet().items()}


def _default_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named templates."""
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        return named.get("default")
    return value if isinstance(value, str) else None


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
