"""The real-time loop between sound-card callbacks and the model.

The two callbacks only copy frames in and out of preallocated `FrameQueue`s, log their times
and poke the worker through a non-blocking pipe. The worker thread runs the model on mic
frames in order; when it falls more than `max_lag_frames` behind it drops the oldest mic
frames, so the conversation never drifts further behind real time.

With an `EchoCanceller` that cancels echo, the output callback also copies what it played
into a third queue; the worker lines that far end up with each mic frame (`PlayedAudio`) and
removes its echo, 10 ms at a time, before the model hears the frame (dropped frames too, so
the canceller sees the microphone without gaps). Both queues carry the devices' own times of
each block (PortAudio's ADC and DAC times), which stay right when a stalled process gets its
callbacks in a burst. Noise suppression alone keeps no far end.

Latency of a frame: from the moment its mic block reached the app to the moment the reply
block computed from it reaches the speaker (the output callback time plus the device's output
latency). It excludes Moshi's own 80-160 ms of model delay (the codebook delays).
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from moshi_mlx.audio import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.audio.echo import EchoCanceller, PlayedAudio
from moshi_mlx.audio.frame_queue import FrameQueue, StampLog

StepFn = Callable[[np.ndarray], tuple[np.ndarray, str]]
_MAX_SPEAKER_BACKLOG = 2  # replies waiting at an output callback: the due one + one of slack
_MAX_LOGGED = 1 << 16  # callback times kept for the summary (~87 minutes of frames)
_PLAYED_FRAMES = 64  # played blocks waiting for the canceller: 5 s, more than any model step
_MIC_FRAMES = 64  # mic blocks the mic queue holds: 5 s, so a slow model step loses none
_FAR_LEAD = 0.06  # seconds by which the far end handed out is ahead of the mic's capture time


class Wakeup:
    """A self-pipe: `notify()` never blocks (safe in a callback); `wait()` sleeps until poked."""

    def __init__(self):
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)

    def notify(self) -> None:
        try:
            os.write(self._write_fd, b"\0")
        except OSError:  # pipe full (the worker is already due to wake) or closed
            pass

    def wait(self, timeout: float) -> None:
        ready, _, _ = select.select([self._read_fd], [], [], timeout)
        if ready:
            try:
                os.read(self._read_fd, 4096)
            except OSError:
                pass

    def close(self) -> None:
        os.close(self._read_fd)
        os.close(self._write_fd)


def _device_moment(now: float, time_info, field: str) -> float:
    """When a callback's block is at the device (its first sample captured by the microphone,
    or due at the speaker) on the `time.monotonic()` clock of `now`, the callback's time:
    PortAudio's `field` of `time_info` (its ADC or DAC time) relative to its `currentTime`;
    NaN where the host API reports no times. These stay right when callbacks bunch up after
    a stall; a callback's own time does not."""
    device = getattr(time_info, field, 0.0)
    current = getattr(time_info, "currentTime", 0.0)
    return now + (device - current) if device and current else math.nan


def _ms(seconds: np.ndarray, reduce) -> float:
    """`reduce(seconds)` in milliseconds, 0 for no values."""
    return float(reduce(seconds) * 1000) if len(seconds) else 0.0


