"""Acoustic echo cancellation: WebRTC's AEC3 (through `pywebrtc-audio`) on 10 ms sub-frames.

`EchoCanceller` removes from the microphone what the speaker played (the far end), given both
in step. `PlayedAudio` lines the far end up with the microphone in a live app: it keeps what
the output callback played with the time each block reaches the speaker, and hands out the far
audio that was sounding while a microphone block was captured.

The choice of canceller was measured (`scripts/echo_compare.py`, figures in docs/echo.md).
"""

from __future__ import annotations

import numpy as np

from moshi_mlx.audio import SAMPLE_RATE
from moshi_mlx.errors import AudioError

SUB_FRAME_SECONDS = 0.01  # the canceller's unit: 10 ms
PACKAGE = "pywebrtc-audio"
INSTALL_HINT = (
    f"pip install {PACKAGE} (or turn it off with cancel_echo=False, e.g. with headphones)"
)


def _import_webrtc():
    try:
        import pywebrtc_audio
    except ImportError:
        raise AudioError(f"echo cancellation needs the {PACKAGE} package: {INSTALL_HINT}") from None
    return pywebrtc_audio


class EchoCanceller:
    """WebRTC AEC3 for one microphone: `process(near, far)` returns the near end without the
    echo of the far end. Both are float32 mono at `sample_rate`, the same length, a multiple
    of 10 ms; `far` is what the speaker played while `near` was captured (it may lead the
    echo by up to a few hundred ms: AEC3 finds the delay itself). `denoise` adds WebRTC's
    noise suppression (and `cancel_echo=False` leaves only that). Adds no latency: the output
    is as long as the input, sample for sample.
    """

    def __init__(
        self, sample_rate: int = SAMPLE_RATE, denoise: bool = False, cancel_echo: bool = True
    ):
        webrtc = _import_webrtc()
        self.sample_rate = sample_rate
        self.sub_frame = round(sample_rate * SUB_FRAME_SECONDS)
        self.denoise = denoise
        self.cancel_echo = cancel_echo
        self._processor = webrtc.AudioProcessor(
            sample_rate=sample_rate, echo_cancellation=cancel_echo, noise_suppression=denoise
        )

    def process(self, near: np.ndarray, far: np.ndarray) -> np.ndarray:
        """The echo-cancelled `near` (float32, same length)."""
        near = np.ascontiguousarray(near, dtype=np.float32)
        far = np.ascontiguousarray(far, dtype=np.float32)
        if near.shape != far.shape or near.ndim != 1 or len(near) % self.sub_frame:
            raise AudioError(
                f"echo cancellation takes near and far ends of equal length, a multiple of "
                f"{self.sub_frame} samples; got {near.shape} and {far.shape}"
            )
        out = np.empty_like(near)
        for start in range(0, len(near), self.sub_frame):
            end = start + self.sub_frame
            out[start:end] = self._processor.process(near[start:end], far[start:end])
        return out

    def reset(self) -> None:
        """Forget the learnt echo path (e.g. for a new conversation)."""
        self._processor.reset()


class PlayedAudio:
    """What the speaker played, in the order played, and when each sample sounded.

    The live loop calls `add(block, dac_time)` for every block the output callback played
    (silence included) and `far_for(count, adc_time)` for every microphone block. The far
    block handed out is the one that was sounding while the microphone block was captured, so
    the echo in the microphone follows its reference by the acoustic path only. The offset
    between the two sample clocks comes from the streams' reported times (the input and output
    latencies and the device's queue are in `adc_time` and `dac_time`); it is re-estimated on
    every block and moved when it drifts by more than `tolerance` seconds (a stream restarted,
    a latency changed), never for callback jitter.
    """

    def __init__(
        self, sample_rate: int = SAMPLE_RATE, seconds: float = 4.0, tolerance: float = 0.01
    ):
        self.sample_rate = sample_rate
        self._history = np.zeros(round(seconds * sample_rate), np.float32)
        self._played = 0  # far samples ever played
        self._anchor: tuple[int, float] | None = None  # (far sample index, its DAC time)
        self._mic = 0  # microphone samples ever seen
        self._tolerance = round(tolerance * sample_rate)
        self._estimates: list[int] = []
        self.offset: int | None = None  # mic sample index - far sample index sounding then
        self.moves = 0  # times the offset was moved after the first estimate

    def add(self, block: np.ndarray, dac_time: float) -> None:
        """Keep `block`, played by the speaker from `dac_time` (seconds, monotonic clock)."""
        size = len(self._history)
        block = block[-size:]
        start = self._played % size
        first = min(len(block), size - start)
        self._history[start : start + first] = block[:first]
        self._history[: len(block) - first] = block[first:]
        self._anchor = (self._played, dac_time)
        self._played += len(block)

    def far_for(self, count: int, adc_time: float) -> np.ndarray:
        """The `count` far samples that sounded while the next `count` microphone samples were
        captured, the first of them at `adc_time`; silence where nothing (kept) was playing."""
        if self._anchor is not None:
            index, dac_time = self._anchor
            sounding = index + round((adc_time - dac_time) * self.sample_rate)
            self._track(self._mic - sounding)
        far = np.zeros(count, np.float32)
        if self.offset is not None:
            start = self._mic - self.offset
            size = len(self._history)
            begin, end = max(start, self._played - size), min(start + count, self._played)
            if begin < end:
                far[begin - start : end - start] = self._history[np.arange(begin, end) % size]
        self._mic += count
        return far

    def _track(self, estimate: int) -> None:
        self._estimates = [*self._estimates[-6:], estimate]  # 7: the median is one of them
        median = int(np.median(self._estimates))
        if self.offset is None:
            self.offset = median
        elif abs(median - self.offset) > self._tolerance:
            self.offset = median
            self.moves += 1
