"""Mic audio a Realtime session dropped because the model fell behind, counted and logged."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("moshi_mlx.realtime")


class DroppedAudio:
    """Mic audio a session dropped because the model fell behind (`ms`), logged at most once
    every `LOG_EVERY_SECONDS` (a client is not sent an error: the Realtime API has none for
    this, and clients such as Pipecat end the session on any error)."""

    LOG_EVERY_SECONDS = 10.0

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.ms = 0
        self._unlogged = 0
        self._logged_at = -self.LOG_EVERY_SECONDS

    def add(self, ms: int) -> None:
        self.ms += ms
        self._unlogged += ms
        now = time.monotonic()
        if now - self._logged_at >= self.LOG_EVERY_SECONDS:
            log.warning(
                "%s: %d ms of mic audio dropped (the model fell behind)",
                self.session_id,
                self._unlogged,
            )
            self._logged_at, self._unlogged = now, 0
