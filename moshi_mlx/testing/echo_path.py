"""A simulated loudspeaker-to-microphone echo path, and the figures that grade a canceller.

Used by the echo tests and `scripts/bench.py --parts echo`: far-end speech is played "through
a room" (a synthetic impulse response, a delay, a gain and mild loudspeaker clipping) into a
microphone that also picks up the near-end talker, and a canceller's output is graded on

- echo return loss enhancement (ERLE) in far-end-only stretches,
- how much of the near end survives double talk (level and correlation with the clean speech),
- how fast it recovers after the echo path's delay jumps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moshi_mlx.audio import SAMPLE_RATE

RATE = SAMPLE_RATE
BLOCK = RATE // 100  # 10 ms: the unit in which activity and ERLE are measured


def room_impulse_response(
    decay_s: float = 0.3, delay_s: float = 0.1, gain_db: float = -3.0, seed: int = 0
) -> np.ndarray:
    """A direct path after `delay_s`, then exponentially decaying reflections (-60 dB at
    `decay_s`), scaled so the response's energy gain is `gain_db`."""
    rng = np.random.default_rng(seed)
    tail = int(decay_s * RATE)
    envelope = np.exp(-6.9 * np.arange(tail) / tail)  # 6.9 = ln(1000): -60 dB at the end
    reflections = rng.normal(size=tail) * envelope * 0.3
    reflections[0] = 1.0  # the direct path dominates
    response = np.zeros(int(delay_s * RATE) + tail)
    response[-tail:] = reflections
    response *= 10 ** (gain_db / 20) / np.sqrt(np.sum(response**2))
    return response


def play_through_room(far: np.ndarray, response: np.ndarray, clip: float = 0.9) -> np.ndarray:
    """What the microphone hears of `far`: mild loudspeaker clipping (at `clip` of the peak),
    then the room. Same length as `far`."""
    limit = clip * np.max(np.abs(far))
    played = np.clip(far, -limit, limit)
    size = 1 << (len(far) + len(response)).bit_length()
    return np.fft.irfft(np.fft.rfft(played, size) * np.fft.rfft(response, size), size)[: len(far)]


@dataclass
class EchoScene:
    """Signals of one simulated conversation (all float32, same length, 24 kHz)."""

    far: np.ndarray  # what the speaker plays (the canceller's far end)
    echo: np.ndarray  # what the microphone hears of it
    near: np.ndarray  # the local talker at the microphone
    mic: np.ndarray  # echo + near + a little noise (the canceller's near end)

    @classmethod
    def make(
        cls,
        far: np.ndarray,
        near: np.ndarray,
        responses: list[tuple[int, np.ndarray]],
        noise_db: float = -65.0,
        seed: int = 0,
    ) -> EchoScene:
        """Mix `far` through the room `responses` [(start sample, response), ...] (a later
        one replaces the earlier from its start on: a change of delay) with `near`."""
        n = len(far)
        near = np.pad(near, (0, max(0, n - len(near))))[:n]
        echo = np.zeros(n)
        bounds = [start for start, _ in responses[1:]] + [n]
        for (start, response), end in zip(responses, bounds, strict=True):
            # the whole far signal through this room, kept from `start` to the next change
            echo[start:end] = play_through_room(far, response)[start:end]
        noise = np.random.default_rng(seed).normal(size=n) * 10 ** (noise_db / 20)
        mic = echo + near + noise
        return cls(*(x.astype(np.float32) for x in (far, echo, near, mic)))


