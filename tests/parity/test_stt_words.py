"""WordTimer against the word times Kyutai's own function derives (golden.json, made by
scripts/make_word_time_fixtures.py), and the order in which it reports them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.stt.events import EndOfTurn, WordEnded, WordStarted
from moshi_mlx.stt.words import Word, WordTimer, finished_words

ROOT = Path(__file__).parents[2]
GOLDEN = json.loads((ROOT / "tests/fixtures/stt_words/golden.json").read_text())
CASES = {case["name"]: case for case in GOLDEN["cases"]}
# Kyutai times the stream's last segment in float32 (torch tensors), the others in float64.
TIME_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / GOLDEN["tokenizer"])


def timer_for(tokenizer, case: dict) -> WordTimer:
    return WordTimer(
        tokenizer, audio_delay=case["audio_delay"], silence_prefix=case["silence_prefix"]
    )


def run(timer: WordTimer, tokens: list[int]) -> list[tuple[int, object]]:
    """(step, event) for every event, finish() counted as the step after the last."""
    events = [
        (step, event) for step, token in enumerate(tokens) for event in timer.push(step, token)
    ]
    return events + [(len(tokens), event) for event in timer.finish()]


def ids(tokenizer, pieces: str) -> list[int]:
    marks = {"_": 3, "|": 0}
    return [marks.get(piece, tokenizer.piece_to_id(piece)) for piece in pieces.split()]


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if "words" in case])
def test_words_and_times_equal_kyutais(tokenizer, name):
    case = CASES[name]
    words = finished_words(event for _, event in run(timer_for(tokenizer, case), case["tokens"]))
    # Kyutai keeps a one-word segment's decoded text whole, stray spaces included ("he ").
    expected = [Word(text.strip(), start, end) for text, start, end in case["words"]]
    assert [word.text for word in words] == [word.text for word in expected]
    for word, kyutai in zip(words, expected):
        assert word.start == pytest.approx(kyutai.start, abs=TIME_TOLERANCE), word
        assert word.end == pytest.approx(kyutai.end, abs=TIME_TOLERANCE), word


def test_an_open_last_segment_ends_one_second_after_its_start(tokenizer):
    """Kyutai's function raises here (a float slice bound); we follow what it means to do:
    the segment's tokens within 1 s of its start, ending 1 s after it."""
    case = CASES["stt_2b_last_segment_over_a_second"]
    assert case["kyutai_error"].startswith("TypeError")
    words = finished_words(event for _, event in run(timer_for(tokenizer, case), case["tokens"]))
    segment_start = 54  # the step after the last end-of-padding token
    assert case["tokens"][segment_start - 1] == 0 and 0 not in case["tokens"][segment_start:]
    start = segment_start / 12.5 - 3.5
    assert words == [
        Word("talk", pytest.approx(0.26), pytest.approx(0.74)),
        Word("to", pytest.approx(start), pytest.approx(start + 0.08)),
        Word("moshi", pytest.approx(start + 0.08), pytest.approx(start + 1.0)),
    ]


def test_pieces_past_the_first_second_of_a_last_segment_are_dropped(tokenizer):
    tokens = ids(tokenizer, "| ▁the" + " _" * 12 + " ▁model _ _")
    words = finished_words(
        event for _, event in run(WordTimer(tokenizer, audio_delay=0.0, silence_prefix=0.0), tokens)
    )
    assert words == [Word("the", pytest.approx(0.08), pytest.approx(1.08))]


def test_events_come_when_nothing_later_can_change_them(tokenizer):
    """A word followed by another in its segment is reported at that word's first piece; the
    segment's last word at the next end-of-padding token; each start directly followed by its
    end."""
    tokens = ids(tokenizer, "_ | ▁the ▁model _ _ | ▁you _ _")
    events = run(WordTimer(tokenizer, audio_delay=0.0, silence_prefix=0.0), tokens)
    assert events == [
        (3, WordStarted("the", pytest.approx(0.16))),
        (3, WordEnded(pytest.approx(0.24))),
        (6, WordStarted("model", pytest.approx(0.24))),
        (6, WordEnded(pytest.approx(0.48))),
        (10, WordStarted("you", pytest.approx(0.56))),
        (10, WordEnded(pytest.approx(0.8))),
    ]


def test_a_word_near_the_one_second_mark_waits_for_the_segment_to_close(tokenizer):
    """Past 1 s into a segment a new word may yet be cut off (were the stream to end), so the
    word before it keeps its end open until the segment closes."""
    tokens = ids(tokenizer, "| ▁the" + " _" * 12 + " ▁model _ |")
    events = run(WordTimer(tokenizer, audio_delay=0.0, silence_prefix=0.0), tokens)
    assert [step for step, _ in events] == [16] * 4
    assert finished_words(event for _, event in events) == [
        Word("the", pytest.approx(0.08), pytest.approx(0.16)),
        Word("model", pytest.approx(0.16), pytest.approx(1.28)),
    ]


def test_finish_readies_the_timer_for_another_stream(tokenizer):
    timer = WordTimer(tokenizer, audio_delay=0.0, silence_prefix=0.0)
    tokens = ids(tokenizer, "| ▁you _ _")
    first = run(timer, tokens)
    assert first and run(timer, tokens) == first


def test_steps_must_not_go_back(tokenizer):
    timer = WordTimer(tokenizer, audio_delay=0.0, silence_prefix=0.0)
    timer.push(4, 3)
    with pytest.raises(ValueError, match="step 2 comes after step 4"):
        timer.push(2, 3)


def test_finished_words_pairs_starts_with_ends():
    events = [
        WordStarted("hi", 0.1),
        EndOfTurn(0.3),
        WordEnded(0.4),
        WordEnded(0.5),  # no word open: skipped
        WordStarted("there", 0.6),  # never ended: left out
    ]
    assert finished_words(events) == [Word("hi", 0.1, 0.4)]
