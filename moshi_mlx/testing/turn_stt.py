"""A tiny STT checkpoint that hears speech and ends turns, for the assistant's end-to-end test:
`write_turn_taking_stt(folder, mimi, tokenizer, word)`.

Random tiny weights never recognise a word nor detect a pause, so this model's weights are
built, not drawn (dim 32, Kyutai's STT layout, a 1 s attention window). Dimensions of the
residual stream:

- 0 / 1: this frame is silence / speech. Each codebook's embedding rows of the codes that
  `mimi` gives digital silence (from a stream's start on: `silence_codes`) add 1/8 to dim 0,
  every other row 1/8 to dim 1; so a frame whose codes all are silence codes is (1, 0), a
  voiced frame mostly (0, 1). (`write_short_memory_mimi` makes a Mimi whose silence after
  speech encodes as the silence before it.) "Speech" therefore means speech-level audio:
  quiet audio encodes to the silence codes too, a level gate of the tiny Mimi's quantizer,
  measured, not built: `write_voice`'s voice (-22 dBFS RMS) gives words at 10 dB down,
  fewer at 15 dB down, none from 20 dB down (about -42 dBFS) on; espeak-ng's speech
  (peaks at full scale) gives only silence codes from 30 dB down. So an echo canceller's residual (20-40 dB down) is silence to this STT,
  as Kyutai's STT would hear no words in it (tests/unit/test_turn_stt.py checks 30 dB down).
- 2 / 3: the text token written at the previous step was the end-of-padding token 0 / any
  other one (set by the text embedding), 4: a constant 4 (the text embedding too).
- 5: how much of the last second was speech: the first layer's attention has zero queries
  and keys, so it averages its values, dim 1, over the window (times 4). All other
  attention and feed-forward outputs are zero: the layers pass the stream through.

Out of that, after the output norm:

- the pause head 2 ("done", class 0) has logit 5 * (0.15 * dim4 - dim5): above 0.6 once the
  last second is almost all silence (speech, then about a second of silence: an end of turn
  by Unmute's rule `prs[2] > 0.6`), below 0.05 while the user speaks (a barge-in by the head
  too). The other heads are zero (uniform).
- the text head writes padding (3) while the last second holds little speech, else
  alternates the end-of-padding token 0 and the one-piece `word`: "word word word ..." at
  about six words a second while the user speaks (each word is reported when the next 0
  closes it, as Kyutai's word timing does).
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.models.config import LmConfig
from moshi_mlx.models.config_sections import SttTiming

DIM, CODEBOOKS, CARD, WINDOW_STEPS = 32, 8, 64, 12
SILENCE, SPEECH, AFTER_BOUNDARY, AFTER_OTHER, CONSTANT, RECENT_SPEECH = range(6)
END_OF_PADDING, PADDING = 0, 3
_LEVEL = 4.0  # the constant's and the speech average's scale


def turn_taking_stt_config() -> LmConfig:
    """Kyutai's STT layout over a tiny Mimi (8 codebooks of 64 codes): 2 layers of width 32,
    a 1 s window, 4 voice-activity heads, text 0.5 s behind the audio."""
    return LmConfig(
        dim=DIM, num_heads=2, num_layers=2, hidden_scale=2.0, context=WINDOW_STEPS, card=CARD,
        text_card=100, n_q=CODEBOOKS, dep_q=0, delays=(0,) * (CODEBOOKS + 1), model_type="stt",
        extra_heads_num_heads=4, stt_config=SttTiming(0.5, 0.0),
    )  # fmt: skip


def write_short_memory_mimi(path: Path, seed: int = 3, decoder_gain: float = 1.0) -> Path:
    """A random tiny Mimi (`MimiConfig.tiny()`) whose encoder forgets: its transformer's layer
    scales are zero, so the encoder is convolutions alone, and silence a few frames after any
    sound encodes to the same codes as the silence at the start (with the transformer, whose
    window is 20 s, it settles on codes that depend on what was said). The decoder's last
    convolution (linear) is scaled by `decoder_gain`: the random decoder's audio is about
    -48 dBFS (RMS), 27 dB under espeak-ng's speech; 25 makes a tiny TTS speak as loud as
    that. Returns `path`."""
    from safetensors.numpy import load_file, save_file

    from moshi_mlx.checkpoints.io import read_safetensors
    from moshi_mlx.models.mimi import MimiConfig
    from moshi_mlx.testing.checkpoints import write_random_mimi_checkpoint

    write_random_mimi_checkpoint(path, MimiConfig.tiny(), seed)
    tensors = load_file(str(path))
    layers = [int(name.split(".")[2]) for name in tensors if name.startswith("decoder.model.")]
    output = f"decoder.model.{max(layers)}."  # the output convolution, to 1 channel
    for name, tensor in tensors.items():
        if name.startswith("encoder_transformer.") and ".layer_scale_" in name:
            tensor[:] = 0.0
        if name.startswith(output):
            tensor *= decoder_gain
    save_file(tensors, str(path), metadata=read_safetensors(path).metadata)
    return path


def silence_codes(mimi: Path, codebooks: int = CODEBOOKS) -> list[set[int]]:
    """Per codebook, the codes that the Mimi file `mimi` gives digital silence from the start
    of a stream (its first frames differ from the ones it settles on)."""
    from moshi_mlx.checkpoints.mimi import load_mimi
    from moshi_mlx.runtime.codec import FRAME_SIZE, MlxCodec

    codec = MlxCodec(load_mimi(mimi, codebooks))
    silence = np.zeros(FRAME_SIZE, np.float32)
    frames = np.stack([np.array(codec.encode_step(silence)) for _ in range(WINDOW_STEPS)])
    return [set(frames[:, k].tolist()) for k in range(codebooks)]


def _weights(config: LmConfig, silence: list[set[int]], word: int) -> dict[str, np.ndarray]:
    """The model's tensors in MLX naming (see the module docstring)."""
    from mlx.utils import tree_flatten

    from moshi_mlx.testing.checkpoints import lazy_lm

    model = lazy_lm(config, dtype=mx.float32)
    weights = {name: np.zeros(p.shape, np.float32) for name, p in tree_flatten(model.parameters())}
    for name, tensor in weights.items():
        if name.endswith(("norm1.weight", "norm2.weight", "out_norm.weight")):
            tensor[:] = 1.0
    for k in range(config.n_q):
        table = weights[f"audio_embs.{k}.weight"]  # (card + 1, dim): the last row is "none"
        quiet = [*sorted(silence[k]), config.card]
        table[:, SPEECH] = 1 / config.n_q
        table[quiet, SPEECH] = 0.0
        table[quiet, SILENCE] = 1 / config.n_q
    text_emb = weights["text_emb.weight"]
    text_emb[:, CONSTANT] = _LEVEL
    text_emb[:, AFTER_OTHER] = _LEVEL
    text_emb[END_OF_PADDING, AFTER_OTHER] = 0.0
    text_emb[END_OF_PADDING, AFTER_BOUNDARY] = _LEVEL
    attention = "transformer.layers.0.self_attn"
    weights[f"{attention}.in_proj.weight"][2 * DIM + RECENT_SPEECH, SPEECH] = 1.0  # value
    weights[f"{attention}.out_proj.weight"][RECENT_SPEECH, RECENT_SPEECH] = _LEVEL
    done = weights["extra_heads.2.weight"][0]
    done[CONSTANT], done[RECENT_SPEECH] = 5 * 0.15, -5.0
    text = weights["text_linear.weight"]
    for token in (END_OF_PADDING, word):
        text[token, RECENT_SPEECH], text[token, CONSTANT] = 5.0, -5 * 0.2
    text[PADDING, RECENT_SPEECH], text[PADDING, CONSTANT] = -5.0, 5 * 0.2
    text[END_OF_PADDING, AFTER_OTHER], text[END_OF_PADDING, AFTER_BOUNDARY] = 1.0, -1.0
    text[word, AFTER_BOUNDARY], text[word, AFTER_OTHER] = 1.0, -1.0
    return weights


