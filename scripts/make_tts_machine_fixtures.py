"""Golden text schedules from Kyutai's TTS state machine, for tests/parity/test_tts_machine.py.

Run with the reference environment (torch + Kyutai's `moshi` 0.2.13 + sentencepiece), from
the repository root:

    /opt/venvs/ref/bin/python scripts/make_tts_machine_fixtures.py

It writes two files under tests/fixtures/tts_machine/:

- schedules.json: {"cases": [...]}, random runs of `StateMachine.process` (random entries,
  pauses and paddings, `second_stream_ahead` 0 or 2 (a few 1 or 3), random `max_padding` and
  `initial_padding`, random predictions, other tokens than new_word and pad among them, for
  a few hundred steps, past the end), each case:
  {"name", "card", "second_stream_ahead", "max_padding", "initial_padding",
   "entries": [[tokens, text, padding], ...], "first_step",
   "tokens": the prediction given at each step (steps first_step, first_step + 1, ...),
   "if_word", "if_other": what `process` returned at each step for the prediction new_word
       and pad (each on a copy of the state; the real prediction's equals its own branch),
   "end_step", "consumption_times", "transcript": [[word, step], ...]  (after the last step)}
- scripts.json: {"tokenizer": "tests/fixtures/stt/tokenizer.model", "card", "cases": [...]},
  Kyutai's `script_to_entries` on varied scripts, each case:
  {"turns", "frame_rate", "multi_speaker", "padding_between",
   "entries": [[tokens, text, padding], ...]  or  "kyutai_error": "ValueError: ..."}
"""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

from moshi.models.tts import Entry, StateMachine, TokenIds, script_to_entries
from sentencepiece import SentencePieceProcessor

OUT = Path("tests/fixtures/tts_machine")
TOKENIZER = "tests/fixtures/stt/tokenizer.model"
SEED = 1234
NEW_WORD, PAD = 0, 3


def random_entries(rng: random.Random, card: int) -> list[Entry]:
    entries = []
    for index in range(rng.choice([0, 1, 3, 8, 15, 25, 35])):
        padding = rng.choice([0, 0, 0, 1, 2, 4])
        if rng.random() < 0.2:
            entries.append(Entry(tokens=[], text="", padding=rng.choice([0, 1, 3, 6])))
            continue
        # Mostly plain tokens; a few of the special values (0 is new_word, 3 is pad).
        tokens = [
            rng.choice([0, 1, 2, 3]) if rng.random() < 0.08 else rng.randrange(4, card)
            for _ in range(rng.randint(1, 5))
        ]
        entries.append(Entry(tokens=tokens, text=f"w{index}", padding=padding))
    return entries


def random_prediction(rng: random.Random, card: int, p_word: float) -> int:
    if rng.random() < p_word:
        return NEW_WORD
    if rng.random() < 0.7:
        return PAD
    return rng.choice([-2, -1, 1, 2, rng.randrange(4, card), card, card + 7])


def schedule_case(rng: random.Random, index: int) -> dict:
    card = rng.choice([101, 8001])
    ahead = rng.choice([0, 0, 2, 2, 2, 1, 3]) if index % 2 else rng.choice([0, 2])
    max_padding = rng.randint(0, 10)
    initial_padding = rng.randint(0, 4)
    entries = random_entries(rng, card)
    p_word = rng.choice([0.05, 0.2, 0.5, 0.9])
    first_step = rng.choice([0, 0, 0, rng.randint(1, 60)])
    machine = StateMachine(TokenIds(card), ahead, max_padding, initial_padding)
    state = machine.new_state(copy.deepcopy(entries))
    tokens, if_word, if_other = [], [], []
    for step in range(first_step, first_step + rng.randint(150, 320)):
        token = random_prediction(rng, card, p_word)
        word_out, _ = machine.process(step, copy.deepcopy(state), NEW_WORD)
        other_out, _ = machine.process(step, copy.deepcopy(state), PAD)
        out, _ = machine.process(step, state, token)
        assert out == (word_out if token == NEW_WORD else other_out)
        tokens.append(token)
        if_word.append(word_out)
        if_other.append(other_out)
    return {
        "name": f"random_{index}",
        "card": card,
        "second_stream_ahead": ahead,
        "max_padding": max_padding,
        "initial_padding": initial_padding,
        "entries": [[e.tokens, e.text, e.padding] for e in entries],
        "first_step": first_step,
        "tokens": tokens,
        "if_word": if_word,
        "if_other": if_other,
        "end_step": state.end_step,
        "consumption_times": state.consumption_times,
        "transcript": state.transcript,
    }


