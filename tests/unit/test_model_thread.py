"""The model thread: calls, background jobs and real-time jobs share one thread, and the
real-time ones keep their cadence."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import pytest

from moshi_mlx.errors import MoshiError
from moshi_mlx.runtime.model_thread import (
    BACKGROUND_AFTER,
    FRAME_SECONDS,
    ModelThread,
    ModelThreadStopped,
    RealTimeClock,
)


@pytest.fixture
def thread():
    model_thread = ModelThread("test-model")
    model_thread.start()
    yield model_thread
    model_thread.stop()


class _Ticker(RealTimeClock):
    """Due every period from its start; each step busy-works `work` seconds."""

    def __init__(self, work: float, steps: int):
        super().__init__()
        self.work = work
        self.left = steps
        self.start = time.monotonic()
        self.threads: set[str] = set()
        self.finished = threading.Event()

    def due_at(self) -> float | None:
        if not self.left:
            return None
        return self.start + (self.stats.steps) * self.period

    def step(self) -> None:
        self.threads.add(threading.current_thread().name)
        _busy(self.work)
        self.left -= 1
        if not self.left:
            self.finished.set()


def _busy(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_calls_run_on_the_one_thread(thread):
    async def main():
        names = await asyncio.gather(
            *(thread.call(lambda: threading.current_thread().name) for _ in range(5))
        )
        return names, thread.call_soon(lambda: threading.current_thread().name).result(5)

    names, from_any_thread = asyncio.run(main())
    assert set(names) == {"test-model"}
    assert from_any_thread == "test-model"


def test_an_exception_propagates_and_the_thread_goes_on(thread):
    def fail():
        raise ValueError("bad weights")

    async def main():
        with pytest.raises(ValueError, match="bad weights"):
            await thread.call(fail)
        return await thread.call(lambda: 42)

    assert asyncio.run(main()) == 42


def test_stop_fails_pending_calls_with_a_moshi_error():
    model_thread = ModelThread()
    model_thread.start()
    started = threading.Event()
    blocker = model_thread.call_soon(lambda: (started.set(), time.sleep(0.2)))
    started.wait(5)
    pending = model_thread.call_soon(lambda: 1)
    model_thread.stop()
    blocker.result(5)
    with pytest.raises(MoshiError):
        pending.result(5)
    with pytest.raises(MoshiError):
        model_thread.call_soon(lambda: 1).result(5)


def test_background_items_arrive_in_order_and_closing_stops_the_job(thread):
    state = {"made": 0, "closed_on": None}

    def counting():
        try:
            while True:
                state["made"] += 1
                yield state["made"]
        finally:
            state["closed_on"] = threading.current_thread().name

    async def main():
        got = []
        items = thread.background(counting())
        async for item in items:
            got.append(item)
            if len(got) == 10:
                break
        await items.aclose()
        await thread.call(lambda: None)  # the close ran before this call
        made = state["made"]
        await asyncio.sleep(0.1)
        return got, made

    got, made = asyncio.run(main())
    assert got == list(range(1, 11))
    assert state["closed_on"] == "test-model"
    assert state["made"] == made  # nothing stepped after the close


def test_a_finite_background_job_ends_and_its_error_reaches_the_reader(thread):
    def failing():
        yield "a"
        yield "b"
        raise RuntimeError("out of memory")

    async def main():
        got = []
        with pytest.raises(RuntimeError, match="out of memory"):
            async for item in thread.background(failing()):
                got.append(item)
        return got, [item async for item in thread.background(iter("xyz"))]

    assert asyncio.run(main()) == (["a", "b"], ["x", "y", "z"])


def test_a_reader_that_does_not_read_pauses_the_job(thread):
    made = []

    def endless():
        while True:
            made.append(1)
            yield len(made)

    async def main():
        items = thread.background(endless())
        assert await items.__anext__() == 1
        await asyncio.sleep(0.3)
        paused_at = len(made)
        await items.aclose()
        return paused_at

    assert asyncio.run(main()) <= 70  # MAX_UNREAD_ITEMS and a few in flight


def test_real_time_steps_keep_their_cadence_beside_a_busy_background_job(thread):
    """A 20 ms background step and a 10 ms real-time step: every real-time step starts less
    than one period late, and the background job still makes progress."""
    steps = 25  # 2 s

    def background_work():
        while True:
            _busy(0.02)
            yield None

    async def main():
        ticker = _Ticker(work=0.01, steps=steps)
        items = thread.background(background_work())
        thread.add_realtime(ticker)
        done = 0
        async for _ in items:
            done += 1
            if ticker.finished.is_set():
                break
        await items.aclose()
        thread.remove_realtime(ticker)
        return ticker, done

    ticker, background_steps = asyncio.run(main())
    assert ticker.threads == {"test-model"}
    assert ticker.stats.steps == steps
    assert ticker.stats.max_lag < FRAME_SECONDS, ticker.stats
    assert background_steps > 20  # it filled the gaps
    print(
        f"real-time lag: max {ticker.stats.max_lag * 1e3:.1f} ms, mean "
        f"{ticker.stats.mean_lag * 1e3:.1f} ms; {background_steps} background steps"
    )


def test_a_failing_real_time_step_removes_only_that_job(thread):
    failures = []

    class Failing(RealTimeClock):
        def due_at(self):
            return 0.0

        def step(self):
            raise RuntimeError("broken stream")

        def failed(self, exc):
            failures.append(str(exc))

    thread.add_realtime(Failing())
    ticker = _Ticker(work=0.0, steps=3)
    thread.add_realtime(ticker)
    assert ticker.finished.wait(2)
    assert failures == ["broken stream"]
    assert thread.call_soon(lambda: 7).result(2) == 7


def test_a_call_runs_within_a_bound_while_real_time_is_always_behind(thread):
    """A real-time step longer than its period is due again as soon as it ends; a call still
    runs once it has waited one period, after at most one more real-time step."""
    work = 0.1  # > FRAME_SECONDS: always overdue
    ticker = _Ticker(work=work, steps=100)
    thread.add_realtime(ticker)
    while ticker.stats.steps < 3:  # well behind by now
        time.sleep(0.01)
    submitted, steps_then = time.monotonic(), ticker.stats.steps
    ran = thread.call_soon(lambda: (time.monotonic(), ticker.stats.steps)).result(5)
    thread.remove_realtime(ticker)
    waited, steps_between = ran[0] - submitted, ran[1] - steps_then
    assert steps_between <= 2, steps_between  # the step running then, and one more
    assert waited < FRAME_SECONDS + 2 * work + 0.5, waited
    assert not ticker.finished.is_set()  # the real-time job was still behind


def test_a_background_job_gets_its_turns_while_real_time_is_always_behind(thread):
    """Behind real time, a ready background job still steps once per `BACKGROUND_AFTER`
    real-time steps."""
    ticker = _Ticker(work=0.03, steps=30)
    ticker.period = 0.02  # always overdue
    during: list[int] = []

    def tokens():
        while True:
            if not ticker.finished.is_set():
                during.append(ticker.stats.steps)
            yield None

    async def main():
        items = thread.background(tokens())
        await items.__anext__()  # started before the real-time job
        thread.add_realtime(ticker)
        async for _ in items:
            if ticker.finished.is_set():
                break
        await items.aclose()

    asyncio.run(main())
    while_behind = [steps for steps in during if steps > 0]
    assert len(while_behind) >= 30 // (BACKGROUND_AFTER + 1) - 1, during
    gaps = [b - a for a, b in itertools.pairwise(while_behind)]
    assert max(gaps, default=0) <= BACKGROUND_AFTER, during


def test_stop_skips_a_pending_call_whose_loop_cancelled_it(monkeypatch):
    """A loop that closes before `stop()` cancels its pending `call`s: stopping still fails
    the others and the thread ends cleanly."""
    errors = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    model_thread = ModelThread()
    model_thread.start()
    started = threading.Event()
    blocker = model_thread.call_soon(lambda: (started.set(), time.sleep(0.3)))
    started.wait(5)

    async def main():
        asyncio.get_running_loop().create_task(model_thread.call(lambda: 1))
        await asyncio.sleep(0)  # the task queues its call; asyncio.run then cancels it

    asyncio.run(main())
    pending = model_thread.call_soon(lambda: 2)
    model_thread.stop()
    blocker.result(5)
    with pytest.raises(ModelThreadStopped):
        pending.result(5)
    assert errors == []
