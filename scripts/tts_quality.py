"""What the TTS's speed choices cost, without listening: 8 and 4 bits (`moshi_mlx.quantize`'s
files) and fewer codebooks (`n_q`), each against the bf16 model generating all codebooks.

    python scripts/tts_quality.py --shapes tts-tiny,tts-small --steps 60

On random weights of a bench TTS shape (`bench.weights.tts_weights`: Kyutai's config at that
size, a random full-size Mimi), each variant speaks the same text greedily (temperature 0) in
the same voice for `--steps` steps, and is compared with the bf16 run:
- `text_agree`, `audio_agree`: the share of steps whose predicted text token, and of frames
  whose codes (the codebooks the variant generates), equal the reference's;
- `first_diff`: the first step where any of them differs (None: none did);
- `snr_db`: the waveform's SNR against the reference's, 10 log10(sum ref^2 / sum (ref - x)^2);
- `mel_snr_db`: the same on the log-mel spectrogram (80 bands, 1024-sample windows, hop
  256, log10(mel + 1e-5)), its mean removed from the signal term: how far apart they sound
  rather than how far apart the samples are.
The row "other voice" (the bf16 model, the same text in another voice) is the floor: what
unrelated speech of the same model scores. Greedy runs diverge for good at their first
different token, so agreement falls with length; random weights give near-flat logits whose
argmax any perturbation flips, so these numbers bound from below what real weights give, they
do not predict it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Self

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx
import numpy as np
from bench.weights import TTS_LM_FILE, TTS_TOKENIZER, mimi_weights, tts_weights
from bench_stats import TTS_TEXTS

from moshi_mlx.chat.teacher_forcing import depformer_logits
from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.checkpoints.quantize import quantize_checkpoint
from moshi_mlx.checkpoints.spec import CONFIG_FILE
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.testing.checkpoints import load_lm
from moshi_mlx.tts.conditions import condition_values
from moshi_mlx.tts.synthesizer import (
    DEFAULT_CFG_COEF,
    Speech,
    TtsModel,
    TtsRequest,
)
from moshi_mlx.tts.voices import voice_keys_values

SAMPLE_RATE = 24_000


def mel_filters(bands: int = 80, fft: int = 1024) -> np.ndarray:
    """(bands, fft // 2 + 1) triangular mel filters over 0..12 kHz (HTK mel scale)."""

    def mel(hz):
        return 2595 * np.log10(1 + np.asarray(hz) / 700)

    def hz(m):
        return 700 * (10 ** (np.asarray(m) / 2595) - 1)

    edges = hz(np.linspace(mel(0), mel(SAMPLE_RATE / 2), bands + 2))
    bins = np.linspace(0, SAMPLE_RATE / 2, fft // 2 + 1)
    rising = (bins[None] - edges[:-2, None]) / (edges[1:-1, None] - edges[:-2, None])
    falling = (edges[2:, None] - bins[None]) / (edges[2:, None] - edges[1:-1, None])
    return np.maximum(0, np.minimum(rising, falling))


def log_mel(pcm: np.ndarray, fft: int = 1024, hop: int = 256) -> np.ndarray:
    frames = 1 + (len(pcm) - fft) // hop
    index = np.arange(fft)[None] + hop * np.arange(frames)[:, None]
    spectrum = np.abs(np.fft.rfft(pcm[index] * np.hanning(fft), axis=-1)) ** 2
    return np.log10(spectrum @ mel_filters(fft=fft).T + 1e-5)


def snr_db(reference: np.ndarray, other: np.ndarray, centred: bool = False) -> float:
    signal = reference - reference.mean() if centred else reference
    noise = float(np.sum((reference - other) ** 2))
    return float("inf") if noise == 0 else float(10 * np.log10(np.sum(signal**2) / noise))


def compare(reference: Speech, other: Speech, codebooks: int) -> dict:
    steps = min(len(reference.predicted_tokens), len(other.predicted_tokens))
    text_same = reference.predicted_tokens[:steps] == other.predicted_tokens[:steps]
    ref_codes = reference.audio_codes[:codebooks]
    codes = other.audio_codes[:codebooks]
    frames = min(ref_codes.shape[1], codes.shape[1])
    audio_same = (ref_codes[:, :frames] == codes[:, :frames]).all(axis=0)
    differs = ~text_same.copy()
    differs[len(differs) - frames :] |= ~audio_same  # frame f comes out at step f + max_delay
    samples = min(len(reference.pcm), len(other.pcm))
    ref_pcm, pcm = reference.pcm[:samples], other.pcm[:samples]
    return {
        "text_agree": round(float(text_same.mean()), 3),
        "audio_agree": round(float(audio_same.mean()), 3) if frames else None,
        "first_diff": int(np.argmax(differs)) if differs.any() else None,
        "snr_db": round(snr_db(ref_pcm, pcm), 2),
        "mel_snr_db": round(snr_db(log_mel(ref_pcm), log_mel(pcm), centred=True), 2),
    }


class StepLog:
    """What a run fed its model at every step, recorded with compilation off: the temporal
    transformer's inputs (1, K, 1), and per step with audio the text token the depformer read
    and the codes it sampled."""

    def __init__(self, lm):
        self.inputs: list[mx.array] = []
        self.depformer: dict[int, tuple[mx.array, mx.array]] = {}
        self._lm = lm

    def __enter__(self) -> Self:
        lm, step_text, sample_step = self._lm, self._lm.step_text, self._lm.depformer.sample_step

        def text(tokens, ring, condition=None, cross=None):
            self.inputs.append(tokens)
            return step_text(tokens, ring, condition, cross)

        def audio(temporal_out, text_token, sample_fn, given=None, codebooks=None):
            codes = sample_step(temporal_out, text_token, sample_fn, given, codebooks)
            self.depformer[len(self.inputs) - 1] = (text_token, codes)
            return codes

        lm.step_text, lm.depformer.sample_step = text, audio
        mx.disable_compile()
        return self

    def __exit__(self, *exc) -> None:
        mx.enable_compile()
        del self._lm.step_text, self._lm.depformer.sample_step
        mx.eval(self.inputs, list(self.depformer.values()))


def forced_logits(model: TtsModel, folder: Path, log: StepLog) -> tuple[np.ndarray, np.ndarray]:
    """Text logits (T, text_card) and audio logits (S, n_q, card) of `model` fed the tokens
    the reference run fed (teacher forcing), the codebooks past its `n_q` as "no token" after
    their start tokens (what a run generating `n_q` codebooks feeds); its own voice
    cross-attention and conditions."""
    lm, n_q = model.lm, model.codebooks
    voice = model.voice(folder / "voices" / "voice0.safetensors")
    cross = voice_keys_values(lm, [[voice]])
    condition = lm.condition([condition_values(lm.config, DEFAULT_CFG_COEF)])
    start = lm.config.start_tokens[1]
    ring = lm.make_ring(1)
    text_logits, audio_logits = [], []
    for t, tokens in enumerate(log.inputs):
        skipped = tokens[:, 1 + n_q :]
        tokens = mx.concatenate([tokens[:, : 1 + n_q], mx.where(skipped == start, start, -1)], 1)
        ring = ring.grown(t)
        out, logits = lm.step_text(tokens, ring, condition, cross)
        ring = ring.advanced()
        text_logits.append(logits[0].astype(mx.float32))
        if t in log.depformer:
            text_token, codes = log.depformer[t]
            previous = mx.concatenate([text_token[:, None], codes[:, :-1]], axis=1)
            audio = depformer_logits(lm.depformer, out, previous)[0, :n_q]
            audio_logits.append(audio.astype(mx.float32))
        mx.eval(text_logits[-1], audio_logits[-1:], ring.state)
    return np.array(mx.stack(text_logits)), np.array(mx.stack(audio_logits))


def forced_agreement(reference: tuple, other: tuple) -> dict:
    """Top-1 agreement and relative logit error, teacher forced, text and audio."""
    figures = {}
    for name, ours, theirs in zip(("text", "audio"), other, reference):
        theirs = theirs[..., : ours.shape[-2], :] if name == "audio" else theirs
        same = ours.argmax(-1) == theirs.argmax(-1)
        error = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
        figures[f"forced_{name}_top1"] = round(float(same.mean()), 3)
        figures[f"forced_{name}_err"] = round(float(error), 4)
    return figures


def speak(model: TtsModel, folder: Path, steps: int, voice_index: int = 0) -> Speech:
    text = TTS_TEXTS[0]
    voice = folder / "voices" / f"voice{voice_index}.safetensors"
    request = TtsRequest(text, (voice,))
    [speech] = model.synthesize([request], GREEDY, GREEDY, seed=0, max_steps=steps)
    return speech


def measure(shape: str, weights: Path, steps: int) -> list[dict]:
    folder = tts_weights(weights, shape, voices=2)
    config = LmConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
    codec = SimpleNamespace(model=load_mimi(mimi_weights(weights), config.dep_q))
    tokenizer = load_tokenizer(folder / TTS_TOKENIZER)
    dep_q = config.dep_q
    variants = [("bf16", None, None), ("q8", 8, None), ("q4", 4, None)]
    variants += [(f"n_q {n}", None, n) for n in (3 * dep_q // 4, dep_q // 2)]
    rows, reference, log, reference_logits = [], None, None, None
    with tempfile.TemporaryDirectory() as scratch:
        for label, bits, n_q in variants:
            path = folder / TTS_LM_FILE
            if bits is not None:
                path = Path(scratch) / f"q{bits}.safetensors"
                quantize_checkpoint(folder / TTS_LM_FILE, path, bits, config=config)
            lm = load_lm(path, config, dtype=mx.bfloat16)
            model = TtsModel(lm, codec, tokenizer, files=None, n_q=n_q)
            speech = speak(model, folder, steps)
            if reference is None:
                reference = speech
                with StepLog(lm) as log:
                    speak(model, folder, steps)
                reference_logits = forced_logits(model, folder, log)
                # The floor: the same model and text in another voice, unrelated audio.
                speech, label = speak(model, folder, steps, voice_index=1), "other voice"
            row = {"shape": shape, "variant": label, "steps": steps}
            row.update(compare(reference, speech, model.codebooks))
            if label != "other voice":
                ours = forced_logits(model, folder, log)
                row.update(forced_agreement(reference_logits, ours))
            rows.append(row)
            print(json.dumps(row), flush=True)
            del lm, model
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="tts-tiny,tts-small")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--weights-dir", default="/tmp/moshi_mlx_bench_weights")
    args = parser.parse_args(argv)
    weights = Path(args.weights_dir)
    weights.mkdir(parents=True, exist_ok=True)
    rows = [row for shape in args.shapes.split(",") for row in measure(shape, weights, args.steps)]
    head = "| shape | variant | forced text top-1 | forced audio top-1 | forced logit error "
    head += "(text, audio) | text agree | audio agree | first diff | SNR dB | log-mel SNR dB |"
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        error = f"{r.get('forced_text_err', '-')}, {r.get('forced_audio_err', '-')}"
        cells = [r["shape"], r["variant"], r.get("forced_text_top1", "-")]
        cells += [r.get("forced_audio_top1", "-"), error, r["text_agree"], r["audio_agree"]]
        cells += [r["first_diff"], r["snr_db"], r["mel_snr_db"]]
        print("| " + " | ".join(str(c) for c in cells) + " |")


if __name__ == "__main__":
    main()
