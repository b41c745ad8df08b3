"""`moshi_mlx.chat.duplex.DuplexSession` on the tiny Moshi: the socket-free full-duplex session
that every chat protocol holds, stepped on a `ModelThread`."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from tiny_moshi import cached_tiny_moshi, load_tiny_model

from moshi_mlx.chat.duplex import DuplexClosed, DuplexLag, DuplexReply, DuplexSession
from moshi_mlx.chat.generate import AUDIO_SAMPLING
from moshi_mlx.errors import AudioError, ConfigError
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.runtime.sampling import Sampling

FRAME = 1920


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    thread = ModelThread()
    thread.start()
    files = cached_tiny_moshi(tmp_path_factory)
    model = thread.call_soon(lambda: load_tiny_model(files)).result(120)
    yield thread, model
    thread.stop()


def _frames(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [(0.1 * rng.standard_normal(FRAME)).astype(np.float32) for _ in range(count)]


def test_replies_equal_the_offline_conversation_and_close_frees_it(loaded):
    thread, model = loaded
    frames = _frames(6)
    sampling = Sampling(0.9, 25), AUDIO_SAMPLING

    async def talk():
        session = DuplexSession(thread, model, sampling, seed=7, max_lag_frames=100)
        session.push(frames[0])  # before start: it waits for the conversation
        seed = await session.start()
        for frame in frames[1:]:
            session.push(frame)
        replies = [await session.next() for _ in frames]
        session.close()
        with pytest.raises(DuplexClosed):
            await session.next()
        await asyncio.wrap_future(thread.call_soon(lambda: None))  # the close ran
        return seed, replies, session.freed

    seed, replies, freed = asyncio.run(talk())
    offline = thread.call_soon(lambda: _offline(model, frames, sampling)).result(60)
    assert seed == 7 and freed
    assert all(isinstance(reply, DuplexReply) for reply in replies)
    assert [r.text for r in replies] == [r.text for r in offline]
    np.testing.assert_array_equal(
        np.stack([r.pcm for r in replies]), np.stack([r.pcm for r in offline])
    )


def _offline(model, frames, sampling):
    with model.conversation(*sampling, seed=7) as conversation:
        return [conversation.step(frame) for frame in frames]


def test_a_backlog_beyond_max_lag_is_dropped_and_told(loaded):
    thread, model = loaded

    async def flood():
        session = DuplexSession(thread, model, seed=1, max_lag_frames=2)
        for frame in _frames(10):  # all waiting before the first step
            session.push(frame)
        await session.start()
        first, second = await session.next(), await session.next()
        session.close()
        return first, second

    lag, reply = asyncio.run(flood())
    assert lag == DuplexLag(9, 9) and isinstance(reply, DuplexReply)


def test_bad_frames_and_a_persona_for_moshi_are_refused(loaded):
    thread, model = loaded

    async def start():
        session = DuplexSession(thread, model, voice="NATF2")
        with pytest.raises(AudioError):
            session.push(np.zeros(100, np.float32))
        try:
            await session.start()
        finally:
            session.close()

    with pytest.raises(ConfigError, match="this model is Moshi"):
        asyncio.run(start())