def write_turn_taking_stt(folder: Path, mimi: Path, tokenizer: Path, word: str) -> Path:
    """A folder laid out like kyutai/stt-1b-en_fr (config.json naming its files; the LM in
    PyTorch naming) whose model is built as the module docstring says, over the tiny Mimi
    file `mimi` (8 codebooks of 64 codes) and the SentencePiece `tokenizer`, in which `word`
    must be one piece. Returns `folder`, for `SttModel.load(folder)` or `--stt folder`."""
    import sentencepiece
    from safetensors.numpy import save_file

    from moshi_mlx.checkpoints.conversion import to_pytorch_naming

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    pieces = sentencepiece.SentencePieceProcessor(model_file=str(tokenizer)).encode(word)
    config = turn_taking_stt_config()
    if len(pieces) != 1 or not PADDING < pieces[0] < config.text_card:
        raise ValueError(f"{word!r} is not one text token of {tokenizer}: {pieces}")
    silence = silence_codes(mimi, config.n_q)
    if max(max(codes) for codes in silence) >= config.card:
        raise ValueError(f"{mimi} has more than {config.card} codes per codebook")
    weights = {k: mx.array(v) for k, v in _weights(config, silence, pieces[0]).items()}
    tensors = {k: np.array(v) for k, v in to_pytorch_naming(weights).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    for source in (Path(mimi), Path(tokenizer)):
        link = folder / source.name
        if not link.exists():
            os.symlink(source.resolve(), link)
    names = {"moshi_name": "model.safetensors", "mimi_name": Path(mimi).name}
    data = replace(config, tokenizer_name=Path(tokenizer).name).to_dict() | names
    (folder / "config.json").write_text(json.dumps(data, indent=2))
    return folder
