"""Byte-level tokenizer (any text round-trips with no download) and chat rendering."""

from __future__ import annotations

import pytest
from batchpilot_server.chat_template import ChatTemplate, ChatTemplateError
from batchpilot_server.tokenizer import ByteTokenizer

TEXTS = ["", "hello, world", "naïve café", "日本語のテキスト", "emoji 🚀🧪", "tab\tnew\nline\0"]


def test_any_text_round_trips() -> None:
    tokenizer = ByteTokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_id
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode(text, add_special_tokens=False) == ids[1:]


def test_special_ids_decode_to_nothing() -> None:
    tokenizer = ByteTokenizer()
    (eos,) = tokenizer.eos_ids
    ids = [tokenizer.bos_id, *tokenizer.encode("ok", add_special_tokens=False), eos]
    assert tokenizer.decode(ids) == "ok"
    assert len({tokenizer.bos_id, eos}) == 2 and tokenizer.vocab_size == 258


def test_incremental_decoding_waits_for_whole_characters() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("é🚀", add_special_tokens=False)
    decoder = tokenizer.incremental_decoder()
    pieces = [decoder.decode([i]) for i in ids]
    assert pieces == ["", "é", "", "", "", "🚀"]
    assert decoder.decode([], final=True) == ""


def test_invalid_bytes_are_replaced_not_raised() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([0xFF, ord("a")]) == "\ufffda"


def test_tiny_chat_is_chatml() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    rendered = ByteTokenizer().render_chat(messages)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert not ByteTokenizer().render_chat(messages, add_generation_prompt=False).endswith(
        "assistant\n"
    )


def test_chat_templates_render_as_transformers_and_refuse_clearly() -> None:
    """raise_exception and tojson behave as under transformers' apply_chat_template;
    no template at all is a ChatTemplateError too."""
    strict = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}",
        {"bos_token": "<s>"},
    )
    assert strict.render([{"role": "user", "content": "é<b>"}], True) == (
        '<s>[{"role": "user", "content": "é<b>"}]'
    )
    with pytest.raises(ChatTemplateError, match="refused the conversation: user first"):
        strict.render([{"role": "system", "content": "x"}], True)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate(None, {}).render([{"role": "user", "content": "x"}], True)
