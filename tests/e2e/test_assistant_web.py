"""The assistant's browser route of `python -m moshi_mlx serve` (`/api/assistant`, the page at
`/assistant/`), through a Python websocket client speaking Kyutai's chat protocol with Ogg
Opus audio, on the server's guard and a real `ModelThread`, with scripted parts: an STT that
hears a word in every loud frame and whose pause head says "done" on silence (so the end of
the turn fires as Unmute's rule reads it), an LLM that streams given words, a TTS that makes
three frames of a tone per word."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import numpy as np
import pytest
import soundfile as sf
import sphn
from assistant_fakes import FRAMES_PER_WORD, FrameSpeech, ScriptedStt
from chromium import Chromium, chromium_binary, poll_stats
from served_app import served, start_guarded, with_routes

from moshi_mlx.assistant import TurnRules
from moshi_mlx.llm import TextPiece
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.assistant import server
from moshi_mlx.serve.assistant.conversation import AssistantConfig, ConversationParts
from moshi_mlx.serve.chat.protocol import Kind
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally

_TIME = np.arange(FRAME_SIZE) / SAMPLE_RATE
LOUD = (0.3 * np.sin(2 * np.pi * 440 * _TIME)).astype(np.float32)
QUIET = np.zeros(FRAME_SIZE, np.float32)
LOUD_RMS = 0.05  # the scripted STT hears a word in a frame louder than this
ANSWER = (0.5 * np.sin(2 * np.pi * 330 * _TIME)).astype(np.float32)
GREETING = ["Hello", "there!"]
ANSWER_WORDS = ["Paris", "is", "**lovely**."]


class ScriptedLlm:
    """The greeting to the first prompt, `ANSWER_WORDS` to the others."""

    context_length = None

    def __init__(self):
        self.prompts: list[list[dict[str, str]]] = []

    def encode_chat(self, messages):
        return [0] * sum(len(m["content"].split()) for m in messages)

    def generate(self, messages, temperature=1.0, top_p=1.0, max_tokens=None, stop=()):
        self.prompts.append(list(messages))
        words = GREETING if len(self.prompts) == 1 else ANSWER_WORDS
        return iter([*(TextPiece(f"{word} ") for word in words), TextPiece("", "stop")])


@contextlib.contextmanager
def serving(hears: bool = True):
    """The assistant's routes on a guarded server in a thread of its own: yields host:port."""
    thread = ModelThread("test-assistant-web")
    thread.start()
    context = ServeContext(thread, EventTally(logging.getLogger("test")))
    config = AssistantConfig(rules=TurnRules(ignore_start=0.0), limits=context.limits)

    async def make_parts(_voice: str | None) -> ConversationParts:
        return ConversationParts(
            ScriptedStt(hears, LOUD_RMS), ScriptedLlm(), lambda: FrameSpeech(ANSWER)
        )

    try:
        with served(
            context, with_routes(server.add_routes, context, config, make_parts)
        ) as address:
            yield address
    finally:
        thread.stop()


@pytest.fixture(scope="module")
def address():
    with serving() as host_port:
        yield host_port


