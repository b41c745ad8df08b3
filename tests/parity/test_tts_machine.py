"""The TTS text schedule against Kyutai's `StateMachine` and `script_to_entries` (goldens made
by scripts/make_tts_machine_fixtures.py), speculation, streamed text and refusals."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest

from moshi_mlx.errors import TtsError
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.tts.machine import Entry, TextSchedule, TokenIds, script_to_entries

ROOT = Path(__file__).parents[2]
FIXTURES = ROOT / "tests/fixtures/tts_machine"
SCHEDULES = json.loads((FIXTURES / "schedules.json").read_text())["cases"]
SCRIPTS = json.loads((FIXTURES / "scripts.json").read_text())
IDS = TokenIds(card=8001)
WORD, PAD = 0, 3


def entries_of(case: dict) -> list[Entry]:
    return [Entry(tuple(tokens), text, padding) for tokens, text, padding in case["entries"]]


def schedule_of(case: dict) -> TextSchedule:
    return TextSchedule(
        TokenIds(case["card"]),
        second_stream_ahead=case["second_stream_ahead"],
        max_padding=case["max_padding"],
        initial_padding=case["initial_padding"],
    )


def assert_results_match(schedule: TextSchedule, case: dict) -> None:
    assert schedule.end_step == case["end_step"]
    assert schedule.consumption_times == case["consumption_times"]
    assert schedule.transcript == [tuple(pair) for pair in case["transcript"]]


@pytest.mark.parametrize("case", SCHEDULES, ids=lambda case: case["name"])
def test_all_text_then_close_is_kyutais_schedule(case):
    schedule = schedule_of(case)
    schedule.push(entries_of(case))
    schedule.close()
    for index, token in enumerate(case["tokens"]):
        expected = (case["if_word"][index], case["if_other"][index])
        assert schedule.speculate() == expected, f"step {index}"
        assert schedule.commit(case["first_step"] + index, token) == expected[token != WORD]
        assert not schedule.waiting and not schedule.needs_text
    assert_results_match(schedule, case)


@pytest.mark.parametrize("case", SCHEDULES, ids=lambda case: case["name"])
def test_text_pushed_just_in_time_is_kyutais_schedule(case):
    """Words pushed one by one, each only once the schedule would wait for it."""
    schedule = schedule_of(case)
    pending = entries_of(case)
    for index, token in enumerate(case["tokens"]):
        while schedule.needs_text:
            if not pending:
                schedule.close()
                break
            schedule.push([pending.pop(0)])
        output = schedule.commit(case["first_step"] + index, token)
        assert output == case["if_word" if token == WORD else "if_other"][index], f"step {index}"
        assert not schedule.waiting
    assert_results_match(schedule, case)


@pytest.mark.parametrize("second_stream_ahead", [0, 2])
def test_speculation_changes_nothing_and_agrees_with_commit(second_stream_ahead):
    rng = random.Random(second_stream_ahead)
    schedule = TextSchedule(IDS, second_stream_ahead, max_padding=3, initial_padding=1)
    schedule.push(
        Entry(tuple(rng.randrange(0, 60) for _ in range(rng.randint(0, 4))), f"w{i}", i % 3)
        for i in range(40)
    )
    schedule.close()
    for step in range(200):
        outcomes = schedule.speculate()
        before = copy.deepcopy(schedule.__dict__)
        assert schedule.speculate() == outcomes
        assert schedule.__dict__ == before
        for token, expected in [(WORD, outcomes.word), (PAD, outcomes.other), (57, outcomes.other)]:
            assert copy.deepcopy(schedule).commit(step, token) == expected
        schedule.commit(step, rng.choice([WORD, PAD, 11]))
    assert schedule.end_step is not None


@pytest.mark.parametrize("second_stream_ahead", [0, 2])
def test_an_open_schedule_waits_with_padding_and_never_ends(second_stream_ahead):
    schedule = TextSchedule(IDS, second_stream_ahead, max_padding=2, initial_padding=2)
    silence = PAD  # (-1 + 1) * card + pad when multiplexed
    for step in range(50):
        assert schedule.needs_text
        assert schedule.speculate() == (silence, silence)
        assert schedule.commit(step, WORD if step % 3 else PAD) == silence
        assert schedule.waiting == (step >= 2)  # once the initial padding is over
    assert schedule.end_step is None and not schedule.done(10_000, delay_steps=0)
    assert schedule.consumption_times == [] and schedule.transcript == []


def test_a_late_word_is_taken_at_the_first_step_that_asks_after_it_arrives():
    schedule = TextSchedule(IDS, max_padding=0, initial_padding=0)
    for step in range(5):
        assert schedule.commit(step, PAD) == PAD
    schedule.push([Entry((40, 41), "hi")])
    assert not schedule.needs_text
    assert [schedule.commit(step, PAD) for step in range(5, 8)] == [WORD, 40, 41]
    assert schedule.transcript == [("hi", 5)]
    assert schedule.commit(8, WORD) == PAD and schedule.waiting and schedule.end_step is None
    schedule.close()
    assert schedule.commit(9, WORD) == PAD and not schedule.waiting
    assert schedule.end_step == 9
    assert not schedule.done(9 + 5, delay_steps=2, final_padding=4)
    assert schedule.done(9 + 6, delay_steps=2, final_padding=4)


def test_a_word_waits_for_its_lookahead_word():
    """With the lookahead stream two words ahead, word 1 needs word 3 (pauses not counted)."""
    card = IDS.card
    schedule = TextSchedule(IDS, second_stream_ahead=2, max_padding=0, initial_padding=0)
    schedule.push([Entry((40,), "a"), Entry((50,), "b"), Entry((), "", 0)])
    assert schedule.needs_text
    assert schedule.commit(0, WORD) == PAD and schedule.waiting
    schedule.push([Entry((60, 61), "c")])
    assert not schedule.needs_text
    # The marker on the lookahead stream, the word's first token on the main one.
    assert schedule.commit(1, PAD) == (WORD + 1) * card + 40
    assert schedule.commit(2, PAD) == (60 + 1) * card + PAD
    assert schedule.commit(3, PAD) == (61 + 1) * card + PAD
    assert schedule.needs_text  # word "b" would need a fourth word
    schedule.close()
    assert not schedule.needs_text
    assert schedule.commit(4, PAD) == (WORD + 1) * card + 50
    assert schedule.consumption_times == [1, 4]


def test_a_batch_is_done_when_every_stream_is():
    """Kyutai stops when every stream ended and the step reaches the latest end + the tail."""
    streams = [TextSchedule(IDS, initial_padding=0, max_padding=0) for _ in range(2)]
    streams[0].close()
    streams[1].push([Entry((9,), "x")])
    streams[1].close()
    for step in range(10):
        for stream in streams:
            stream.commit(step, PAD)
        kyutai = (
            all(s.end_step is not None for s in streams)
            and step >= max(s.end_step for s in streams) + 3 + 4
        )
        assert all(s.done(step, delay_steps=3, final_padding=4) for s in streams) == kyutai
    assert [s.end_step for s in streams] == [0, 2]


def test_a_long_text_runs_in_time_linear_in_its_length():
    schedule = TextSchedule(IDS, second_stream_ahead=2)
    schedule.push(Entry((40 + i % 50, 41), f"w{i}", 1) for i in range(3000))
    schedule.close()
    step = 0
    while schedule.end_step is None:
        schedule.commit(step, PAD)
        step += 1
    assert len(schedule.transcript) == 3000 and step < 3000 * 12


def script_id(case: dict) -> str:
    speakers = "multi" if case["multi_speaker"] else "single"
    return f"{case['turns']!r:.40}-{speakers}-pad{case['padding_between']}-{case['frame_rate']}"


@pytest.mark.parametrize("case", SCRIPTS["cases"], ids=script_id)
def test_script_to_entries_is_kyutais(case, tokenizer):
    def entries():
        return script_to_entries(
            tokenizer,
            TokenIds(SCRIPTS["card"]),
            case["frame_rate"],
            case["turns"],
            multi_speaker=case["multi_speaker"],
            padding_between=case["padding_between"],
        )

    if "kyutai_error" in case:
        with pytest.raises(TtsError):
            entries()
    else:
        assert entries() == entries_of(case)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ROOT / SCRIPTS["tokenizer"])


@pytest.mark.parametrize(
    "make",
    [
        lambda: TokenIds(card=3),
        lambda: TokenIds(card=100, pad=0),
        lambda: Entry((1, -4), "x"),
        lambda: Entry((1,), "x", padding=-1),
        lambda: Entry("abc", "x"),
        lambda: Entry((1.5,), "x"),
        lambda: TextSchedule(IDS, max_padding=-1),
        lambda: TextSchedule(IDS).push([Entry((8001,), "x")]),
        lambda: TextSchedule(IDS).push([("x",)]),
    ],
)
def test_bad_input_is_refused_in_one_line(make):
    with pytest.raises(TtsError) as error:
        make()
    assert "\n" not in str(error.value)


def test_bad_use_of_a_schedule_is_refused(tokenizer):
    schedule = TextSchedule(IDS)
    schedule.commit(4, PAD)
    with pytest.raises(TtsError):
        schedule.commit(4, PAD)
    schedule.close()
    with pytest.raises(TtsError):
        schedule.push([Entry((5,), "late")])
    for turns, frame_rate, padding in [("one string", 12.5, 0), ([3], 12.5, 0), (["a"], 0, 0)]:
        with pytest.raises(TtsError):
            script_to_entries(tokenizer, IDS, frame_rate, turns, padding_between=padding)
    with pytest.raises(TtsError):
        script_to_entries(tokenizer, IDS, 12.5, ["a"], padding_between=-1)