TURNS = [
    [],
    [""],
    ["   "],
    ["hello world"],
    ["the model talks to you", "and you talk back"],
    ["", "the other speaker starts"],
    ["main", "", "main again", "other", "", ""],
    ["Hello, World! How are You?"],
    ["moshi: the (model) says l\u2019homme and it\u2019s fine"],
    ["speaker:one said (this)", "speaker:two ( ) answered"],
    ["tabs\tand\nnew lines\r\nand\u00a0no-break\u2003spaces   between"],
    ["  leading and trailing  "],
    ['wait <break time="1.5s"/> then talk'],
    ['<break time="2s"/>starts with a pause', 'ends with one<break time="0.6s" />'],
    ['two<break time="0.2s"/><break time="0.04s">pauses glued', "x"],
    ['a pause <break  time="3s"   /> with spaces <break time="1.s"/> and 1.'],
    ['not a pause <break time=".5s"/> nor <Break time="1s"/> nor <break time="1"/>'],
    ['odd durations <break time="1_5s"/> and <break time="2e1s"/>'],
    ['bad duration <break time="1x5s"/>'],
    ['bad duration <break time="1,5s"/>'],
    [f'huge duration <break time="{"9" * 400}s"/>'],
    ["\u00e9t\u00e9 \u00e0 l'\u00e9cole \u2014 \u00c7a va"],
    ["one", "two", "three", "four", "five"],
    ["word"] * 3,
]


def script_cases(tokenizer: SentencePieceProcessor, ids: TokenIds) -> list[dict]:
    cases = []
    for turns in TURNS:
        for multi_speaker in (True, False):
            for padding_between in (0, 1, 2):
                plain = multi_speaker and not padding_between
                for frame_rate in (12.5, 25.0) if plain else (12.5,):
                    case = {
                        "turns": turns,
                        "frame_rate": frame_rate,
                        "multi_speaker": multi_speaker,
                        "padding_between": padding_between,
                    }
                    try:
                        entries = script_to_entries(
                            tokenizer, ids, frame_rate, turns, multi_speaker, padding_between
                        )
                    except Exception as exc:  # noqa: BLE001 - recorded: ours must refuse too
                        case["kyutai_error"] = f"{type(exc).__name__}: {exc}"
                    else:
                        case["entries"] = [[e.tokens, e.text, e.padding] for e in entries]
                    cases.append(case)
    return cases


def write(path: Path, data: dict) -> None:
    """JSON with one case per line: small, and diffs show which case changed."""
    lines = [f"  {json.dumps(case, ensure_ascii=False)}" for case in data.pop("cases")]
    head = json.dumps(data, ensure_ascii=False)[:-1]
    sep = ", " if data else ""
    path.write_text(head + sep + '"cases": [\n' + ",\n".join(lines) + "\n]}\n")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(SEED)
    write(OUT / "schedules.json", {"cases": [schedule_case(rng, i) for i in range(48)]})
    tokenizer = SentencePieceProcessor(model_file=TOKENIZER)
    ids = TokenIds(tokenizer.vocab_size() + 1)
    cases = script_cases(tokenizer, ids)
    write(OUT / "scripts.json", {"tokenizer": TOKENIZER, "card": ids.card, "cases": cases})


if __name__ == "__main__":
    main()