class Client:
    """One websocket: sends Ogg Opus frames, collects what comes back."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse):
        self.ws = ws
        self.opus = sphn.OpusStreamWriter(SAMPLE_RATE)
        self.events: list[dict] = []
        self.words: list[str] = []
        self.audio: list[bytes] = []
        self.kinds: list[int] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for message in self.ws:
            if message.type != aiohttp.WSMsgType.BINARY:
                break
            kind, payload = message.data[0], message.data[1:]
            self.kinds.append(kind)
            if kind == Kind.AUDIO:
                self.audio.append(payload)
            elif kind == Kind.TEXT:
                self.words.append(payload.decode())
            elif kind == Kind.METADATA:
                self.events.append(json.loads(payload))

    async def send(self, frame: np.ndarray, count: int) -> None:
        for _ in range(count):
            pages = self.opus.append_pcm(frame)
            if pages:
                await self.ws.send_bytes(bytes([Kind.AUDIO]) + pages)
            await asyncio.sleep(0.02)

    async def until(self, key: str, count: int = 1, timeout: float = 10.0) -> None:
        """Send silence until `count` events with `key` came."""
        for _ in range(int(timeout / 0.02)):
            if sum(key in event for event in self.events) >= count:
                return
            await self.send(QUIET, 1)
        raise AssertionError(f"no {count} {key!r} in {self.events}")

    def decoded(self) -> np.ndarray:
        reader = sphn.OpusStreamReader(SAMPLE_RATE)
        pcm = [reader.append_bytes(chunk) for chunk in self.audio]
        return np.concatenate([p for p in pcm if p.size] or [np.zeros(0, np.float32)])


def test_a_spoken_turn_through_the_websocket(address):
    async def main():
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"ws://{address}{server.SOCKET_PATH}") as ws,
        ):
            client = Client(ws)
            await client.until("answer_ended")  # the greeting, played out
            greeting_words = list(client.words)
            await client.send(LOUD, 3)
            await client.until("answer_ended", 2)
            await ws.close()
            await client._reader
            return client, greeting_words

    client, greeting_words = asyncio.run(main())
    assert client.kinds[0] == Kind.HANDSHAKE
    assert client.events[0]["assistant"] is True and client.events[0]["frame_ms"] == 80
    assert "".join(greeting_words).split() == ["Hello", "there!"]
    # Opus's delay spreads three loud frames over three or four of the server's frames.
    heard = [e["user"] for e in client.events if "user" in e]
    assert heard in (["u0", "u1", "u2"], ["u0", "u1", "u2", "u3"])
    assert [e["user_said"] for e in client.events if "user_said" in e] == [" ".join(heard)]
    ended = [e for e in client.events if "answer_ended" in e]
    assert ended == [
        {"answer_ended": "Hello there!", "cut_off": False},
        {"answer_ended": "Paris is lovely.", "cut_off": False},
    ]
    assert "".join(client.words).split() == ["Hello", "there!", "Paris", "is", "lovely."]
    [latency] = [e["latency"] for e in client.events if "latency" in e]
    assert set(latency) == {
        "detection", "stt_flush", "llm_first_token", "tts_first_audio", "audio_out", "total",
    }  # fmt: skip
    assert 0 <= latency["total"] < 2000
    # The answers' tone came back through Opus: 2 + 3 words of 3 frames each.
    pcm = client.decoded()
    loud = [np.sqrt(np.mean(np.square(f))) > 0.2 for f in pcm[: len(pcm) // FRAME_SIZE * FRAME_SIZE].reshape(-1, FRAME_SIZE)]  # fmt: skip
    assert 5 * FRAMES_PER_WORD - 2 <= sum(loud) <= 5 * FRAMES_PER_WORD + 1


def test_a_second_conversation_is_refused_while_one_runs(address):
    async def main():
        url = f"ws://{address}{server.SOCKET_PATH}"
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as first:
            first_client = Client(first)
            await first_client.send(QUIET, 2)
            async with session.ws_connect(url) as second:
                message = await second.receive(timeout=5)
                closing = await second.receive(timeout=5)
            await first.close()
            await first_client._reader
            return message.data, closing.type, first_client.kinds

    message, closing, first_kinds = asyncio.run(main())
    assert message[0] == Kind.ERROR and message[1:].decode() == server.BUSY
    assert closing in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED)
    assert first_kinds[0] == Kind.HANDSHAKE


def test_a_page_of_another_site_may_not_open_the_websocket(address):
    async def main():
        async with aiohttp.ClientSession() as session:
            with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                await session.ws_connect(
                    f"ws://{address}{server.SOCKET_PATH}", origin="http://evil.example"
                )
            return refused.value.status

    assert asyncio.run(main()) == 403


def test_the_page_and_its_scripts_are_served(address):
    async def main():
        async with aiohttp.ClientSession() as session:
            async with session.get(f"http://{address}/assistant", allow_redirects=False) as r:
                redirect = r.status, r.headers["Location"]
            bodies = {}
            names = ("", "assistant.js", "voice-link.js", "ogg.js", "audio-worklet.js", "style.css")
            for name in names:
                async with session.get(f"http://{address}/assistant/{name}") as response:
                    bodies[name] = response.status, await response.text()
            return redirect, bodies

    redirect, bodies = asyncio.run(main())
    assert redirect == (302, "/assistant/")
    assert all(status == 200 for status, _ in bodies.values())
    assert "assistant.js" in bodies[""][1]
    assert '"./voice-link.js"' in bodies["assistant.js"][1]
    assert "echoCancellation: true" in bodies["voice-link.js"][1]
    assert "registerProcessor" in bodies["audio-worklet.js"][1]


@pytest.mark.skipif(chromium_binary() is None, reason="chromium not installed")
def test_the_page_greets_in_headless_chromium(tmp_path):
    """The page in Chromium with a silent fake microphone: it connects, plays the greeting
    and shows its words as the assistant's turn."""
    mic = tmp_path / "silence48k.wav"
    sf.write(mic, np.zeros(3 * 48000, np.float32), 48000, subtype="PCM_16")

    async def scenario(url: str):
        with Chromium(tmp_path, fake_mic_wav=mic) as browser:
            async with aiohttp.ClientSession() as session:
                page = await browser.open(session, url)
                await _poll(page, lambda s: True, 10)  # the module has loaded
                await page.evaluate(CLICK_START, user_gesture=True)
                stats = await _poll(page, _greeted, 30)
                shown = await page.evaluate("document.getElementById('turns').textContent")
                state = await page.evaluate("document.getElementById('state').textContent")
                return stats, shown, state, page.console

    with serving(hears=False) as host_port:
        port = host_port.rsplit(":", 1)[1]
        url = f"http://localhost:{port}{server.PAGE_PATH}"
        stats, shown, state, console = asyncio.run(asyncio.wait_for(scenario(url), 50))
    assert _greeted(stats), (stats, console[-20:])
    assert stats["turns"] == [
        {"role": "assistant", "text": "Hello there!", "done": True, "cutOff": False}
    ]
    assert shown == "assistantHello there!" and state.startswith("connected")
    assert stats["receivedAudioMessages"] > 0 and stats["sentSeconds"] > 0


