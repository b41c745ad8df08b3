"""Prompt caches kept across requests: mlx-lm's `LRUPromptCache`, with the one rule a reply
adds.

A conversation's next request repeats the whole conversation so far. mlx-lm's LRU keeps the
key/value caches of the last few generations by their tokens and hands a new prompt a copy of
the one that shares its longest start (trimmed back to it when it holds more), so only the new
end of the prompt is prefilled. A reply needs the logits of the prompt's last token, so that
token is always run: a cache holding the whole prompt is trimmed by one token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

LayerCaches = list[Any]  # an LLM generation's mlx-lm KV caches, one per layer
_MODEL = "llm"  # the LRU's key for the model: one model per store


class PromptCaches:
    """The caches of the last `capacity` generations (0: never reuse).

    Not thread-safe: use it from the model thread only.
    """

    def __init__(self, make_cache: Callable[[], LayerCaches], capacity: int = 4):
        from mlx_lm.models.cache import LRUPromptCache

        self._make_cache = make_cache
        self.capacity = capacity
        self._lru = LRUPromptCache(max_size=capacity)

    def __len__(self) -> int:
        return len(self._lru)

    def take(self, prompt: Sequence[int]) -> tuple[LayerCaches, int]:
        """(a cache for `prompt`, how many of its first tokens that cache holds already).

        The count is below `len(prompt)`: the last prompt token is always run, for its
        logits. The cache is a copy (two generations never share one); `put` it when done.
        """
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        prompt = list(prompt)
        cache, rest = self._lru.fetch_nearest_cache(_MODEL, prompt)
        if cache is None:
            return self._make_cache(), 0
        if not rest:  # it holds the whole prompt: run the last token again
            if not can_trim_prompt_cache(cache) or trim_prompt_cache(cache, 1) != 1:
                return self._make_cache(), 0
            rest = prompt[-1:]
        return cache, len(prompt) - len(rest)

    def put(self, tokens: Sequence[int], cache: LayerCaches) -> None:
        """Keep `cache`, which holds `tokens`, for a later request; the least recently used
        goes past `capacity`."""
        if self.capacity > 0 and tokens:
            self._lru.insert_cache(_MODEL, list(tokens), cache)