def _block_power(x: np.ndarray) -> np.ndarray:
    blocks = x[: len(x) // BLOCK * BLOCK].reshape(-1, BLOCK).astype(np.float64)
    return np.mean(blocks**2, axis=1)


def active_blocks(x: np.ndarray, below_peak_db: float = 35.0) -> np.ndarray:
    """Which 10 ms blocks of `x` carry signal (within `below_peak_db` of its loudest block)."""
    power = _block_power(x)
    return power > power.max() * 10 ** (-below_peak_db / 10)


def erle_blocks(mic: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Echo reduction per 10 ms block in dB: mic power over output power."""
    return 10 * np.log10((_block_power(mic) + 1e-12) / (_block_power(out) + 1e-12))


def best_lag(out: np.ndarray, reference: np.ndarray, max_lag: int = RATE // 20) -> int:
    """The lag (samples, 0..max_lag) at which `out` best matches `reference` delayed."""
    size = 1 << (len(out) + len(reference)).bit_length()
    spectrum = np.fft.rfft(out, size) * np.conj(np.fft.rfft(reference, size))
    scores = np.fft.irfft(spectrum, size)[:max_lag]  # scores[lag] = sum out[t + lag] ref[t]
    return int(np.argmax(np.abs(scores)))


def correlation(a: np.ndarray, b: np.ndarray) -> float:
    """Normalised correlation of two equal-length signals."""
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b) + 1e-12))


Canceller = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (near 10 ms, far 10 ms) -> out


def run_canceller(process: Canceller, scene: EchoScene) -> tuple[np.ndarray, float]:
    """Feed `scene` through `process` 10 ms at a time; (output, CPU ms per 80 ms frame)."""
    import time

    n = len(scene.mic) // BLOCK * BLOCK
    out = np.zeros(n, np.float32)
    started = time.process_time()
    for i in range(0, n, BLOCK):
        out[i : i + BLOCK] = process(scene.mic[i : i + BLOCK], scene.far[i : i + BLOCK])
    cpu = time.process_time() - started
    return out, 1000 * cpu / (n / (RATE * 0.08))


def grade(
    scene: EchoScene,
    out: np.ndarray,
    converge_s: float = 2.0,
    jump_at: int | None = None,
    recover_s: float = 2.0,
) -> dict[str, float]:
    """ERLE, double-talk level and correlation, and recovery after `jump_at` (a sample)."""
    n = len(out)
    mic, near, echo = scene.mic[:n], scene.near[:n], scene.echo[:n]
    echo_on, near_on = active_blocks(echo), active_blocks(near)
    start = int(converge_s * RATE / BLOCK)
    blocks = np.arange(len(echo_on))
    far_only = echo_on & ~near_on & (blocks >= start)
    erle = erle_blocks(mic, out)
    figures: dict[str, float] = {}
    stop = len(blocks) if jump_at is None else jump_at // BLOCK
    figures["erle_db"] = float(np.median(erle[far_only & (blocks < stop)]))
    if jump_at is not None:
        after = blocks >= (jump_at // BLOCK + int(recover_s * RATE / BLOCK))
        figures["recovery_erle_db"] = float(np.median(erle[far_only & after]))
    double = echo_on & near_on & (blocks >= start)
    if double.any():
        lag = best_lag(out, near)
        mask = np.repeat(double, BLOCK)
        shifted = out[lag:]
        mask, clean = mask[: len(shifted)], near[: len(shifted)]
        figures["delay_ms"] = 1000 * lag / RATE
        figures["double_talk_correlation"] = correlation(shifted[mask], clean[mask])
        figures["double_talk_level_db"] = float(
            10 * np.log10(np.mean(shifted[mask] ** 2) / np.mean(clean[mask] ** 2))
        )
    return figures


FAR_TEXT = (
    "The weather today is mild with a light breeze from the west. Later this afternoon clouds "
    "will gather over the hills and a little rain may fall in the evening. Tomorrow should be "
    "brighter, with sunshine in the morning and warm temperatures all day long. Remember to "
    "take an umbrella if you go out tonight."
)
NEAR_TEXT = "Hello Moshi, can you hear me? I would like to know about trains to the city."


def speak(text: str, voice: str = "en", words_per_minute: int = 160) -> np.ndarray | None:
    """`text` spoken by espeak-ng, float32 at 24 kHz, peak 0.7; None if espeak-ng is missing."""
    import io
    import shutil
    import subprocess

    import soundfile as sf

    from moshi_mlx.audio.resample import resample

    if shutil.which("espeak-ng") is None:
        return None
    wav = subprocess.run(
        ["espeak-ng", "--stdout", "-v", voice, "-s", str(words_per_minute), text],
        check=True,
        capture_output=True,
    ).stdout
    pcm, rate = sf.read(io.BytesIO(wav), dtype="float32")
    pcm = resample(pcm, rate, RATE)
    return 0.7 * pcm / np.max(np.abs(pcm))


def conversation_scene(
    far: np.ndarray, near: np.ndarray, delay_s: float, gain_db: float, seed: int = 0
) -> tuple[EchoScene, int]:
    """The graded scene, 16 s: the far end talks throughout; the near end joins at 5 s (double
    talk); at 11 s the echo path's delay grows by 40 ms. Returns (scene, jump sample)."""
    n = 16 * RATE
    far = np.pad(far, (0, max(0, n - len(far))))[:n]
    near_track = np.zeros(n, np.float32)
    near = near[: n - 5 * RATE]
    near_track[5 * RATE : 5 * RATE + len(near)] = near
    jump = 11 * RATE
    responses = [
        (0, room_impulse_response(0.3, delay_s, gain_db, seed)),
        (jump, room_impulse_response(0.3, delay_s + 0.04, gain_db, seed)),
    ]
    return EchoScene.make(far, near_track, responses, seed=seed), jump
