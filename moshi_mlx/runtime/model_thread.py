"""The thread that runs every MLX call of a server process (and the assistant's), and its
scheduler.

MLX keeps streams, compile caches and random state per thread, and two threads driving Metal
at once crash it, so a server hands all model work to one `ModelThread`. Three kinds of work
share it, in this order of precedence:

1. real-time jobs (`RealTimeClock`: the STT and TTS stream groups) step when they are due
   (every 80 ms frame; TTS may run ahead of real time up to a bound);
2. one-off calls (`call`, `call_soon`: loading, warm-up, a short request) run between steps;
3. background jobs (`background`: an LLM's tokens) fill the gaps: one `next()` at a time, and
   only when it is expected to end before the next real-time step is due.

A real-time step therefore waits for the one call or background step already running, and,
through the two bounds below, for at most one more call and one more background step. The
bounds break the order where it would starve the rest: when the real-time jobs are behind (a
step due as soon as the last one ends: an STT slower than real time) nothing else would run.

- a one-off call pending for over one period (`FRAME_SECONDS`) runs before the next overdue
  real-time step, one such call between two real-time steps: a lone call waits at most one
  period and about one step;
- a ready background job passed over for `BACKGROUND_AFTER` real-time steps in a row (real
  time behind, or gaps always too short for its step) takes the next turn: it gets at least
  one step in every `BACKGROUND_AFTER + 1`, and that real-time step waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

import mlx.core as mx

from moshi_mlx.errors import MoshiError, one_line

T = TypeVar("T")
FRAME_SECONDS = 0.08  # one frame of Kyutai's codec: the real-time jobs' period
# Items a background job may have produced and its reader not yet taken.
MAX_UNREAD_ITEMS = 64
_EWMA = 0.2  # weight of the newest background step in its running duration
# Real-time steps a ready background job may be passed over for before it takes a turn: when
# real time is behind, 1 step in 5 goes to the LLM (it slows the real-time jobs by a fifth
# of the thread, where they are late already, rather than never answering).
BACKGROUND_AFTER = 4

log = logging.getLogger("moshi_mlx.runtime")


class ModelThreadStopped(MoshiError):
    """The model thread stopped before it ran the work."""


@dataclass
class ClockStats:
    """How late a real-time job's steps started (seconds past their due time)."""

    steps: int = 0
    max_lag: float = 0.0
    total_lag: float = 0.0

    def add(self, lag: float) -> None:
        self.steps += 1
        self.max_lag = max(self.max_lag, lag)
        self.total_lag += lag

    @property
    def mean_lag(self) -> float:
        return self.total_lag / self.steps if self.steps else 0.0


class RealTimeClock:
    """A real-time job: `step()` runs on the model thread once `due_at()` has passed.

    Subclasses say when their next step is due (a monotonic time, or None while they have
    nothing to step; call `ModelThread.wake` when that changes) and what a step does. A step
    that raises removes the job and is passed to `failed`, on the model thread.
    """

    period: float = FRAME_SECONDS

    def __init__(self) -> None:
        self.stats = ClockStats()

    def due_at(self) -> float | None:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def failed(self, exc: BaseException) -> None:
        log.error("a real-time job failed: %s", one_line(exc))


class _Call:
    def __init__(self, fn: Callable[[], object], internal: bool = False):
        self.fn = fn
        self.internal = internal  # the thread's own housekeeping: nobody awaits it
        self.queued = time.monotonic()
        self.future: concurrent.futures.Future = concurrent.futures.Future()


class _BackgroundJob(Generic[T]):
    """A background iterator on the thread, its items queued for one reader on a loop."""

    def __init__(self, thread: ModelThread, steps: Iterator[T], loop: asyncio.AbstractEventLoop):
        self.thread = thread
        self.steps = steps
        self.loop = loop
        self.items: asyncio.Queue = asyncio.Queue()
        self.unread = 0  # written under the thread's lock
        self.closing = False  # the reader closed it
        self.orphaned = False  # the reader's loop is gone
        self.done = False

    # --- model thread ---
    def advance(self) -> None:
        """One `next()`; its item (or the end, or the error) goes to the reader."""
        try:
            item = next(self.steps)
        except StopIteration:
            self._finish(_End())
            return
        except BaseException as exc:  # noqa: BLE001 - handed to the reader
            self._finish(_Raised(exc))
            return
        self._deliver(item)

    def close_steps(self) -> None:
        try:
            close = getattr(self.steps, "close", None)
            if close is not None:
                close()
        except Exception as exc:  # noqa: BLE001 - the reader has gone; nothing to tell
            log.warning("closing a background job failed: %s", one_line(exc))

    def _finish(self, last: object) -> None:
        self.done = True
        self._deliver(last)

    def _deliver(self, item: object) -> None:
        with self.thread._lock:
            self.unread += 1
        try:
            self.loop.call_soon_threadsafe(self.items.put_nowait, item)
        except RuntimeError:  # the reader's loop is closed
            self.orphaned = True


