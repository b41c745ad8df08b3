"""Time from a recording to the first audio of its cloned voice, on the tiny TTS checkpoint of
tests/fixtures/tts (float32) with a random full-size Mimi: Mimi's encoding of the recording
(`TtsModel.voice_prefix`), then the steps of `TtsModel.stream(prefix=...)` to its first 80 ms.
Each round runs the prefix's steps as the library does (the depformer skipped while every
codebook it would sample is the prefix's) and, for comparison, with the depformer run at
every step past the audio delay (as before that skip); a warm-up round first.

    python scripts/clone_first_audio.py [--seconds 5] [--rounds 3] [--mimi FILE]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import mlx.core as mx
import numpy as np
import soundfile as sf

from moshi_mlx.testing.checkpoints import write_random_mimi_checkpoint
from moshi_mlx.tts.prefix import AudioPrefixes
from moshi_mlx.tts.synthesizer import TtsModel

TINY_TTS = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "tts"
VOICE = TINY_TTS / "voices" / "alice.safetensors"
TEXT = "Hello there, this is my voice."


def first_audio(model: TtsModel, recording: Path) -> tuple[float, float, int]:
    """(seconds to encode the recording, seconds from then to the first audio, steps run)."""
    start = time.perf_counter()
    prefix = model.voice_prefix(recording)
    encoded = time.perf_counter()
    stream = model.stream(VOICE, prefix=prefix, seed=0)
    stream.push(TEXT)
    stream.close()
    for frame in stream.frames():
        if frame is not None:
            break
    return encoded - start, time.perf_counter() - encoded, stream.run.step_index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="the recording's length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mimi", help="a Mimi file (default: a random full-size one)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        mimi = args.mimi or write_random_mimi_checkpoint(Path(folder) / "mimi.safetensors")
        model = TtsModel.load(
            moshi_weight=TINY_TTS / "weights.safetensors",
            mimi_weight=mimi,
            tokenizer=TINY_TTS / "tokenizer.model",
            lm_config=TINY_TTS / "config.json",
            dtype=mx.float32,
        )
        recording = Path(folder) / "speech.wav"
        t = np.arange(int(args.seconds * 24_000)) / 24_000
        tones = 0.3 * np.sin(2 * np.pi * 180 * t) + 0.1 * np.sin(2 * np.pi * 1250 * t)
        sf.write(str(recording), tones.astype(np.float32), 24_000)
        always = mock.patch.object(AudioPrefixes, "replaced", lambda *_: False)
        first_audio(model, recording)  # warm-up: every compiled step traced
        with always:
            first_audio(model, recording)
        figures: dict[str, list[tuple[float, float, int]]] = {"skipped": [], "run": []}
        for _ in range(args.rounds):
            figures["skipped"].append(first_audio(model, recording))
            with always:
                figures["run"].append(first_audio(model, recording))
    for name, runs in figures.items():
        encode = statistics.median(r[0] for r in runs)
        steps = statistics.median(r[1] for r in runs)
        print(
            f"depformer {name:7} in the prefix: encode {encode:.2f} s, then {runs[0][2]} steps "
            f"to the first audio {steps:.2f} s (median of {len(runs)}; "
            f"{', '.join(f'{r[1]:.2f}' for r in runs)})"
        )


if __name__ == "__main__":
    main()
