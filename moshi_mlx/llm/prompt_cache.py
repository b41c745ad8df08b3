"""Prompt caches kept across requests: `PromptCacheStore`.

A conversation's next request repeats the whole conversation so far. The store keeps the
key/value caches of the last few generations with the tokens each holds, and hands a new
prompt the one that shares its longest start, so only the new end of the prompt is prefilled.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

KvCache = list[Any]  # mlx-lm's caches, one per layer


@dataclass
class CachedPrompt:
    """A cache and the tokens whose keys and values it holds."""

    tokens: list[int]
    cache: KvCache


class PromptCacheStore:
    """The caches of the last `capacity` generations (0: never reuse), newest last.

    Not thread-safe: use it from the model thread only.
    """

    def __init__(self, make_cache: Callable[[], KvCache], capacity: int = 4):
        self._make_cache = make_cache
        self.capacity = capacity
        self._entries: list[CachedPrompt] = []

    def __len__(self) -> int:
        return len(self._entries)

    def take(self, prompt: Sequence[int]) -> tuple[KvCache, int]:
        """(a cache for `prompt`, how many of its first tokens that cache holds already).

        The count is below `len(prompt)`: the last prompt token is always run, for its
        logits. A kept cache that holds more than the shared start is trimmed back to it, or
        left for a fresh one when its layers cannot be trimmed. The cache returned leaves the
        store (two generations never share one); `put` it back when done.
        """
        best, shared = None, 0
        for entry in self._entries:
            length = _common_prefix(entry.tokens, prompt)
            if length > shared:
                best, shared = entry, length
        if best is None:
            return self._make_cache(), 0
        shared = min(shared, len(prompt) - 1)
        excess = len(best.tokens) - shared
        if excess and not _can_trim(best.cache):
            return self._make_cache(), 0
        self._entries.remove(best)
        if excess and not _trim(best.cache, excess):
            return self._make_cache(), 0
        return best.cache, shared

    def put(self, tokens: Sequence[int], cache: KvCache) -> None:
        """Keep `cache`, which holds `tokens`, for a later request; the oldest goes past
        `capacity`."""
        if self.capacity <= 0 or not tokens:
            return
        self._entries.append(CachedPrompt(list(tokens), cache))
        del self._entries[: -self.capacity]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def _can_trim(cache: KvCache) -> bool:
    from mlx_lm.models.cache import can_trim_prompt_cache

    return can_trim_prompt_cache(cache)


def _trim(cache: KvCache, count: int) -> bool:
    """Drop the last `count` tokens from every layer; False when it dropped fewer."""
    from mlx_lm.models.cache import trim_prompt_cache

    return trim_prompt_cache(cache, count) == count