@dataclass
class LiveStats:
    """What a live session measured; `summary()` is the line printed at exit."""

    input_times: np.ndarray
    output_times: np.ndarray
    latencies: np.ndarray  # seconds, one per reply frame played
    step_times: np.ndarray  # seconds per model step
    mic_waits: np.ndarray  # seconds each processed mic frame waited for the model
    dropped_frames: int
    lag_events: int
    mic_overflows: int
    speaker_underruns: int
    speaker_dropped: int  # late replies skipped so the speaker does not fall behind
    extra: dict = field(default_factory=dict)

    @staticmethod
    def _rate(times: np.ndarray) -> float:
        if len(times) < 2 or times[-1] <= times[0]:
            return 0.0
        return (len(times) - 1) / float(times[-1] - times[0])

    def as_dict(self) -> dict:
        lat = self.latencies * 1000
        return {
            "input_callbacks": len(self.input_times),
            "output_callbacks": len(self.output_times),
            "input_rate_hz": self._rate(self.input_times),
            "output_rate_hz": self._rate(self.output_times),
            "input_times": self.input_times.tolist(),
            "output_times": self.output_times.tolist(),
            "steps": len(self.step_times),
            "step_ms_mean": _ms(self.step_times, np.mean),
            "step_ms_max": _ms(self.step_times, np.max),
            "mic_wait_ms_max": _ms(self.mic_waits, np.max),
            "latencies_ms": lat.tolist(),
            "latency_ms_median": float(np.median(lat)) if len(lat) else None,
            "latency_ms_p90": float(np.percentile(lat, 90)) if len(lat) else None,
            "dropped_frames": self.dropped_frames,
            "lag_events": self.lag_events,
            "mic_overflows": self.mic_overflows,
            "speaker_underruns": self.speaker_underruns,
            "speaker_dropped": self.speaker_dropped,
            **self.extra,
        }

    def summary(self) -> str:
        d = self.as_dict()
        latency = (
            f"latency median {d['latency_ms_median']:.0f} ms, p90 {d['latency_ms_p90']:.0f} ms"
            if d["latency_ms_median"] is not None
            else "no reply played"
        )
        return (
            f"{d['input_callbacks']} mic blocks ({d['input_rate_hz']:.1f}/s), "
            f"{d['output_callbacks']} speaker blocks ({d['output_rate_hz']:.1f}/s), "
            f"{d['steps']} model steps ({d['step_ms_mean']:.0f} ms each), {latency}, "
            f"{d['dropped_frames']} mic frames dropped for lag"
        )


def frames_to_drop(backlog: int, max_lag_frames: int) -> int:
    """The lag policy of every live conversation (terminal and web): with more than
    `max_lag_frames` mic frames waiting, all but the newest are dropped, so that Moshi answers
    what the user says now; otherwise none."""
    return backlog - 1 if backlog > max_lag_frames else 0