CLICK_START = "document.getElementById('start').click()"


def _greeted(stats: dict) -> bool:
    return stats["state"] == "live" and any(t["done"] for t in stats["turns"])


async def _poll(page, done, timeout: float) -> dict | None:
    return await poll_stats(page, "assistantStats", done, timeout)


def test_serve_mounts_the_assistant_on_real_tiny_models(tmp_path, full_mimi_checkpoint):
    """`serve`'s app with the real tiny TTS and LLM mounts the assistant, whose conversation
    opens real TTS streams (the default voice, from the server's voice repo) and greets: the
    TTS speaks the tiny LLM's first words, which come back as text and audio. The STT is the
    deaf scripted one: random STT weights hear words in silence, which would cut the greeting
    off (as tests/e2e/test_unmute.py, which stands a scripted STT in for the same reason)."""
    from moshi_mlx.llm import LlmModel
    from moshi_mlx.serve.app import create_app
    from moshi_mlx.testing.llm import write_tiny_llm
    from moshi_mlx.tts.synthesizer import TtsModel
    from moshi_mlx.tts.voices import DEFAULT_VOICE

    fixtures = Path(__file__).parents[1] / "fixtures" / "tts"
    voice = tmp_path / "voices" / f"{DEFAULT_VOICE}.0badf00d@7.safetensors"  # the fixture's id
    voice.parent.mkdir(parents=True)
    llm_folder = write_tiny_llm(tmp_path / "llm")
    thread = ModelThread("test-assistant-real")
    thread.start()
    frame_pace = 0.25  # s

    def load() -> dict:
        return {
            "stt": SimpleNamespace(speech_to_text=lambda: ScriptedStt(hears=False)),
            "tts": TtsModel.load(
                moshi_weight=fixtures / "weights.safetensors",
                mimi_weight=full_mimi_checkpoint,
                tokenizer=fixtures / "tokenizer.model",
                lm_config=fixtures / "config.json",
                voice_repo=str(voice.parent.parent),
            ),
            "llm": LlmModel.load(llm_folder),
        }

    context = ServeContext(
        thread, EventTally(logging.getLogger("test")), **thread.call_soon(load).result(60)
    )
    context.model_names.update(stt="tiny-stt", tts="tiny-tts", llm="tiny-llm")

    async def main():
        runner, address = await start_guarded(context, lambda guard: create_app(context, guard))
        try:
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(f"ws://{address}{server.SOCKET_PATH}") as ws,
            ):
                no_voice = await ws.receive(timeout=30)  # the default voice is not there yet
            voice.symlink_to(fixtures / "voices" / "alice.safetensors")
            async with (
                aiohttp.ClientSession() as session,
                session.ws_connect(f"ws://{address}{server.SOCKET_PATH}") as ws,
            ):
                client = Client(ws)
                # Slower than real time: this CPU steps the tiny STT and TTS (full-size Mimi)
                # in over 80 ms together, and the model thread must leave the LLM room.
                for _ in range(200):
                    if client.words:
                        break
                    await client.send(QUIET, 1)
                    await asyncio.sleep(frame_pace)
                await ws.close()
                await client._reader
                return no_voice.data, client
        finally:
            await runner.cleanup()
            await asyncio.to_thread(thread.stop)  # while the loop still takes its results

    no_voice, client = asyncio.run(main())
    assert no_voice[0] == Kind.ERROR and "voice" in no_voice[1:].decode()
    assert client.kinds[0] == Kind.HANDSHAKE
    assert client.events[0]["models"] == {"stt": "tiny-stt", "tts": "tiny-tts", "llm": "tiny-llm"}
    assert client.words and client.words[0].strip(), (
        client.events
    )  # the greeting's first word, spoken
    assert np.abs(client.decoded()).max() > 1e-3  # and its audio (random Mimi: quiet)


