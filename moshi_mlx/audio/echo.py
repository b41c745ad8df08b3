"""Acoustic echo cancellation: WebRTC's AEC3 (through `pywebrtc-audio`) on 10 ms sub-frames.

`EchoCanceller` removes from the microphone what the speaker played (the far end), given both
in step. `PlayedAudio` lines the far end up with the microphone in a live app: it keeps what
the output callback played with the time each block reaches the speaker, and hands out the far
audio that was sounding while a microphone block was captured.

The choice of canceller was measured (`scripts/echo_compare.py`, figures in docs/echo.md).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from moshi_mlx.audio import SAMPLE_RATE
from moshi_mlx.errors import AudioError, Setting

SUB_FRAME_SECONDS = 0.01  # the canceller's unit: 10 ms
_SETTLE_TOLERANCE = 0.01  # seconds the offset may be off while the first estimates come in
_ANCHORS = 256  # played blocks whose times are kept to line the microphone up with
PACKAGE = "pywebrtc-audio"
INSTALL_HINT = (  # message parts
    f"pip install {PACKAGE} (or turn it off with ",
    Setting("cancel_echo", False),
    ", e.g. with headphones)",
)


def _import_webrtc():
    try:
        import pywebrtc_audio
    except ImportError:
        raise AudioError(
            f"echo cancellation needs the {PACKAGE} package: ", *INSTALL_HINT
        ) from None
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
    """What the speaker played and what the microphone captured, on one sample timeline.

    The live loop calls `add(block, dac_time)` for every block the output callback played
    (silence included) and `far_for(count, adc_time)` for every microphone block. The far
    block handed out is the one that was sounding while the microphone block was captured, so
    the echo in the microphone follows its reference by the acoustic path only.

    Both sound cards count samples; their times only say how the two counts line up. A block
    due at the speaker half a block or more later than the previous one ended follows a stall
    of the output (the device played silence that no callback handed it): that silence goes
    into the far history. A microphone block captured that late follows lost microphone
    audio: the microphone count skips it. With the gaps filled, the offset between the counts
    holds; it is estimated on every block and moved only when the median of the last `window`
    estimates is off by more than `tolerance` seconds (a device whose latency changed), never
    for the jitter of the reported times (tens of ms through PulseAudio). `adc_time` and
    `dac_time` should be the devices' own times (PortAudio's `inputBufferAdcTime` and
    `outputBufferDacTime`): callback times bunch up after a stall.
    """

    def __init__(
        self,
        sample_rate: int = SAMPLE_RATE,
        seconds: float = 4.0,
        tolerance: float = 0.1,
        window: int = 7,
    ):
        self.sample_rate = sample_rate
        self._history = np.zeros(round(seconds * sample_rate), np.float32)
        self._played = 0  # far samples on the timeline: played, and the silence of stalls
        # (first far sample index, its DAC time, when its output callback ran) per block
        self._anchors: deque[tuple[int, float, float]] = deque(maxlen=_ANCHORS)
        self._mic = 0  # microphone samples on the timeline: captured, and those lost
        self._mic_anchor: tuple[int, float] | None = None  # (mic sample index, its ADC time)
        self._tolerance = round(tolerance * sample_rate)
        self._settle = round(_SETTLE_TOLERANCE * sample_rate)
        self._estimates: deque[int] = deque(maxlen=window)  # odd: the median is one of them
        self.offset: int | None = None  # mic sample index - far sample index sounding then
        self.moves = 0  # times the offset was moved after the first estimate
        self.output_gaps = 0  # stalls of the output filled with silence
        self.input_gaps = 0  # stretches of lost microphone audio skipped
        self.unplayed = 0  # far samples asked for before they were played (silence instead)

    def add(
        self, block: np.ndarray, dac_time: float, called: float | None = None, exact: bool = True
    ) -> None:
        """Keep `block`, played by the speaker from `dac_time` (seconds, monotonic clock),
        handed over by an output callback at `called` (default `dac_time`). `exact=False`:
        `dac_time` comes from the callback's time, which jitters, so no stall is inferred."""
        last = self._anchors[-1][:2] if self._anchors and exact else None
        late = _late(last, self._played, dac_time, len(block), self.sample_rate)
        if late:
            self._write(np.zeros(min(late, len(self._history)), np.float32))
            self._played += late - min(late, len(self._history))
            self.output_gaps += 1
        self._anchors.append((self._played, dac_time, dac_time if called is None else called))
        self._write(block)

    def _write(self, block: np.ndarray) -> None:
        size = len(self._history)
        start = self._played % size
        kept = block[-size:]
        first = min(len(kept), size - start)
        self._history[start : start + first] = kept[:first]
        self._history[: len(kept) - first] = kept[first:]
        self._played += len(block)

    def far_for(
        self, count: int, adc_time: float, called: float | None = None, exact: bool = True
    ) -> np.ndarray:
        """The `count` far samples that sounded while the next `count` microphone samples were
        captured, the first of them at `adc_time`; silence where nothing (kept) was playing.
        `called`: when the input callback handed the block over (default `adc_time`).
        `exact=False`: `adc_time` comes from the callback's time; no lost audio is inferred."""
        anchor = self._mic_anchor if exact else None
        if late := _late(anchor, self._mic, adc_time, count, self.sample_rate):
            self._mic += late
            self.input_gaps += 1
        self._mic_anchor = (self._mic, adc_time)
        if self._anchors:
            index, dac_time = self._anchor_by(adc_time if called is None else called)
            sounding = index + round((adc_time - dac_time) * self.sample_rate)
            self._track(self._mic - sounding)
        far = np.zeros(count, np.float32)
        if self.offset is not None:
            start = self._mic - self.offset
            self.unplayed += min(count, max(0, start + count - self._played))
            size = len(self._history)
            begin, end = max(start, self._played - size), min(start + count, self._played)
            if begin < end:
                far[begin - start : end - start] = self._history[np.arange(begin, end) % size]
        self._mic += count
        return far

    def _anchor_by(self, called: float) -> tuple[int, float]:
        """The last far block handed over by `called` (else the first kept): its times and
        the microphone block's come from callbacks next to each other, so that the estimate
        holds even where the times are the callbacks' own and they bunch up after a stall."""
        for index, dac_time, handed in reversed(self._anchors):
            if handed <= called:
                return index, dac_time
        return self._anchors[0][:2]

    def _track(self, estimate: int) -> None:
        self._estimates.append(estimate)
        median = int(np.median(self._estimates))
        settling = len(self._estimates) < self._estimates.maxlen
        if self.offset is None or (settling and abs(median - self.offset) > self._settle):
            self.offset = median  # the first blocks: the median so far, off by 10 ms at most
        elif not settling and abs(median - self.offset) > self._tolerance:
            self.offset = median
            self.moves += 1


def _late(
    anchor: tuple[int, float] | None, count: int, time: float, block: int, sample_rate: int
) -> int:
    """Samples missing before a block starting at `time` on a timeline of `count` samples
    whose sample `anchor[0]` was at `anchor[1]`: a gap of half a `block` or more, else 0."""
    if anchor is None:
        return 0
    index, anchor_time = anchor
    late = round((time - anchor_time) * sample_rate) - (count - index)
    return late if 2 * late >= block else 0
