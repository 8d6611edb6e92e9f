"""Byte-level UTF-8 tokenizer: any text round-trips, nothing to download."""

from __future__ import annotations

import codecs

BYTE_VOCAB = 256


class ByteTokenizer:
    """Ids 0..255 are bytes; then BOS and EOS. Special ids decode to nothing."""

    bos_id = BYTE_VOCAB
    eos_id = BYTE_VOCAB + 1
    vocab_size = BYTE_VOCAB + 2

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return _byte_string(ids).decode("utf-8", errors="replace")

    def incremental_decoder(self) -> IncrementalDecoder:
        """For streaming: holds back a multi-byte character until it is complete."""
        return IncrementalDecoder()


class IncrementalDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, ids: list[int], final: bool = False) -> str:
        return self._utf8.decode(_byte_string(ids), final=final)


def _byte_string(ids: list[int]) -> bytes:
    return bytes(i for i in ids if 0 <= i < BYTE_VOCAB)
