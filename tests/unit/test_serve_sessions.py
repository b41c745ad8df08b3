"""Sessions: a churn of clients that open and close at once is summarised, not logged each."""

from __future__ import annotations

import asyncio
import logging

from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.sessions import CHURN_SECONDS, Sessions


class _Brief:
    def __init__(self, seconds: float):
        self.seconds = seconds

    async def run(self) -> str:
        await asyncio.sleep(self.seconds)
        return "the client left"

    async def stop(self) -> None:
        pass


def test_a_churn_of_sessions_is_one_summary_line(caplog):
    caplog.set_level(logging.INFO, logger="test.sessions")
    logger = logging.getLogger("test.sessions")
    tally = EventTally(logger)

    async def main():
        sessions = Sessions(100, tally, logger, "conversation")
        churn = [sessions.run("10.0.0.1", lambda: _Brief(0.0), _refuse) for _ in range(50)]
        await asyncio.gather(*churn)
        await sessions.run("10.0.0.2", lambda: _Brief(CHURN_SECONDS + 0.1), _refuse)
        tally.flush()

    asyncio.run(main())
    lines = [record.getMessage() for record in caplog.records]
    assert lines[-1].startswith("50 conversations that opened and closed at once from 1 address")
    assert sum("10.0.0.1" in line for line in lines) == 0
    assert [line for line in lines if "10.0.0.2" in line] == [
        "10.0.0.2: conversation started",
        "10.0.0.2: conversation ended: the client left",
    ]


async def _refuse() -> None:
    raise AssertionError("no session is refused here")
