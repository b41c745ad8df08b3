"""The transcript writers: plain text, JSON schema, SRT read back."""

from __future__ import annotations

import json
import re

from moshi_mlx.stt.transcript import srt_time, to_json, to_srt, to_text
from moshi_mlx.stt.words import Word

WORDS = [
    Word("the", 0.22, 0.54),
    Word("quick", 0.62, 1.1),
    Word("brown", 1.18, 1.82),
    Word("fox", 1.9000000000000001, 2.3),
    Word("jumps", 2.38, 2.86),
    Word("over", 2.94, 3.3),
    Word("the", 3.38, 3.54),
    Word("lazy", 3.62, 4.1),
    Word("dog", 4.18, 9.5),
    Word("after", 9.58, 10.02),
    Word("midnight", 3661.5, 3662.0),
]

SRT_CUE = re.compile(
    r"(\d+)\n(\d\d):(\d\d):(\d\d),(\d\d\d) --> (\d\d):(\d\d):(\d\d),(\d\d\d)\n([^\n]+)\n"
)


def seconds(hours: str, minutes: str, secs: str, millis: str) -> float:
    return int(hours) * 3600 + int(minutes) * 60 + int(secs) + int(millis) / 1000


def read_srt(text: str) -> list[tuple[int, float, float, str]]:
    blocks = text.split("\n\n")
    cues = []
    for block in blocks:
        match = SRT_CUE.fullmatch(block if block.endswith("\n") else block + "\n")
        assert match, block
        number, *times, line = match.groups()
        cues.append((int(number), seconds(*times[:4]), seconds(*times[4:]), line))
    return cues


def test_text_is_the_words_joined():
    assert to_text(WORDS[:3]) == "the quick brown\n"
    assert to_text([]) == ""


def test_json_schema():
    document = json.loads(to_json(WORDS))
    assert set(document) == {"text", "words"}
    assert document["text"] == " ".join(word.text for word in WORDS)
    assert document["words"][3] == {"text": "fox", "start": 1.9, "end": 2.3}
    assert [Word(**word) for word in document["words"]] == [
        Word(word.text, round(word.start, 3), round(word.end, 3)) for word in WORDS
    ]
    assert json.loads(to_json([])) == {"text": "", "words": []}
    french = json.loads(to_json([Word('"ça"', 0.0, 0.08)]))
    assert french == {"text": '"ça"', "words": [{"text": '"ça"', "start": 0.0, "end": 0.08}]}


def test_srt_reads_back_as_the_words_in_short_cues():
    cues = read_srt(to_srt(WORDS, max_chars=20, max_seconds=5.0))
    assert [number for number, *_ in cues] == list(range(1, len(cues) + 1))
    assert " ".join(line for *_, line in cues) == to_text(WORDS).strip()
    assert all(len(line) <= 20 for *_, line in cues)
    assert cues[0] == (1, 0.22, 2.3, "the quick brown fox")
    assert cues[-1] == (len(cues), 3661.5, 3662.0, "midnight")
    for (_, start, end, line), next_cue in zip(cues, cues[1:] + [None]):
        assert start <= end and (next_cue is None or end <= next_cue[1])
        assert end - start <= 5.0 or " " not in line  # only a lone word outlasts a cue


def test_a_word_ending_late_starts_its_own_cue():
    cues = read_srt(to_srt(WORDS[6:10]))
    assert [line for *_, line in cues] == ["the lazy", "dog", "after"]


def test_srt_time():
    assert srt_time(0.0) == "00:00:00,000"
    assert srt_time(0.5399999) == "00:00:00,540"
    assert srt_time(3661.0) == "01:01:01,000"
    assert srt_time(36000.999) == "10:00:00,999"
