"""Turning Moshi's text tokens into readable text, one token at a time."""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Protocol

import sentencepiece

from moshi_mlx.errors import WeightsError

PADDING_IDS = (0, 3)  # Moshi's text padding tokens: not text
_WORD_START = "\u2581"  # SentencePiece's leading-space marker


class TextTokenizer(Protocol):
    """What the products need of a SentencePiece model (`load_tokenizer`'s): TTS scripts
    encode words, STT's word timer also decodes them and knows the end and the vocabulary."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def eos_id(self) -> int: ...

    def get_piece_size(self) -> int: ...


def load_tokenizer(path: str | Path) -> sentencepiece.SentencePieceProcessor:
    """Read Moshi's SentencePiece model (`tokenizer_spm_32k_3.model`)."""
    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"text tokenizer not found: {path}")
    try:
        return sentencepiece.SentencePieceProcessor(model_file=str(path))
    except (OSError, RuntimeError) as exc:
        raise WeightsError(f"cannot read {path} as a SentencePiece model: {exc}") from None


class TextDecoder:
    """Incremental decoder over a SentencePiece model (see `load_tokenizer`); one per stream,
    several may share one model.

    `decode(token)` returns the text the token adds: "" for padding and control tokens, word
    pieces with their leading marker turned into a space, byte pieces joined into UTF-8.
    """

    def __init__(self, processor: sentencepiece.SentencePieceProcessor):
        self.processor = processor
        self._bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def reset(self) -> None:
        """Drop any incomplete UTF-8 sequence from byte pieces."""
        self._bytes.reset()

    def decode(self, token: int) -> str:
        """The text contributed by one token."""
        sp = self.processor
        token = int(token)
        if token in PADDING_IDS or not 0 <= token < sp.get_piece_size():
            return ""
        if sp.is_control(token) or sp.is_unknown(token):
            return ""
        piece = sp.id_to_piece(token)
        if sp.is_byte(token):  # "<0xAB>"
            return self._bytes.decode(bytes([int(piece[3:5], 16)]))
        return self._bytes.decode(b"", final=True) + piece.replace(_WORD_START, " ")