class LiveLoop:
    """Callbacks + worker for one live conversation.

    `step` turns a mic frame into (reply frame, text). `on_text` receives new text,
    `on_frames(mic, reply)` every mic frame as the model heard it (after echo cancellation;
    reply is silence for dropped frames) and `on_status` short messages (lag, latency); they
    run on the worker thread. Set `input_latency` and `output_latency` (seconds, as the
    streams report them) before the streams start: `echo` lines the far end up with them.
    """

    def __init__(
        self,
        step: StepFn,
        frame_size: int = FRAME_SIZE,
        sample_rate: int = SAMPLE_RATE,
        max_lag_frames: int = 3,
        on_text: Callable[[str], None] | None = None,
        on_frames: Callable[[np.ndarray, np.ndarray], None] | None = None,
        on_status: Callable[[str], None] | None = None,
        status_every: float = 5.0,
        echo: EchoCanceller | None = None,
    ):
        self._step = step
        self.frame_size = frame_size
        self.frame_seconds = frame_size / sample_rate
        self.max_lag_frames = max_lag_frames
        self._on_text = on_text or (lambda text: None)
        self._on_frames = on_frames or (lambda mic, reply: None)
        self._on_status = on_status or (lambda message: None)
        self._status_every = status_every
        # Enough room for a burst of late callbacks; the worker trims the backlog itself.
        self.mic = FrameQueue(max(_MIC_FRAMES, 4 * max_lag_frames), frame_size)
        self.speaker = FrameQueue(16, frame_size)
        self._reply = np.zeros(frame_size, dtype=np.float32)  # output-callback scratch
        self._input_log = StampLog(_MAX_LOGGED)
        self._output_log = StampLog(_MAX_LOGGED)
        self._latency_log = StampLog(_MAX_LOGGED)
        self._step_times: list[float] = []
        self._mic_waits: list[float] = []
        self.dropped_frames = 0
        self.lag_events = 0
        self.speaker_underruns = 0
        self.speaker_dropped = 0
        self._replies_started = False
        self.output_latency = 0.0  # seconds from an output callback to the speaker
        self.input_latency = 0.0  # seconds from the microphone to an input callback
        self._echo = echo
        # The far end is kept only to cancel echo (noise suppression alone does not read it).
        cancels_echo = echo is not None and echo.cancel_echo
        self.played = FrameQueue(_PLAYED_FRAMES, frame_size) if cancels_echo else None
        self.far_end = PlayedAudio(sample_rate) if cancels_echo else None
        self._far_block = np.zeros(frame_size, dtype=np.float32)  # stays silent without it
        self.device_input_flags = 0  # callbacks whose status reported an overflow/underflow
        self.device_output_flags = 0
        self._wakeup = Wakeup()
        self.stop_event = threading.Event()
        self.error: BaseException | None = None

    # --- audio callbacks: copy, log, poke; nothing that can block, allocate much or raise ---
    def input_callback(self, indata, frames, time_info, status) -> None:
        now = time.monotonic()
        self._input_log.append(now)
        if status:
            self.device_input_flags += 1
        self.mic.push(indata[:, 0], now, _device_moment(now, time_info, "inputBufferAdcTime"))
        self._wakeup.notify()

    def output_callback(self, outdata, frames, time_info, status) -> None:
        now = time.monotonic()
        self._output_log.append(now)
        if status:
            self.device_output_flags += 1
        # After an underrun, replies queue up one block later than before; left alone, every
        # hiccup of the model would add a block of latency for the rest of the conversation.
        # Keep at most one block of slack: skip the oldest replies beyond it.
        backlog = len(self.speaker)
        if backlog > _MAX_SPEAKER_BACKLOG:
            self.speaker_dropped += self.speaker.drop_oldest(backlog - _MAX_SPEAKER_BACKLOG)
        stamp = self.speaker.pop_into(self._reply)
        if stamp is None:
            outdata.fill(0)
            if self._replies_started:
                self.speaker_underruns += 1
        else:
            self._replies_started = True
            n = min(frames, self.frame_size)
            for channel in range(outdata.shape[1]):
                outdata[:n, channel] = self._reply[:n]
            outdata[n:] = 0
            self._latency_log.append(now + self.output_latency - stamp)
        if self.played is not None:  # the far end: exactly what was played, silence included
            sounds = _device_moment(now, time_info, "outputBufferDacTime")
            self.played.push(outdata[:, 0], now, sounds)

    # --- worker -------------------------------------------------------------------------
    def run(self) -> None:
        """The worker thread's body: runs until `stop_event` is set or the model fails."""
        try:
            self._work()
        except Exception as exc:  # noqa: BLE001 - handed to the main thread, which re-raises it
            self.error = exc
            self.stop_event.set()

    def _work(self) -> None:
        frame = np.zeros(self.frame_size, dtype=np.float32)
        silence = np.zeros(self.frame_size, dtype=np.float32)
        last_status = last_lag_message = time.monotonic()
        dropped_since_message = 0
        while not self.stop_event.is_set():
            backlog = len(self.mic)
            if backlog == 0:
                self._wakeup.wait(0.1)
                continue
            if dropped := frames_to_drop(backlog, self.max_lag_frames):
                self.lag_events += 1
                for _ in range(dropped):
                    self._cancel_echo(frame, *self.mic.pop_timed(frame))
                    self._on_frames(frame, silence)
                self.dropped_frames += dropped
                dropped_since_message += dropped
                now = time.monotonic()
                if now - last_lag_message >= 1.0:
                    self._on_status(
                        f"lag: the model is slower than real time; dropped "
                        f"{dropped_since_message} mic frames "
                        f"({dropped_since_message * self.frame_seconds:.2f} s) to catch up"
                    )
                    last_lag_message, dropped_since_message = now, 0
            stamp, captured = self.mic.pop_timed(frame)
            self._cancel_echo(frame, stamp, captured)
            started = time.monotonic()
            reply, text = self._step(frame)
            self._step_times.append(time.monotonic() - started)
            self._mic_waits.append(started - stamp)
            reply = np.clip(np.nan_to_num(reply), -1.0, 1.0)
            self.speaker.push(reply, stamp)
            self._on_frames(frame, reply)
            if text:
                self._on_text(text)
            now = time.monotonic()
            if now - last_status >= self._status_every:
                self._on_status(self._live_status())
                last_status = now

    def _cancel_echo(self, frame: np.ndarray, stamp: float, captured: float) -> None:
        """Remove from `frame` (in place), handed over by the input callback at `stamp`, its
        first sample captured at `captured` (NaN: unknown), the echo of what the speaker
        played meanwhile."""
        if self._echo is None:
            return
        if self.far_end is None:
            frame[:] = self._echo.process(frame, self._far_block)
            return
        while (times := self.played.pop_timed(self._far_block)) is not None:
            called, sounds = times
            exact = not math.isnan(sounds)  # else the callback's time + the stream's latency
            sounds = sounds if exact else called + self.output_latency
            self.far_end.add(self._far_block, sounds, called=called, exact=exact)
        exact = not math.isnan(captured)  # else: the last sample `input_latency` before now
        if not exact:
            captured = stamp - self.input_latency - self.frame_seconds
        # AEC3 needs the far end to lead its echo (a delay > 0: at 0 it locks on or not by
        # chance, below it cancels nothing). The far audio sounding at the capture time leads
        # by the acoustic path only, a few ms, which the devices' times may be off by: hand
        # out what sounded up to `_FAR_LEAD` later (AEC3 finds delays up to ~0.5 s itself).
        # No more than the two latencies: the output callbacks, a block ahead of the speaker,
        # have handed that audio over before the worker gets here.
        lead = min(_FAR_LEAD, self.input_latency + self.output_latency)
        far = self.far_end.far_for(self.frame_size, captured + lead, called=stamp, exact=exact)
        frame[:] = self._echo.process(frame, far)

    def _live_status(self) -> str:
        frames = max(1, int(self._status_every / self.frame_seconds))
        recent = self._latency_log.values()[-frames:]
        steps = self._step_times[-frames:]
        latency = f"{np.median(recent) * 1000:.0f} ms" if len(recent) else "-"
        return (
            f"latency {latency} (median, last {self._status_every:g} s), model step "
            f"{np.mean(steps) * 1000:.0f} ms, {self.dropped_frames} mic frames dropped so far"
        )

    def stats(self, **extra) -> LiveStats:
        """Everything measured so far."""
        if self.far_end is not None:
            extra["echo_offset_moves"] = self.far_end.moves
            extra["echo_far_overflows"] = self.played.overflows
            extra["echo_output_gaps"] = self.far_end.output_gaps
            extra["echo_input_gaps"] = self.far_end.input_gaps
            extra["echo_far_unplayed"] = self.far_end.unplayed
        extra["device_input_flags"] = self.device_input_flags
        extra["device_output_flags"] = self.device_output_flags
        return LiveStats(
            input_times=self._input_log.values(),
            output_times=self._output_log.values(),
            latencies=self._latency_log.values(),
            step_times=np.array(self._step_times),
            mic_waits=np.array(self._mic_waits),
            dropped_frames=self.dropped_frames,
            lag_events=self.lag_events,
            mic_overflows=self.mic.overflows,
            speaker_underruns=self.speaker_underruns,
            speaker_dropped=self.speaker_dropped,
            extra=extra,
        )

    def close(self) -> None:
        self._wakeup.close()
