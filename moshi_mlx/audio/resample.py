"""Rational-ratio resampling with a Kaiser-windowed sinc filter (polyphase, numpy only)."""

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
    pcm = np.asarray(pcm, dtype=np.float64)
    if rate_in == rate_out:
        return pcm.astype(np.float32)
    g = gcd(rate_in, rate_out)
    up, down = rate_out // g, rate_in // g
    taps = _lowpass(up, down)
    center = (len(taps) - 1) // 2
    taps_per_output = -(-len(taps) // up) + 1
    # Pad the filter so every (phase, tap) index below is in range; padded taps are zero.
    taps = np.concatenate([taps, np.zeros(taps_per_output * up)])
    pad = taps_per_output
    padded = np.concatenate([np.zeros(pad), pcm, np.zeros(pad)])

    n_out = -(-len(pcm) * up // down)
    out = np.empty(n_out, dtype=np.float64)
    j = np.arange(taps_per_output)
    for start in range(0, n_out, _CHUNK):
        n = np.arange(start, min(start + _CHUNK, n_out))
        pos = n * down + center  # position in the upsampled signal, shifted by the filter delay
        last_input = pos // up  # newest input sample whose tap can reach this output
        inputs = last_input[:, None] - j[None, :]  # (n, taps_per_output)
        tap_index = pos[:, None] - inputs * up
        valid = (inputs >= 0) & (inputs < len(pcm))
        values = np.where(valid, padded[np.clip(inputs, -pad, len(pcm) + pad - 1) + pad], 0.0)
        out[start : start + len(n)] = np.sum(values * taps[tap_index], axis=1)
    return out.astype(np.float32)
