"""The bench's random weights, written once per folder with `moshi_mlx.testing`'s writers and
kept there (`--weights-dir`): never fetched."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from bench_stats import LM_SHAPES, QUANT_BITS, TTS_SHAPES, TTS_TEXTS
from fixture_tokenizer import train_bpe_tokenizer

from moshi_mlx.checkpoints.quantize import quantize_checkpoint
from moshi_mlx.checkpoints.spec import CONFIG_FILE
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.models.mimi import MimiConfig
from moshi_mlx.testing.checkpoints import (
    write_random_lm_checkpoint,
    write_random_mimi_checkpoint,
    write_random_tts_checkpoint,
)
from moshi_mlx.testing.voices import random_voice, write_voice

TTS_LM_FILE = "dsm_tts_1e68beda@240.safetensors"  # the published file's name
TTS_TOKENIZER = "tokenizer.model"
TTS_TOKENIZER_PIECES = 400
TTS_VOICE_FRAMES = 125  # a published voice: speaker_wavs (1, 512, 125) float32


def lm_weights(folder: Path, shape: str, quant: str) -> Path:
    """The random LM file of a case, written once per folder in Kyutai's MLX format."""
    bits, group_size = QUANT_BITS[quant]
    path = folder / f"lm_{shape}_{quant}.safetensors"
    if not path.exists():
        config = LmConfig.from_dict(LM_SHAPES[shape])
        write_random_lm_checkpoint(path, config, bits=bits, group_size=group_size, seed=0)
    return path


def mimi_weights(folder: Path) -> Path:
    """The random Mimi file, in the published PyTorch layout (all 32 codebooks)."""
    path = folder / "mimi.safetensors"
    if not path.exists():
        write_random_mimi_checkpoint(path, MimiConfig.moshi(), seed=0)
    return path


def tts_weights(folder: Path, shape: str, voices: int = 8) -> Path:
    """The random TTS of a shape, written once into `folder / shape`: `config.json` (Kyutai's,
    naming the files), the LM in the published PyTorch layout (bf16, conditioners float32),
    a BPE tokenizer of the bench's texts (its few hundred pieces all below `text_card`), and
    voice embeddings `voices/voice{i}.safetensors` for i < `voices` (those missing are added).
    Mimi is `mimi_weights(folder)`."""
    out = folder / shape
    config = {**TTS_SHAPES[shape], "moshi_name": TTS_LM_FILE, "tokenizer_name": TTS_TOKENIZER}
    if not (out / CONFIG_FILE).exists():  # written last
        write_random_tts_checkpoint(out / TTS_LM_FILE, config, seed=0)
        sentences = [s for text in TTS_TEXTS for s in text.split(". ")]
        tokenizer = train_bpe_tokenizer(sentences, TTS_TOKENIZER_PIECES, 3)
        (out / TTS_TOKENIZER).write_bytes(tokenizer)
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    dim = config["conditioners"]["speaker_wavs"]["tensor"]["dim"]
    (out / "voices").mkdir(exist_ok=True)
    for index in range(voices):
        path = out / "voices" / f"voice{index}.safetensors"
        if not path.exists():
            write_voice(path, random_voice(np.random.default_rng(index), dim, TTS_VOICE_FRAMES))
    return out


def tts_lm_file(tts_dir: Path, quant: str) -> Path:
    """The LM file of a `tts_weights` folder in `quant` (a `QUANT_BITS` name): the published
    bf16 file, or a file made from it by our quantizer (`python -m moshi_mlx quantize`'s
    `quantize_checkpoint`) and kept beside it."""
    bits, group_size = QUANT_BITS[quant]
    source = tts_dir / TTS_LM_FILE
    if bits is None:
        return source
    path = tts_dir / f"lm_{quant}.safetensors"
    if not path.exists():
        config = LmConfig.from_dict(json.loads((tts_dir / CONFIG_FILE).read_text()))
        quantize_checkpoint(source, path, bits, group_size, progress=False, config=config)
    return path
