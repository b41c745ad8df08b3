"""Kyutai's TTS text schedule: the text token the model reads at each step, word by word.

The TTS model writes its own text stream: at each step it predicts either "a word starts now"
(`new_word`) or padding. The schedule answers each prediction with the token the model reads
next: the word's marker, then the word's tokens one per step, within padding limits that keep
the model from stalling or cutting words short. Models with a lookahead stream also read the
tokens of the word `second_stream_ahead` words ahead, multiplexed into the same value.

The decisions are those of Kyutai's `StateMachine.process` (moshi 0.2.13, models/tts.py), step
for step. Beyond it, a schedule answers both possible predictions before one is committed, and
takes words while it runs.
"""

from __future__ import annotations

import enum
import operator
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from moshi_mlx.errors import TtsError
from moshi_mlx.runtime.tokenizer import TextTokenizer

_NO_TOKEN = -1  # lookahead stream value read as an all-zero embedding (multiplexed as 0)


@dataclass(frozen=True)
class TokenIds:
    """Special text tokens; `card` is the text cardinality plus one, the multiplexing base."""

    card: int
    new_word: int = 0
    pad: int = 3
    main: int = 1
    other: int = 2
    zero: int = -1
    ungenerated: int = -2

    def __post_init__(self):
        specials = (self.new_word, self.pad, self.main, self.other)
        if not all(0 <= token < self.card for token in specials) or self.new_word == self.pad:
            raise TtsError(f"text card {self.card} does not fit the special tokens {specials}")


@dataclass(frozen=True)
class Entry:
    """One word to say (`tokens` not empty) or a pause (`tokens` empty), then `padding` steps
    in which the model may not start the next word."""

    tokens: tuple[int, ...]
    text: str
    padding: int = 0

    def __post_init__(self):
        try:
            tokens = tuple(operator.index(token) for token in self.tokens)
            padding = operator.index(self.padding)
        except TypeError:
            raise TtsError(f"entry {self.text!r}: tokens and padding must be integers") from None
        if any(token < 0 for token in tokens) or padding < 0:
            raise TtsError(f"entry {self.text!r}: tokens and padding cannot be negative")
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "padding", padding)


# A pause, `<break time="1.5s"/>`, or a run of whitespace. As in Kyutai's, the "." of the
# duration matches any character, and `float` then accepts or refuses the number.
_EVENT = re.compile(r'<break\s+time="([0-9]+(?:.[0-9]*)?)s"\s*/?>|\s+')
_REPLACEMENTS = (("\u2019", "'"), (":", " "), ("(", ""), (")", ""))


def script_to_entries(
    tokenizer: TextTokenizer,
    token_ids: TokenIds,
    frame_rate: float,
    turns: Sequence[str],
    multi_speaker: bool = True,
    padding_between: int = 0,
) -> list[Entry]:
    """The entries of a script, as Kyutai's `script_to_entries` makes them.

    `turns` alternate speakers, the main one first (an empty first turn starts with the
    other); with `multi_speaker`, a turn's first word starts with its speaker's token when the
    speaker changes. `<break time="Xs"/>` becomes a pause of X seconds. `padding_between` > 0
    forces that many padding steps after each word, plus one per token beyond the first.
    """
    if isinstance(turns, str) or not all(isinstance(turn, str) for turn in turns):
        raise TtsError("a script is a list of strings, one per speaker turn")
    if not frame_rate > 0 or padding_between < 0:
        raise TtsError(f"bad frame rate {frame_rate} or padding between words {padding_between}")
    speakers = (token_ids.main, token_ids.other)
    last_speaker: int | None = None
    entries: list[Entry] = []
    for index, turn in enumerate(turns):
        for old, new in _REPLACEMENTS:
            turn = turn.replace(old, new)
        first_word = True
        for word, pause in _split(turn):
            if word:
                tokens = list(tokenizer.encode(word))
                speaker = index % len(speakers)
                if first_word and multi_speaker and speaker != last_speaker:
                    tokens.insert(0, speakers[speaker])
                    last_speaker = speaker
                first_word = False
                padding = max(0, padding_between + len(tokens) - 1) if padding_between else 0
                entries.append(Entry(tuple(tokens), word, padding))
            if pause is not None:
                entries.append(Entry((), "", _pause_steps(pause, frame_rate)))
    return entries


