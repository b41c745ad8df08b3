"""Echo cancellers side by side on the simulated echo path of `moshi_mlx.testing.echo_path`.

    python scripts/echo_compare.py                 # every installed candidate, 9 rooms
    python scripts/echo_compare.py --json echo.json

Candidates: `webrtc` (WebRTC AEC3 through pywebrtc-audio: what moshi_mlx uses; `webrtc+ns`
with its noise suppression too, as `--denoise` runs it), `livekit`
(WebRTC's audio processing module through livekit's `rtc.AudioProcessingModule`), `speex`
(SpeexDSP's MDF echo canceller with its residual-echo suppressor, libspeexdsp through
ctypes; Debian: apt install libspeexdsp1, macOS: brew install speexdsp). Each runs on 10 ms
sub-frames at 24 kHz over rooms with a 0.3 s decay, 40/100/200 ms delay and -6/-3/0 dB gain:
far-end espeak-ng speech throughout, near-end speech joining at 5 s, a 40 ms delay jump at
11 s. Figures: see `moshi_mlx.testing.echo_path.grade`. A candidate whose package is not
installed (`pip install livekit`) is skipped with a message.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from moshi_mlx.testing import echo_path
from moshi_mlx.testing.echo_path import BLOCK, RATE

DELAYS = (0.04, 0.1, 0.2)
GAINS = (-6.0, -3.0, 0.0)


def webrtc() -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    from moshi_mlx.audio.echo import EchoCanceller

    return EchoCanceller(RATE).process


def webrtc_denoise() -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    from moshi_mlx.audio.echo import EchoCanceller

    return EchoCanceller(RATE, denoise=True).process


def livekit() -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    from livekit import rtc

    apm = rtc.AudioProcessingModule(echo_cancellation=True, high_pass_filter=True)

    def process(near: np.ndarray, far: np.ndarray) -> np.ndarray:
        far_frame = rtc.AudioFrame(_int16(far).tobytes(), RATE, 1, BLOCK)
        apm.process_reverse_stream(far_frame)
        near_frame = rtc.AudioFrame(_int16(near).tobytes(), RATE, 1, BLOCK)
        apm.process_stream(near_frame)
        return np.frombuffer(near_frame.data, np.int16).astype(np.float32) / 32768

    return process


_SPEEX_ECHO_SET_SAMPLING_RATE = 24  # speex_echo.h
_SPEEX_PREPROCESS_SET_DENOISE = 0  # speex_preprocess.h
_SPEEX_PREPROCESS_SET_ECHO_STATE = 24


def speex(tail_s: float = 0.6) -> Callable[[np.ndarray, np.ndarray], np.ndarray]:
    path = ctypes.util.find_library("speexdsp") or "libspeexdsp.so.1"
    lib = ctypes.CDLL(path)
    lib.speex_echo_state_init.restype = ctypes.c_void_p
    lib.speex_preprocess_state_init.restype = ctypes.c_void_p
    lib.speex_echo_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.speex_preprocess_ctl.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    lib.speex_echo_cancellation.argtypes = [ctypes.c_void_p] + [ctypes.c_void_p] * 3
    lib.speex_preprocess_run.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    echo = lib.speex_echo_state_init(BLOCK, round(tail_s * RATE))
    rate = ctypes.c_int(RATE)
    lib.speex_echo_ctl(echo, _SPEEX_ECHO_SET_SAMPLING_RATE, ctypes.byref(rate))
    pre = lib.speex_preprocess_state_init(BLOCK, RATE)
    lib.speex_preprocess_ctl(pre, _SPEEX_PREPROCESS_SET_ECHO_STATE, ctypes.c_void_p(echo))
    off = ctypes.c_int(0)
    lib.speex_preprocess_ctl(pre, _SPEEX_PREPROCESS_SET_DENOISE, ctypes.byref(off))
    out = np.zeros(BLOCK, np.int16)

    def process(near: np.ndarray, far: np.ndarray) -> np.ndarray:
        near16, far16 = _int16(near), _int16(far)
        lib.speex_echo_cancellation(echo, near16.ctypes.data, far16.ctypes.data, out.ctypes.data)
        lib.speex_preprocess_run(pre, out.ctypes.data)
        return out.astype(np.float32) / 32768

    return process


CANDIDATES = {"webrtc": webrtc, "webrtc+ns": webrtc_denoise, "livekit": livekit, "speex": speex}


def _int16(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.clip(x * 32768, -32768, 32767).astype(np.int16))


def compare(names: list[str]) -> list[dict]:
    far = echo_path.speak(echo_path.FAR_TEXT)
    near = echo_path.speak(echo_path.NEAR_TEXT, voice="en+f3", words_per_minute=170)
    if far is None or near is None:
        sys.exit("espeak-ng is needed (Debian: apt install espeak-ng)")
    rows = []
    for name in names:
        for delay in DELAYS:
            for gain in GAINS:
                scene, jump = echo_path.conversation_scene(far, near, delay, gain)
                try:
                    process = CANDIDATES[name]()
                except (ImportError, OSError) as exc:
                    print(f"{name}: not available ({exc})", file=sys.stderr)
                    break
                out, cpu = echo_path.run_canceller(process, scene)
                row = {"canceller": name, "delay_ms": 1000 * delay, "gain_db": gain}
                row |= {
                    f"figure_{k}": v for k, v in echo_path.grade(scene, out, jump_at=jump).items()
                }
                row["cpu_ms_per_80ms"] = cpu
                rows.append(row)
                print(_format(row), flush=True)
            else:
                continue
            break
    return rows


def _format(row: dict) -> str:
    return (
        f"{row['canceller']:8s} delay {row['delay_ms']:3.0f} ms gain {row['gain_db']:+3.0f} dB: "
        f"ERLE {row['figure_erle_db']:5.1f} dB, double talk {row['figure_double_talk_level_db']:+5.1f} dB "
        f"corr {row['figure_double_talk_correlation']:.2f} at {row['figure_delay_ms']:4.1f} ms, "
        f"after the jump {row['figure_recovery_erle_db']:5.1f} dB, "
        f"CPU {row['cpu_ms_per_80ms']:.2f} ms / 80 ms"
    )


def summary(rows: list[dict]) -> str:
    """Median, worst over the rooms per canceller (worst = min, or max for CPU)."""
    header = "| canceller | ERLE dB | double-talk level dB | double-talk corr | "
    header += "ERLE 2 s after +40 ms dB | CPU ms / 80 ms |"
    lines = [header, "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(row["canceller"] for row in rows):
        mine = [row for row in rows if row["canceller"] == name]

        def cell(key: str, worst=np.min, fmt: str = ".1f", mine: list[dict] = mine) -> str:
            values = [row[key] for row in mine]
            return f"{np.median(values):{fmt}} ({worst(values):{fmt}})"

        lines.append(
            f"| {name} | {cell('figure_erle_db')} | "
            f"{cell('figure_double_talk_level_db')} | "
            f"{cell('figure_double_talk_correlation', fmt='.2f')} | "
            f"{cell('figure_recovery_erle_db')} | {cell('cpu_ms_per_80ms', np.max, '.2f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cancellers", default=",".join(CANDIDATES), help=",".join(CANDIDATES))
    parser.add_argument("--json", type=Path, help="write every row here")
    args = parser.parse_args(argv)
    rows = compare([name for name in args.cancellers.split(",") if name])
    print()
    print(summary(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
