"""A transcript's finished words written as plain text, JSON, SRT or WebVTT subtitles.

JSON schema (`to_json`), times in seconds of the input audio rounded to the millisecond:

    {"text": "the words joined by spaces",
     "words": [{"text": "hello", "start": 0.62, "end": 1.1}, ...]}
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from moshi_mlx.stt.words import Word

CUE_CHARS = 42  # an SRT line's length, the usual subtitle limit
CUE_SECONDS = 5.0  # an SRT cue's longest span (a longer single word keeps its own cue)


def to_text(words: Sequence[Word]) -> str:
    """The words joined by spaces, with a final newline (empty for no words)."""
    return " ".join(word.text for word in words) + "\n" if words else ""


def to_json(words: Sequence[Word]) -> str:
    """The transcript as JSON (schema in this module's docstring), one word a line."""
    text = json.dumps(" ".join(word.text for word in words), ensure_ascii=False)
    entries = [
        json.dumps(
            {"text": word.text, "start": round(word.start, 3), "end": round(word.end, 3)},
            ensure_ascii=False,
        )
        for word in words
    ]
    listed = "".join(f"\n  {entry}," for entry in entries).rstrip(",")
    return f'{{"text": {text},\n "words": [{listed}\n ]}}\n'


def to_srt(
    words: Sequence[Word], max_chars: int = CUE_CHARS, max_seconds: float = CUE_SECONDS
) -> str:
    """SubRip subtitles: cues numbered from 1, one line of at most `max_chars` characters
    spanning at most `max_seconds`, each from its first word's start to its last's end."""
    blocks = []
    for number, cue in enumerate(cues(words, max_chars, max_seconds), start=1):
        span = f"{srt_time(cue[0].start)} --> {srt_time(cue[-1].end)}"
        blocks.append(f"{number}\n{span}\n{' '.join(word.text for word in cue)}\n")
    return "\n".join(blocks)


def to_vtt(
    words: Sequence[Word], max_chars: int = CUE_CHARS, max_seconds: float = CUE_SECONDS
) -> str:
    """WebVTT subtitles: the cues of `to_srt`, under a `WEBVTT` line, times as `HH:MM:SS.mmm`."""
    blocks = ["WEBVTT\n"]
    for cue in cues(words, max_chars, max_seconds):
        span = f"{vtt_time(cue[0].start)} --> {vtt_time(cue[-1].end)}"
        blocks.append(f"{span}\n{' '.join(word.text for word in cue)}\n")
    return "\n".join(blocks)


def vtt_time(seconds: float) -> str:
    """`HH:MM:SS.mmm`, rounded to the millisecond."""
    return srt_time(seconds).replace(",", ".")


def srt_time(seconds: float) -> str:
    """`HH:MM:SS,mmm`, rounded to the millisecond."""
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d},{millis:03d}"


def cues(words: Sequence[Word], max_chars: int, max_seconds: float) -> list[list[Word]]:
    """The words in runs of at most `max_chars` characters (spaces included) spanning at most
    `max_seconds` (a longer single word keeps its own run)."""
    runs: list[list[Word]] = []
    for word in words:
        cue = runs[-1] if runs else None
        if (
            cue is None
            or sum(len(w.text) + 1 for w in cue) + len(word.text) > max_chars
            or word.end - cue[0].start > max_seconds
        ):
            runs.append([word])
        else:
            cue.append(word)
    return runs