@dataclass(frozen=True)
class _End:
    pass


@dataclass(frozen=True)
class _Raised:
    exc: BaseException


class BackgroundIterator(AsyncIterator[T]):
    """The items of a background job, in order; `aclose()` stops the job."""

    def __init__(self, job: _BackgroundJob[T]):
        self._job = job
        self._ended = False

    def __aiter__(self) -> BackgroundIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._ended:
            raise StopAsyncIteration
        try:
            item = await self._job.items.get()
        except BaseException:
            await self.aclose()
            raise
        self._job.thread._taken(self._job)
        if isinstance(item, _End):
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, _Raised):
            self._ended = True
            raise item.exc
        return item

    async def aclose(self) -> None:
        """Stop the job: no more `next()`, and the iterator's `close()` on the thread."""
        self._ended = True
        self._job.thread._close_background(self._job)


class ModelThread:
    """The thread that runs every MLX call of a server process (MLX streams, compile caches
    and random state are per thread; two threads driving Metal at once crash it)."""

    def __init__(self, name: str = "moshi-mlx-model") -> None:
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._calls: deque[_Call] = deque()
        self._clocks: list[RealTimeClock] = []
        self._jobs: list[_BackgroundJob] = []
        self._job_turn = itertools.count()
        self._background_seconds = 0.0  # running mean of one background step
        self._passed_over = 0  # real-time steps run in a row while a background job was ready
        self._call_went_first = False  # a late call ran ahead of the overdue real-time step
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """End the thread after the work running now; pending calls fail with a MoshiError."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if not self._thread.is_alive():
            self._fail_pending()
        elif threading.current_thread() is not self._thread:
            self._thread.join()

    @property
    def on_thread(self) -> bool:
        """Whether the caller runs on the model thread."""
        return threading.current_thread() is self._thread

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` once on the thread (load, warm-up, a short request) and return its result;
        its exception propagates."""
        return await asyncio.wrap_future(self.call_soon(fn))

    def call_soon(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """`call`, from any thread: the future of `fn`'s result."""
        call = _Call(fn)
        with self._wake:
            if self._stopping:
                call.future.set_exception(ModelThreadStopped("the model thread has stopped"))
            else:
                self._calls.append(call)
                self._wake.notify()
        return call.future

    def add_realtime(self, clock: RealTimeClock) -> None:
        """A real-time job: its `step()` runs whenever `due_at()` has passed."""
        with self._wake:
            self._clocks.append(clock)
            self._wake.notify()

    def remove_realtime(self, clock: RealTimeClock) -> None:
        """Stop stepping `clock` (a step running now finishes)."""
        with self._wake:
            if clock in self._clocks:
                self._clocks.remove(clock)

    def wake(self) -> None:
        """A real-time job's `due_at()` may have changed (new audio, a new row)."""
        with self._wake:
            self._wake.notify()

    def background(self, steps: Iterator[T]) -> AsyncIterator[T]:
        """A background job (an LLM's tokens), read on the running event loop: `next(steps)`
        runs on the thread only when no real-time step is due; the items arrive in order;
        closing the returned iterator stops the job (`steps.close()` on the thread)."""
        job = _BackgroundJob(self, steps, asyncio.get_running_loop())
        with self._wake:
            stopped = self._stopping
            if not stopped:
                self._jobs.append(job)
                self._wake.notify()
        if stopped:
            job._finish(_Raised(ModelThreadStopped("the model thread has stopped")))
        return BackgroundIterator(job)

    def _taken(self, job: _BackgroundJob) -> None:
        with self._wake:
            job.unread -= 1
            if job.unread == MAX_UNREAD_ITEMS - 1:
                self._wake.notify()

    def _close_background(self, job: _BackgroundJob) -> None:
        with self._wake:
            if job.closing:
                return
            job.closing = True
            if job in self._jobs:
                self._jobs.remove(job)
                self._calls.append(_Call(job.close_steps, internal=True))
                self._wake.notify()

    # --- the thread ---
    def _run(self) -> None:
        try:
            while True:
                work = self._next_work()
                if work is None:
                    break
                work()
            self._fail_pending()
        finally:
            release_thread_state()

    def _next_work(self) -> Callable[[], None] | None:
        """Wait for the next thing to run; None once stopping."""
        with self._wake:
            while not self._stopping:
                now = time.monotonic()
                clock, due = self._earliest_clock()
                if clock is not None and due <= now:
                    return self._overdue_work(clock, now - due, now)
                if self._calls:
                    call = self._calls.popleft()
                    return lambda: _run_call(call)
                job = self._ready_job()
                if job is not None and self._background_fits(clock, due - now):
                    return lambda: self._step_job(job)
                self._wake.wait(None if due == _NEVER else due - now)
            return None

    def _overdue_work(self, clock: RealTimeClock, lag: float, now: float) -> Callable[[], None]:
        """What runs while `clock` is due: its step, unless a call has waited over a period
        or a background job over `BACKGROUND_AFTER` real-time steps (see the module
        docstring). Called under the lock."""
        if (
            self._calls
            and not self._call_went_first
            and now - self._calls[0].queued > FRAME_SECONDS
        ):
            self._call_went_first = True
            call = self._calls.popleft()
            return lambda: _run_call(call)
        if self._passed_over >= BACKGROUND_AFTER:
            job = self._ready_job()
            if job is not None:
                return lambda: self._step_job(job)
        self._call_went_first = False
        if any(job.unread < MAX_UNREAD_ITEMS for job in self._jobs):
            self._passed_over += 1
        return lambda: self._step_clock(clock, lag)

    def _earliest_clock(self) -> tuple[RealTimeClock | None, float]:
        earliest, due = None, _NEVER
        for clock in self._clocks:
            at = clock.due_at()
            if at is not None and at < due:
                earliest, due = clock, at
        return earliest, due

    def _background_fits(self, clock: RealTimeClock | None, gap: float) -> bool:
        """Whether a background step may start `gap` seconds before the next real-time step:
        it is expected to end in time, or it never could (over half a period: it runs anyway
        right after a real-time step, which then waits for it)."""
        if clock is None or gap >= self._background_seconds:
            return True
        return self._background_seconds > clock.period / 2

    def _ready_job(self) -> _BackgroundJob | None:
        """The next background job with room for an item, in turn."""
        ready = [job for job in self._jobs if job.unread < MAX_UNREAD_ITEMS]
        if not ready:
            return None
        return ready[next(self._job_turn) % len(ready)]

    def _step_clock(self, clock: RealTimeClock, lag: float) -> None:
        clock.stats.add(lag)
        try:
            clock.step()
        except BaseException as exc:  # noqa: BLE001 - ends this job, not the thread
            self.remove_realtime(clock)
            clock.failed(exc)

    def _step_job(self, job: _BackgroundJob) -> None:
        start = time.monotonic()
        job.advance()
        elapsed = time.monotonic() - start
        with self._wake:
            self._passed_over = 0
            self._background_seconds += _EWMA * (elapsed - self._background_seconds)
            finished = job.done or job.orphaned
            if finished and job in self._jobs:
                self._jobs.remove(job)
        if job.orphaned and not job.done:
            job.close_steps()

    def _fail_pending(self) -> None:
        with self._wake:
            calls, self._calls = list(self._calls), deque()
            jobs, self._jobs = list(self._jobs), []
            self._clocks.clear()
        stopped = ModelThreadStopped("the model thread has stopped")
        for call in calls:
            if call.internal:
                _run_call(call)
            elif call.future.set_running_or_notify_cancel():  # not cancelled meanwhile
                call.future.set_exception(stopped)
        for job in jobs:
            job._finish(_Raised(stopped))


_NEVER = float("inf")


def release_thread_state() -> None:
    """Drop MLX's state of the calling thread (its streams, compile cache and random key),
    as the last thing a thread that ran MLX work does. The compile cache and the key hold
    Python objects: left to the thread's exit, they are freed after Python has let the thread
    go, by C++ destructors that need the interpreter; when the process is exiting meanwhile
    (Ctrl-C, SIGTERM, a start-up error) the thread cannot have it and the process aborts
    (`terminate called without an active exception`, exit code 134)."""
    mx.clear_streams()


def _run_call(call: _Call) -> None:
    if not call.future.set_running_or_notify_cancel():
        return
    try:
        result = call.fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the caller
        call.future.set_exception(exc)
    else:
        call.future.set_result(result)
