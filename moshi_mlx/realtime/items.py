"""A Realtime session's conversation items (`ItemLog`) and the text messages a client adds
(`message_text`)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from moshi_mlx.assistant.history import Turn
from moshi_mlx.realtime.config import SessionError

# Items a session remembers (the LLM's history is bounded by its context on its own).
MAX_ITEMS = 256
MAX_MESSAGE_CHARS = 32_000
_TEXT_TYPES = ("input_text", "output_text", "text")


class ItemLog:
    """The items of a session, oldest first (the newest `MAX_ITEMS`), and for each answer its
    words' start times and its history turn, which a client's truncate shortens."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._answers: OrderedDict[str, tuple[list[tuple[str, float]], Turn]] = OrderedDict()

    @property
    def last(self) -> str | None:
        """The newest item's id."""
        return next(reversed(self._items), None)

    def add(self, item: dict[str, Any]) -> None:
        self._items[item["id"]] = item
        while len(self._items) > MAX_ITEMS:
            self._items.popitem(last=False)

    def replace(self, item_id: str, item: dict[str, Any]) -> None:
        if item_id in self._items:
            self._items[item_id] = item

    def answer(self, item: dict[str, Any], words: list[tuple[str, float]], turn: Turn) -> None:
        """An answer is over: `words` (word, start s) were spoken, `turn` holds it."""
        self.replace(item["id"], item)
        self._answers[item["id"]] = (words, turn)
        while len(self._answers) > MAX_ITEMS:
            self._answers.popitem(last=False)

    def truncate(self, item_id: object, seconds: float) -> bool:
        """Keep of the answer `item_id` the words begun before `seconds` (in the LLM's
        history too); False if no answer has that id."""
        if not isinstance(item_id, str) or item_id not in self._answers:
            return False
        words, turn = self._answers[item_id]
        heard = " ".join(word for word, start in words if start < seconds)
        if heard != turn.text:
            turn.text, turn.cut_off = heard, True
        return True


def message_text(item: object) -> tuple[str, str]:
    """(role, text) of a `conversation.item.create`'s text message; SessionError otherwise."""
    if not isinstance(item, dict):
        raise SessionError("item must be an object", "item")
    if item.get("type", "message") != "message":
        raise SessionError("only message items are supported", "item.type", "unsupported_item")
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise SessionError("item.role must be user, assistant or system", "item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise SessionError("item.content must be a list of parts", "item.content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_TYPES:
            raise SessionError(
                "only text parts (input_text, output_text) are supported in items",
                "item.content",
                "unsupported_content",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise SessionError("a text part needs its text", "item.content")
        texts.append(text)
    text = " ".join(texts).strip()
    if len(text) > MAX_MESSAGE_CHARS:
        raise SessionError(f"the message is over {MAX_MESSAGE_CHARS} characters", "item.content")
    return role, text