def _split(turn: str) -> Iterator[tuple[str, str | None]]:
    """(text before, pause duration or None) for each whitespace run or break, then the rest."""
    start = 0
    for match in _EVENT.finditer(turn):
        yield turn[start : match.start()], match.group(1)
        start = match.end()
    yield turn[start:], None


def _pause_steps(duration: str, frame_rate: float) -> int:
    try:
        return round(float(duration) * frame_rate)
    except (ValueError, OverflowError):
        raise TtsError(f'break time="{duration}s" is not a number of seconds') from None


class Outcomes(NamedTuple):
    """The next input token for each kind of prediction."""

    word: int  # the model predicted `new_word`
    other: int  # it predicted anything else (read as padding)


class _Move(enum.Enum):
    PAD = enum.auto()  # a padding step: feed the next queued token, or padding
    WORD = enum.auto()  # take the next entry, a word
    PAUSE = enum.auto()  # take the next entry, a pause: a padding step
    END = enum.auto()  # a word asked for after the last one: the text ends here
    WAIT = enum.auto()  # a word asked for before it was pushed: a padding step


@dataclass(frozen=True)
class _Plan:
    move: _Move
    output: int
    padding_step: bool  # padding counters count down
    queued_pops: int
    lookahead_pops: int


class TextSchedule:
    """The text schedule of one stream (Kyutai's `State` with `StateMachine.process`).

    Words come in with `push`, and `close` says no more will come; until then, a word the
    model asks for that has not arrived (or whose lookahead word has not) is answered with
    padding, and asked for again at a later step (`waiting` tells when the last step did,
    `needs_text` when the next would). Entries pushed before step 0 and closed give Kyutai's
    schedule exactly.

    Per step: `speculate()` gives the answer to either prediction without changing anything,
    `commit(step, token)` applies the model's actual prediction and returns its answer.
    Results: `end_step` (the step the model asked for a word past the last, else None),
    `consumption_times` (the step each entry was taken), `transcript` [(word, step)].
    """

    def __init__(
        self,
        token_ids: TokenIds,
        second_stream_ahead: int = 0,
        max_padding: int = 8,
        initial_padding: int = 2,
    ):
        if min(second_stream_ahead, max_padding, initial_padding) < 0:
            raise TtsError("lookahead and padding counts cannot be negative")
        self.token_ids = token_ids
        self.second_stream_ahead = second_stream_ahead
        self.max_padding = max_padding
        self.end_step: int | None = None
        self.consumption_times: list[int] = []
        self.transcript: list[tuple[str, int]] = []
        self.waiting = False  # the last step asked for a word not pushed yet
        self._entries: list[Entry] = []
        self._head = 0  # entries taken
        self._words: list[int] = []  # indices of the entries that are words
        self._words_taken = 0
        self._queued: deque[int] = deque()  # the taken word's tokens still to feed
        self._lookahead: deque[int] = deque()
        self._remaining_padding = initial_padding  # pads the model may still choose
        self._forced_padding = initial_padding  # pads it must still take
        self._closed = False
        self._last_step: int | None = None

    @property
    def closed(self) -> bool:
        """Whether `close` was called: no more words will come."""
        return self._closed

    @property
    def needs_text(self) -> bool:
        """Whether a word asked for now would wait for text not pushed yet."""
        return not self._closed and self._missing_text()

    def push(self, entries: Iterable[Entry]) -> None:
        """Queue more words and pauses, after those already pushed."""
        if self._closed:
            raise TtsError("text pushed after the end of the text")
        entries = list(entries)
        for entry in entries:
            if not isinstance(entry, Entry):
                raise TtsError(f"text must be pushed as entries, got {type(entry).__name__}")
            if any(token >= self.token_ids.card for token in entry.tokens):
                raise TtsError(f"entry {entry.text!r} has a token past the text card")
        for entry in entries:
            if entry.tokens:
                self._words.append(len(self._entries))
            self._entries.append(entry)

    def close(self) -> None:
        """No more text: the next word asked for past the last one ends the schedule."""
        self._closed = True

    def speculate(self) -> Outcomes:
        """The tokens `commit` would return for either prediction at this step; no change."""
        return Outcomes(self._plan(True).output, self._plan(False).output)

    def commit(self, step: int, token: int) -> int:
        """Apply the model's predicted text `token` at `step`; the token it reads next."""
        if self._last_step is not None and step <= self._last_step:
            raise TtsError(f"step {step} does not follow step {self._last_step}")
        self._last_step = step
        plan = self._plan(operator.index(token) == self.token_ids.new_word)
        self._apply(step, plan)
        return plan.output

    def done(self, step: int, delay_steps: int, final_padding: int = 4) -> bool:
        """Whether generation may stop at `step`: the text ended and the audio, `delay_steps`
        behind, had `final_padding` more steps. A batch stops when all its streams are done
        (Kyutai's test on the latest `end_step`)."""
        return self.end_step is not None and step >= self.end_step + delay_steps + final_padding

    def _missing_text(self) -> bool:
        """Whether the next word, or the word it needs in the lookahead stream, is missing."""
        if self._head == len(self._entries):
            return True
        if not self.second_stream_ahead or not self._entries[self._head].tokens:
            return False
        return self._words_taken + self.second_stream_ahead >= len(self._words)

    def _move(self, wants_word: bool) -> _Move:
        if self._queued or self._forced_padding > 0:
            wants_word = False
        elif self._remaining_padding <= 0:
            wants_word = True
        if not wants_word:
            return _Move.PAD
        if not self._closed and self._missing_text():
            return _Move.WAIT
        if self._head == len(self._entries):
            return _Move.END if self.end_step is None else _Move.PAD
        return _Move.WORD if self._entries[self._head].tokens else _Move.PAUSE

    def _plan(self, wants_word: bool) -> _Plan:
        ids = self.token_ids
        lookahead = self.second_stream_ahead > 0
        move = self._move(wants_word)
        # A word is only taken once the queue is empty; its tokens become the queue.
        queue = self._entries[self._head].tokens if move is _Move.WORD else self._queued
        says_word = move is _Move.WORD or (move is _Move.END and lookahead)
        if says_word:
            main, pops = ids.new_word, 0
        elif queue:
            main, pops = queue[0], 1
        else:
            main, pops = ids.pad, 0
        if not lookahead:
            return _Plan(move, main, not says_word, pops, 0)
        if main == ids.new_word:
            # The marker goes to the lookahead stream and the main stream feeds on; Kyutai
            # does this to any value equal to `new_word`, a word's own token included.
            main, pops = (queue[pops], pops + 1) if len(queue) > pops else (ids.pad, pops)
            return _Plan(move, self._mux(ids.new_word, main), not says_word, pops, 0)
        if self._lookahead:
            return _Plan(move, self._mux(self._lookahead[0], main), True, pops, 1)
        return _Plan(move, self._mux(_NO_TOKEN, main), True, pops, 0)

    def _mux(self, second: int, main: int) -> int:
        return (second + 1) * self.token_ids.card + main

    def _apply(self, step: int, plan: _Plan) -> None:
        self.waiting = plan.move is _Move.WAIT
        if plan.move in (_Move.WORD, _Move.PAUSE):
            entry = self._entries[self._head]
            self._head += 1
            self.consumption_times.append(step)
            if entry.tokens:
                self._words_taken += 1
                self.transcript.append((entry.text, step))
                self._queued.extend(entry.tokens)
                self._lookahead.extend(self._tokens_ahead())
                self._remaining_padding = self.max_padding
            self._forced_padding = entry.padding
        elif plan.move is _Move.END:
            self.end_step = step
        if plan.padding_step:
            if self._remaining_padding > 0:
                self._remaining_padding -= 1
            if self._forced_padding > 0:
                self._forced_padding -= 1
        for _ in range(plan.queued_pops):
            self._queued.popleft()
        if plan.lookahead_pops:
            self._lookahead.popleft()

    def _tokens_ahead(self) -> tuple[int, ...]:
        """The tokens of the word `second_stream_ahead` words after the one just taken."""
        if not self.second_stream_ahead:
            return ()
        index = self._words_taken - 1 + self.second_stream_ahead
        return self._entries[self._words[index]].tokens if index < len(self._words) else ()