def test_a_tts_of_cloned_voices_only_needs_a_cloned_voice_on_the_page(tmp_path):
    """`serve`'s app with the tiny tts-0.75b layout (cloned voices only): a conversation
    without `?voice=` (the page's own query goes to the websocket), or naming an OpenAI voice,
    is refused with one 0x05 message saying how to make a voice and name it on the page; in
    the id `POST /v1/audio/voices` gives, the assistant greets in speech."""
    from assistant_cli import link_tts_folder

    from moshi_mlx.llm import LlmModel
    from moshi_mlx.serve.app import create_app
    from moshi_mlx.serve.cloned_voices import CLONED_VOICES_ONLY
    from moshi_mlx.testing.llm import write_tiny_llm
    from moshi_mlx.testing.turn_stt import write_short_memory_mimi
    from moshi_mlx.tts.synthesizer import TtsModel

    fixtures = Path(__file__).parents[1] / "fixtures" / "tts_075"
    mimi = write_short_memory_mimi(tmp_path / "mimi.safetensors")
    tts_folder = link_tts_folder(tmp_path / "tts", fixtures, mimi)
    llm_folder = write_tiny_llm(tmp_path / "llm")
    recording = tmp_path / "me.wav"
    tone = 0.3 * np.sin(2 * np.pi * 200 * np.arange(24_000) / 24_000)
    sf.write(recording, tone.astype(np.float32), 24_000)
    thread = ModelThread("test-assistant-clone")
    thread.start()

    def load() -> dict:
        return {
            "stt": SimpleNamespace(speech_to_text=lambda: ScriptedStt(hears=False)),
            "tts": TtsModel.load(tts_folder),
            "llm": LlmModel.load(llm_folder),
        }

    context = ServeContext(
        thread, EventTally(logging.getLogger("test")), **thread.call_soon(load).result(60)
    )

    async def refusal(session, query: str) -> bytes:
        async with session.ws_connect(f"ws://{address}{server.SOCKET_PATH}{query}") as ws:
            return (await ws.receive(timeout=30)).data

    async def main():
        nonlocal address
        runner, address = await start_guarded(context, lambda guard: create_app(context, guard))
        try:
            async with aiohttp.ClientSession() as session:
                refused = [await refusal(session, query) for query in ("", "?voice=alloy")]
                upload = await session.post(
                    f"http://{address}/v1/audio/voices", data=recording.read_bytes()
                )
                voice = (await upload.json())["id"]
                url = f"ws://{address}{server.SOCKET_PATH}?voice={voice}"
                async with session.ws_connect(url) as ws:
                    client = Client(ws)
                    for _ in range(300):
                        if client.words and client.audio:
                            break
                        await client.send(QUIET, 1)
                    await ws.close()
                    await client._reader
                return refused, client
        finally:
            await runner.cleanup()
            await asyncio.to_thread(thread.stop)

    address = ""
    refused, client = asyncio.run(main())
    expected = f"{CLONED_VOICES_ONLY} ({server.NO_VOICE_HINT})"
    assert expected.endswith("(on this page: open /assistant/?voice=ID)")
    for message in refused:
        assert message[0] == Kind.ERROR and message[1:].decode() == expected
    assert client.kinds[0] == Kind.HANDSHAKE and client.words[0].strip()  # the greeting
    assert np.abs(client.decoded()).max() > 1e-3  # spoken in the clone's voice
