"""Who speaks when: Kyutai's Unmute turn-taking rules as a pure state machine, `TurnTaker`.

The pipeline tells it what the STT heard each 80 ms step (`listen`), when the STT's flush is
over (`flushed`), what the LLM wrote (`reply_text`, `reply_ended`), what the speaker has played
of the answer (`heard`) and when the answer is played out (`speech_done`); each call returns
the `Action`s the pipeline must take, at once, in order.

- The user's turn starts with a word. It ends when the STT's pause head (head 2) says "done"
  above `pause_threshold` (Unmute: `prs[2] > 0.6`), never in the stream's first
  `ignore_start` seconds (the head is unreliable there); then the STT's delay is flushed with
  silence (`FlushStt`) so its last words come out, and the LLM starts (`StartReply`).
  An STT without pause heads (kyutai/stt-2.6b-en) ends it by silence instead: no new word
  for `word_gap` seconds of the STT's stream (so `word_gap` plus the STT's delay after the
  user stopped), like a VAD's silence timeout; our rule, as Unmute has none for such a model.
- The LLM's words go to the TTS whole and cleaned (`Speak`) as they come.
- Barge-in: while the assistant answers, a word from the user (or the pause head's "done"
  below `barge_in_below`: the user is surely speaking) stops it (`StopReply`: LLM and TTS
  cancelled, audio dropped); the answer stays in the history as far as it was heard, marked
  cut off, and the user's new turn is taken.

A client may also drive the turns (`/v1/realtime`): `commit` ends the user's turn now,
`respond` starts an answer, `cancel` stops one, `clear` forgets the user's words so far; the
rules may leave ending turns, answering and barge-in to it (`TurnRules.ends_turns`,
`replies`, `barge_in`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from moshi_mlx.assistant.history import GREETING_REQUEST, History
from moshi_mlx.assistant.speech_text import SpokenWords

TURN_HEAD = 2  # the pause head Unmute reads (`prs[2]`)


@dataclass(frozen=True)
class TurnRules:
    """The thresholds of turn-taking (Unmute's values by default)."""

    pause_threshold: float = 0.6  # head "done" above this while the user speaks: turn over
    ignore_start: float = 1.0  # seconds of a stream in which the pause head is not read
    barge_in_below: float = 0.05  # head "done" below this while answering: barge-in (0: off)
    head: int = TURN_HEAD
    ends_turns: bool = True  # the pause head ends the user's turn (False: only `commit` does)
    word_gap: float = 1.0  # no pause heads: seconds without a new word that end the turn
    replies: bool = True  # the end of the user's turn starts the answer (False: `respond`)
    barge_in: bool = True  # the user's speech stops an answer


class State(enum.Enum):
    LISTENING = "listening"  # nobody speaks
    USER_SPEAKING = "user speaking"
    FLUSHING = "flushing"  # the user is done; the STT's last words are coming out
    ANSWERING = "answering"  # the LLM writes and the TTS speaks


@dataclass(frozen=True)
class UserStarted:
    """The user's turn has begun: their first word, at `time` in the STT's stream (s)."""

    time: float


@dataclass(frozen=True)
class FlushStt:
    """Feed the STT its delay of silence now, as fast as it runs; call `flushed` after."""


@dataclass(frozen=True)
class StartReply:
    """Start the LLM on `messages` and open a TTS stream."""

    messages: list[dict[str, str]]


@dataclass(frozen=True)
class Speak:
    """Push these whole words to the TTS."""

    text: str


@dataclass(frozen=True)
class CloseSpeech:
    """The last words (maybe none): push them and close the TTS stream."""

    text: str


@dataclass(frozen=True)
class StopReply:
    """Barge-in: cancel the LLM and the TTS, drop the audio not played yet; `heard` is what
    the speaker had played of the answer."""

    heard: str = ""


@dataclass(frozen=True)
class UserSaid:
    """The user's turn, complete."""

    text: str


@dataclass(frozen=True)
class AnswerEnded:
    """The assistant's answer as the user heard it; `cut_off` after a barge-in."""

    text: str
    cut_off: bool


Action = (
    UserStarted | FlushStt | StartReply | Speak | CloseSpeech | StopReply | UserSaid | AnswerEnded
)
TokenCounter = Callable[[Sequence[dict[str, str]]], int]


class TurnTaker:
    """The turn-taking state machine; see the module docstring. `count_tokens(messages)` and
    `token_limit` (None: no limit) bound the history: past the limit the oldest turns go."""

    def __init__(
        self,
        history: History,
        rules: TurnRules | None = None,
        count_tokens: TokenCounter | None = None,
        token_limit: int | None = None,
    ):
        self.history = history
        self.rules = rules or TurnRules()
        self.state = State.LISTENING
        self._count_tokens = count_tokens
        self._token_limit = token_limit
        self._user_words: list[str] = []
        self._last_word = 0.0  # when the STT last gave a word (s, its stream's time)
        self._words = SpokenWords()
        self._reply = ""  # the cleaned words sent to the TTS
        self._heard = ""  # the part of it the speaker has played
        self._committed = False  # the turn being flushed was ended by `commit`
        self.trimmed_turns = 0

    # --- the conversation's start ---
    def greet(self) -> list[Action]:
        """The assistant speaks first (the hidden greeting request as the user's turn)."""
        self.history.add("user", GREETING_REQUEST)
        return self._start_reply()

    # --- the STT ---
    def listen(self, time: float, words: Sequence[str], pause: Sequence[float]) -> list[Action]:
        """One STT step: its stream `time` (seconds), the words it recognised, each pause
        head's probability that the speaker is done (empty: the model has no such heads)."""
        words = [w for w in words if w.strip()]
        rules = self.rules
        if words:
            self._last_word = time
        done = pause[rules.head] if len(pause) > rules.head else None
        head_trusted = done is not None and time >= rules.ignore_start

        if self.state is State.ANSWERING:
            speaking = head_trusted and done < rules.barge_in_below
            if not rules.barge_in:
                self._user_words.extend(words)
                return []
            if not (words or speaking):
                return []
            actions = [UserStarted(time), *self._barge_in()]
            self._user_words = list(words)
            self.state = State.USER_SPEAKING
            return actions
        self._user_words.extend(words)
        actions: list[Action] = []
        if self.state is State.LISTENING and words:
            self.state = State.USER_SPEAKING
            actions.append(UserStarted(time))
        if not pause:  # no pause heads: a gap of `word_gap` without words is "done"
            head_trusted, done = True, float(time - self._last_word >= rules.word_gap)
        if (
            self.state is State.USER_SPEAKING
            and rules.ends_turns
            and head_trusted
            and done > rules.pause_threshold
        ):
            self.state = State.FLUSHING
            actions.append(FlushStt())
        return actions

    def commit(self) -> list[Action]:
        """End the user's turn now (a client's commit): flush the STT, then `flushed`."""
        if self.state not in (State.LISTENING, State.USER_SPEAKING):
            return []
        self.state = State.FLUSHING
        self._committed = True
        return [FlushStt()]

    def clear(self) -> None:
        """Forget the user's words not yet part of a turn."""
        self._user_words = []
        if self.state is State.USER_SPEAKING:
            self.state = State.LISTENING

    def flushed(self) -> list[Action]:
        """The STT's flush is over: its last words have come through `listen`."""
        if self.state is not State.FLUSHING:
            return []
        text = " ".join(self._user_words).strip()
        self._user_words = []
        committed, self._committed = self._committed, False
        if not text:
            self.state = State.LISTENING
            return [UserSaid("")] if committed else []
        self.history.add("user", text)
        if not self.rules.replies:
            self.state = State.LISTENING
            return [UserSaid(text)]
        return [UserSaid(text), *self._start_reply()]

    def respond(self, instructions: str | None = None) -> list[Action]:
        """Start an answer to the conversation so far (a client's request), under
        `instructions` in place of the system prompt if given; none while the user's turn is
        being flushed or an answer runs. With no user turn yet, the assistant greets."""
        if self.state not in (State.LISTENING, State.USER_SPEAKING):
            return []
        if not any(turn.role == "user" for turn in self.history.turns):
            self.history.add("user", GREETING_REQUEST)
        return self._start_reply(instructions)

    def cancel(self) -> list[Action]:
        """Stop the answer running (a client's request), kept as far as it was heard."""
        if self.state is not State.ANSWERING:
            return []
        self.state = State.LISTENING
        return self._barge_in()

    # --- the LLM ---
    def reply_text(self, piece: str) -> list[Action]:
        """A piece of the LLM's answer."""
        if self.state is not State.ANSWERING:
            return []
        words = self._words.add(piece)
        self._reply += words
        return [Speak(words)] if words else []

    def reply_ended(self) -> list[Action]:
        """The LLM's answer is complete."""
        if self.state is not State.ANSWERING:
            return []
        rest = self._words.finish()
        self._reply += rest
        return [CloseSpeech(rest)]

    def reply_failed(self) -> None:
        """The answer cannot be spoken (its TTS stream failed to open): back to listening,
        nothing of it in the history (the user's turn stays, joined by their next)."""
        if self.state is State.ANSWERING:
            self.state = State.LISTENING
            self._words = SpokenWords()
            self._reply = self._heard = ""

    # --- the speaker ---
    def heard(self, text: str) -> None:
        """The words of the answer the speaker has started playing so far."""
        if self.state is State.ANSWERING:
            self._heard = text

    def speech_done(self) -> list[Action]:
        """The answer is played out: the turn is over."""
        if self.state is not State.ANSWERING:
            return []
        self.state = State.LISTENING
        text = self._reply.strip()
        self.history.add("assistant", text)
        return [AnswerEnded(text, cut_off=False)]

    # --- inside ---
    def _start_reply(self, instructions: str | None = None) -> list[Action]:
        if self._count_tokens is not None and self._token_limit is not None:
            self.trimmed_turns += self.history.trim(self._count_tokens, self._token_limit)
        self.state = State.ANSWERING
        self._words = SpokenWords()
        self._reply = self._heard = ""
        messages = self.history.messages()
        if instructions is not None:
            turns = [message for message in messages if message["role"] != "system"]
            messages = [{"role": "system", "content": instructions}, *turns]
        return [StartReply(messages)]

    def _barge_in(self) -> list[Action]:
        heard = self._heard.strip()
        actions: list[Action] = [StopReply(heard)]
        if heard:
            self.history.add("assistant", heard, cut_off=True)
            actions.append(AnswerEnded(heard, cut_off=True))
        return actions
