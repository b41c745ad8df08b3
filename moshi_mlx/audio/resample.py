"""Rational-ratio resampling with a Kaiser-windowed sinc filter (polyphase, numpy only), of a
whole signal (`resample`) or of one given block by block (`Resampler`), with the same output."""

from __future__ import annotations

from math import gcd

import numpy as np

_HALF_TAPS = 16  # filter half-length, in zero crossings of the narrower band
_KAISER_BETA = 8.0
_CHUNK = 8192  # output samples computed per vectorized block


def _lowpass(up: int, down: int) -> np.ndarray:
    """FIR low-pass at the upsampled rate, cutting at the lower of the two Nyquist rates."""
    band = max(up, down)
    half = _HALF_TAPS * band
    t = np.arange(-half, half + 1, dtype=np.float64)
    taps = np.sinc(t / band) / band * np.kaiser(len(t), _KAISER_BETA)
    return taps * up  # gain `up` makes up for the zeros that upsampling inserts


def resample(pcm: np.ndarray, rate_in: int, rate_out: int) -> np.ndarray:
    """Resample a mono signal from `rate_in` to `rate_out` Hz; output has ceil(n * out / in)."""
    resampler = Resampler(rate_in, rate_out)
    return np.concatenate([resampler.push(pcm), resampler.finish()])


class Resampler:
    """`resample` of a mono signal that comes in blocks: `push` returns the output samples its
    input so far settles, `finish` the rest; together they are `resample` of the whole signal.
    It holds a filter's length of input, so a long file is read at the output's size."""

    def __init__(self, rate_in: int, rate_out: int):
        g = gcd(rate_in, rate_out)
        self._up, self._down = rate_out // g, rate_in // g
        self._same = rate_in == rate_out
        taps = _lowpass(self._up, self._down) if not self._same else np.ones(1)
        self._center = (len(taps) - 1) // 2
        self._per_output = -(-len(taps) // self._up) + 1  # inputs that reach one output
        # Padded so that every (phase, tap) index is in range; padded taps are zero.
        self._taps = np.concatenate([taps, np.zeros(self._per_output * self._up)])
        self._held = np.zeros(0, np.float64)  # inputs still needed, from input `_first` on
        self._first = 0
        self._received = 0
        self._next = 0  # the next output's index

    def push(self, pcm: np.ndarray) -> np.ndarray:
        """Take the next input samples (n,); the output samples (float32) they settle."""
        pcm = np.asarray(pcm, dtype=np.float64)
        if self._same:
            return pcm.astype(np.float32)
        self._held = np.concatenate([self._held, pcm])
        self._received += len(pcm)
        # An output is settled once its newest input, (n * down + center) // up, has come.
        settled = (self._received * self._up - 1 - self._center) // self._down + 1
        return self._outputs(max(self._next, settled))

    def finish(self) -> np.ndarray:
        """The outputs left once the input has ended (the input past its end is silence)."""
        if self._same:
            return np.zeros(0, np.float32)
        return self._outputs(-(-self._received * self._up // self._down))

    def _outputs(self, end: int) -> np.ndarray:
        """Outputs `_next` to `end`, then forget the inputs no later output needs."""
        up, down, held = self._up, self._down, self._held
        out = np.empty(end - self._next, dtype=np.float64)
        j = np.arange(self._per_output)
        source = held if len(held) else np.zeros(1)
        for start in range(self._next, end, _CHUNK):
            n = np.arange(start, min(start + _CHUNK, end))
            pos = n * down + self._center  # in the upsampled signal, shifted by the delay
            last_input = pos // up  # newest input sample whose tap can reach this output
            inputs = last_input[:, None] - j[None, :]  # (n, per_output)
            tap_index = pos[:, None] - inputs * up
            valid = (inputs >= 0) & (inputs < self._received)
            local = np.clip(inputs - self._first, 0, len(source) - 1)
            values = np.where(valid, source[local], 0.0)
            out[start - self._next : start - self._next + len(n)] = np.sum(
                values * self._taps[tap_index], axis=1
            )
        self._next = end
        oldest = (end * down + self._center) // up - (self._per_output - 1)
        if oldest > self._first:
            self._held = held[oldest - self._first :]
            self._first = oldest
        return out.astype(np.float32)
