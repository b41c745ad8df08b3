"""Stop strings in streamed text: `StopMatcher` lets text through until one appears, holding back
only a tail that could be the start of one."""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """Feed text as it is generated; get back what may be shown and whether a stop string came.

    The stop string itself and anything after it are never shown.
    """

    def __init__(self, stops: Sequence[str] = ()):
        self.stops = tuple(stop for stop in stops if stop)
        self._pending = ""

    def feed(self, text: str) -> tuple[str, bool]:
        """(the text that may be shown now, whether a stop string has appeared)."""
        self._pending += text
        if not self.stops:
            return self.flush(), False
        found = [at for stop in self.stops if (at := self._pending.find(stop)) >= 0]
        if found:
            shown = self._pending[: min(found)]
            self._pending = ""
            return shown, True
        held = self._held_length()
        shown = self._pending[: len(self._pending) - held]
        self._pending = self._pending[len(shown) :]
        return shown, False

    def flush(self) -> str:
        """The held-back tail, once generation has ended without a stop string."""
        shown, self._pending = self._pending, ""
        return shown

    def _held_length(self) -> int:
        """The longest tail of the pending text that begins some stop string."""
        longest = min(len(self._pending), max(len(stop) for stop in self.stops) - 1)
        for length in range(longest, 0, -1):
            tail = self._pending[-length:]
            if any(stop.startswith(tail) for stop in self.stops):
                return length
        return 0
