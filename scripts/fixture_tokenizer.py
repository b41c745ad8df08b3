"""The tiny SentencePiece tokenizer of the reference fixture scripts (run in their venvs)."""

from __future__ import annotations

import io

import sentencepiece


def train_bpe_tokenizer(sentences: list[str], vocab_size: int, pad_id: int) -> bytes:
    """A BPE model of `vocab_size` pieces over `sentences` (Kyutai's id layout: 0 unk, 1 <s>,
    2 </s>, `pad_id` pad), as the bytes of a .model file; deterministic."""
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences * 20),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        pad_id=pad_id,
        normalization_rule_name="identity",
        num_threads=1,
        minloglevel=2,
    )
    return model.getvalue()
