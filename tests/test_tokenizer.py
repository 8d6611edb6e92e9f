"""Byte-level tokenizer: any text round-trips with no download."""

from __future__ import annotations

from batchpilot_server.tokenizer import ByteTokenizer

TEXTS = ["", "hello, world", "naïve café", "日本語のテキスト", "emoji 🚀🧪", "tab\tnew\nline\0"]


def test_any_text_round_trips() -> None:
    tokenizer = ByteTokenizer()
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_id
        assert all(0 <= i < tokenizer.vocab_size for i in ids)
        assert tokenizer.decode(ids) == text
        assert tokenizer.encode(text, add_bos=False) == ids[1:]


def test_special_ids_decode_to_nothing() -> None:
    tokenizer = ByteTokenizer()
    ids = [tokenizer.bos_id, *tokenizer.encode("ok", add_bos=False), tokenizer.eos_id]
    assert tokenizer.decode(ids) == "ok"
    assert len({tokenizer.bos_id, tokenizer.eos_id}) == 2 and tokenizer.vocab_size == 258


def test_incremental_decoding_waits_for_whole_characters() -> None:
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("é🚀", add_bos=False)
    decoder = tokenizer.incremental_decoder()
    pieces = [decoder.decode([i]) for i in ids]
    assert pieces == ["", "é", "", "", "", "🚀"]
    assert decoder.decode([], final=True) == ""


def test_invalid_bytes_are_replaced_not_raised() -> None:
    tokenizer = ByteTokenizer()
    assert tokenizer.decode([0xFF, ord("a")]) == "\ufffda"
