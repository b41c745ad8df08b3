"""The conversation the LLM sees: the system prompt, then the turns, oldest first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Appended to an answer the user cut off, as Unmute marks one (its system prompt says so).
CUT_OFF_MARK = "—"
# The hidden first user message that asks for a greeting (chat templates want a user first).
GREETING_REQUEST = "(The user has just joined. Greet them in one short sentence.)"
# The system prompt when none is given (the CLI and the browser page).
DEFAULT_SYSTEM = (
    "You are a helpful voice assistant. Your words are spoken aloud: answer in one to three "
    "short sentences of plain speech, with no lists, markdown or emoji. The user's words come "
    "from speech recognition and may hold errors. An answer of yours that ends with '—' was "
    "cut off there by the user."
)


@dataclass
class Turn:
    """One message: who said it, what was said (or heard, for a cut-off answer)."""

    role: str  # "user" | "assistant"
    text: str
    cut_off: bool = False

    def content(self) -> str:
        return f"{self.text}{CUT_OFF_MARK}" if self.cut_off else self.text


@dataclass
class History:
    """The system prompt and the turns; `messages()` is what the LLM is sent."""

    system: str
    turns: list[Turn] = field(default_factory=list)

    def add(self, role: str, text: str, cut_off: bool = False) -> None:
        """A turn; two in a row of one role are joined (a user who spoke twice)."""
        if self.turns and self.turns[-1].role == role and not self.turns[-1].cut_off:
            self.turns[-1].text = f"{self.turns[-1].text} {text}".strip()
            self.turns[-1].cut_off = cut_off
            return
        self.turns.append(Turn(role, text, cut_off))

    def messages(self) -> list[dict[str, str]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + [{"role": t.role, "content": t.content()} for t in self.turns]

    def trim(self, count_tokens: Callable[[Sequence[dict[str, str]]], int], limit: int) -> int:
        """Drop the oldest turns until the messages count at most `limit` tokens (the system
        prompt and the newest turn always stay); how many turns went. A dropped user turn
        takes the answer after it along, so the turns still start with the user."""
        dropped = 0
        while len(self.turns) > 1 and count_tokens(self.messages()) > limit:
            del self.turns[0]
            dropped += 1
            while len(self.turns) > 1 and self.turns[0].role != "user":
                del self.turns[0]
                dropped += 1
        return dropped
