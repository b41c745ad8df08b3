"""TextDecoder over a tiny SentencePiece model trained in the test."""

import pytest
import sentencepiece

from moshi_mlx.errors import WeightsError
from moshi_mlx.runtime.tokenizer import TextDecoder, load_tokenizer

LINES = [
    "hello there how are you doing today",
    "the quick brown fox jumps over the lazy dog",
    "moshi speaks and listens at the same time",
    "streaming text comes one token at a time",
] * 20


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("spm")
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(LINES))
    prefix = root / "tiny"
    sentencepiece.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(prefix),
        vocab_size=300,
        model_type="unigram",
        byte_fallback=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def test_incremental_decoding_reads_as_text(spm_model):
    decoder = TextDecoder(load_tokenizer(spm_model))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    text = "the lazy fox speaks one token at a time"
    ids = sp.encode(text)
    assert len(ids) > 3
    pieces = [decoder.decode(i) for i in ids]
    assert "".join(pieces) == " " + text
    assert sum(p.startswith(" ") for p in pieces) == len(text.split())


def test_padding_and_control_tokens_are_silent(spm_model):
    decoder = TextDecoder(load_tokenizer(spm_model))
    assert [decoder.decode(i) for i in (0, 1, 2, 3, 10_000, -5)] == [""] * 6


def test_byte_pieces_join_into_utf8(spm_model):
    decoder = TextDecoder(load_tokenizer(spm_model))
    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_model))
    ids = sp.encode("the café")
    assert any(sp.is_byte(i) for i in ids)  # "é" is not in the tiny vocabulary
    pieces = [decoder.decode(i) for i in ids]
    assert "".join(pieces) == " the café"
    assert "" in pieces  # the first byte of "é" waits for the second


def test_missing_or_bad_model(tmp_path):
    with pytest.raises(WeightsError, match="not found"):
        load_tokenizer(tmp_path / "nope.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(WeightsError, match="SentencePiece"):
        load_tokenizer(bad)
