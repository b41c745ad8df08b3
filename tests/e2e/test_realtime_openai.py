"""`/v1/realtime` through the `openai` package's own realtime client, unmodified, on a guarded
server with scripted parts (tests/helpers/realtime_helpers.py): a spoken turn with server VAD, a text
turn with no mic audio, a manual commit, a cancel, a barge-in, a transcription session, the
API key and G.711 audio. Every server event is validated against the package's types."""

from __future__ import annotations

import asyncio
import base64

import numpy as np
import openai
import pytest
from realtime_helpers import (
    ANSWER,
    LONG_ANSWER,
    LOUD,
    MODELS,
    NO_VOICE,
    QUIET,
    Parts,
    connected,
    pcm16,
    serving,
)

from moshi_mlx.realtime.config import DEFAULT_VOICE_NAME, WORD_TIMINGS
from moshi_mlx.realtime.formats import PCMU, AudioFormat


@pytest.fixture(scope="module")
def parts():
    return Parts()


@pytest.fixture(scope="module")
def address(parts):
    with serving(parts, frozenset({"sk-test"})) as host_port:
        yield host_port


async def speak(connection, loud: int = 5, quiet: int = 15) -> None:
    await connection.input_audio_buffer.append(audio=pcm16([LOUD] * loud + [QUIET] * quiet))


async def ask(connection, text: str) -> None:
    """A user's text message, added to the conversation."""
    await connection.conversation.item.create(
        item={"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
    )


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


@pytest.fixture
def long_answer(parts):
    """The LLM answers `LONG_ANSWER` (40 words) during the test."""
    parts.words = LONG_ANSWER
    yield
    parts.words = ANSWER


@pytest.fixture
def voiceless(parts):
    """Sessions start with no voice during the test (as on a TTS of cloned voices only)."""
    parts.voice = None
    yield
    parts.voice = DEFAULT_VOICE_NAME


def test_a_session_with_no_voice_writes_a_turns_answer_until_one_is_set(address, parts, voiceless):
    """A session that starts with no voice (`null`): a spoken turn's answer (server VAD) is
    written, after an `error` on the voice saying why; once the client names a voice, the
    next turn's answer is spoken."""

    async def body():
        async with connected(address) as (connection, events):
            assert events.all[0]["session"]["audio"]["output"]["voice"] is None
            await speak(connection)
            done = await events.wait("response.done")
            error = events.all[await events.wait("error")]["error"]
            assert error["code"] == "voice_not_found" and NO_VOICE in error["message"]
            assert error["param"] == "session.audio.output.voice"
            assert events.kinds().index("error") < events.kinds().index("response.created")
            written = events.all[done]["response"]
            assert written["status"] == "completed" and written["output_modalities"] == ["text"]
            assert "".join(e["delta"] for e in events.of("response.output_text.delta"))
            assert not events.of("response.output_audio.delta")
            await connection.session.update(
                session={"type": "realtime", "audio": {"output": {"voice": "marin"}}}
            )
            await events.wait("session.updated")
            await speak(connection)
            spoken = (await events.event("response.done", done + 1))["response"]
            assert spoken["status"] == "completed" and spoken["output_modalities"] == ["audio"]
            assert events.of("response.output_audio.delta", done) and parts.voices[-1] == "marin"
            assert len(events.of("error")) == 1

    run(body())


def test_a_spoken_turn_with_server_vad(address, parts):
    async def body():
        async with connected(address) as (connection, events):
            await connection.session.update(
                session={
                    "type": "realtime",
                    "instructions": "Be brief.",
                    "audio": {
                        "output": {"voice": "marin"},
                        "input": {"turn_detection": {"type": "semantic_vad", "eagerness": "high"}},
                    },
                }
            )
            updated = (await events.event("session.updated"))["session"]
            assert updated["instructions"] == "Be brief." and updated["model"] == MODELS["llm"]
            assert updated["audio"]["input"]["turn_detection"]["eagerness"] == "high"
            await speak(connection)
            started = await events.wait("input_audio_buffer.speech_started")
            stopped = await events.wait("input_audio_buffer.speech_stopped", started)
            item = events.all[started]["item_id"]
            assert events.all[stopped]["item_id"] == item
            done = await events.wait("response.done")
            completed = await events.event("conversation.item.input_audio_transcription.completed")
            assert completed["item_id"] == item and completed["transcript"] == "u0 u1 u2 u3 u4"
            response = events.all[done]["response"]
            assert response["status"] == "completed", response
            transcript = response["output"][0]["content"][0]["transcript"]
            assert transcript == "Paris is lovely."
            kinds = events.kinds(stopped, done + 1)
            order = [
                "input_audio_buffer.committed",
                "conversation.item.input_audio_transcription.completed",
                "response.created",
                "response.output_item.added",
                "response.content_part.added",
                "response.output_audio.delta",
                "response.output_audio_transcript.delta",
                "response.output_audio.done",
                "response.output_audio_transcript.done",
                "response.content_part.done",
                "response.output_item.done",
                "response.done",
            ]
            assert [kinds.index(k) for k in order] == sorted(kinds.index(k) for k in order)
            deltas = events.of("response.output_audio.delta", stopped, done)
            assert len(deltas) == 3 * 3  # three words, three frames each
            audio = base64.b64decode(deltas[0]["delta"])
            assert len(audio) == 2 * 1920
            spoken = "".join(
                e["delta"] for e in events.of("response.output_audio_transcript.delta")
            )
            assert spoken == transcript
            assert parts.llm.prompts[-1][0] == {"role": "system", "content": "Be brief."}
            assert parts.voices[-1] == "marin"

    run(body())


def test_a_text_turn_with_no_mic_audio(address, parts):
    async def body():
        async with connected(address) as (connection, events):
            await ask(connection, "Where is Paris?")
            added = (await events.event("conversation.item.added"))["item"]
            assert added["content"][0]["text"] == "Where is Paris?"
            # the request's metadata comes back on its response (LiveKit's plugin matches
            # its generate_reply to response.created by it)
            await connection.response.create(response={"metadata": {"client_event_id": "r1"}})
            created = (await events.event("response.created"))["response"]
            done = (await events.event("response.done"))["response"]
            assert done["status"] == "completed"
            assert created["metadata"] == done["metadata"] == {"client_event_id": "r1"}
            assert parts.llm.prompts[-1][-1] == {"role": "user", "content": "Where is Paris?"}

    run(body())


def test_a_manual_commit_then_a_response(address, parts):
    async def body():
        async with connected(address) as (connection, events):
            await connection.session.update(
                session={"type": "realtime", "audio": {"input": {"turn_detection": None}}}
            )
            await events.wait("session.updated")
            await speak(connection, loud=4, quiet=20)
            await asyncio.sleep(0.5)  # the pause head does not end the turn
            assert "input_audio_buffer.speech_stopped" not in events.kinds()
            await connection.input_audio_buffer.commit()
            committed = await events.wait("input_audio_buffer.committed")
            text = (await events.event("conversation.item.input_audio_transcription.completed"))[
                "transcript"
            ]
            assert text == "u0 u1 u2 u3"
            await asyncio.sleep(0.3)
            assert "response.created" not in events.kinds(committed)  # none until asked
            await connection.response.create()
            await events.wait("response.done", committed)
            await connection.input_audio_buffer.commit()  # nothing appended since
            error = (await events.event("error", committed))["error"]
            assert error["code"] == "input_audio_buffer_commit_empty"

    run(body())


def test_cancel_ends_the_response_cancelled(address, long_answer):
    async def body():
        async with connected(address) as (connection, events):
            await ask(connection, "Count.")
            await connection.response.create()
            await events.wait("response.output_audio.delta")
            await connection.response.cancel()
            done = (await events.event("response.done"))["response"]
            assert done["status"] == "cancelled"
            assert done["status_details"]["reason"] == "client_cancelled"
            await connection.response.cancel()  # none runs now
            error = (await events.event("error"))["error"]
            assert error["code"] == "response_cancel_not_active"

    run(body())


def test_a_barge_in_cancels_the_answer_within_a_frame(address, long_answer):
    async def body():
        async with connected(address) as (connection, events):
            await ask(connection, "Talk.")
            await connection.response.create()
            first = await events.wait("response.output_audio.delta")
            await asyncio.sleep(0.5)
            await speak(connection, loud=3, quiet=15)
            started = await events.wait("input_audio_buffer.speech_started", first)
            done = await events.wait("response.done", first)
            assert started < done
            response = events.all[done]["response"]
            assert response["status"] == "cancelled"
            assert response["status_details"]["reason"] == "turn_detected"
            truncated = await events.event("conversation.item.truncated", first)
            assert truncated["item_id"] == response["output"][0]["id"]
            assert 0 < truncated["audio_end_ms"] < 40 * 3 * 80
            assert not events.of("response.output_audio.delta", done)
            heard = response["output"][0]["content"][0]["transcript"]
            assert heard and LONG_ANSWER[0] in heard and len(heard.split()) < 40
            # the user's turn goes on and is answered
            await events.wait("response.created", done + 1)

    run(body())


def test_a_transcription_session_with_word_timings(address):
    async def body():
        async with connected(address, intent="transcription", model=MODELS["stt"]) as (
            connection,
            events,
        ):
            created = events.all[0]["session"]
            assert created["type"] == "transcription"
            await connection.session.update(
                session={"type": "transcription", "include": [WORD_TIMINGS]}
            )
            await events.wait("session.updated")
            await speak(connection, loud=3, quiet=10)
            delta = await events.wait("conversation.item.input_audio_transcription.delta")
            first = await events.wait("conversation.item.input_audio_transcription.completed")
            completed = events.all[first]
            assert completed["transcript"] == "u0 u1 u2"
            assert completed["item_id"] == events.all[delta]["item_id"]
            segments = events.of("conversation.item.input_audio_transcription.segment")
            assert [s["text"] for s in segments] == ["u0", "u1", "u2"]
            assert all(s["start"] <= s["end"] for s in segments)
            await speak(connection, loud=2, quiet=10)  # a second turn, a second item
            second = await events.event(
                "conversation.item.input_audio_transcription.completed", first + 1
            )
            assert second["item_id"] != completed["item_id"]
            await connection.response.create()
            error = (await events.event("error"))["error"]
            assert "transcription" in error["message"]
            assert "response.created" not in events.kinds()

    run(body())


def test_telephony_audio_is_resampled_both_ways(address):
    pcmu = AudioFormat(PCMU)

    async def body():
        async with connected(address) as (connection, events):
            g711 = {"type": PCMU}
            await connection.session.update(
                session={
                    "type": "realtime",
                    "audio": {"input": {"format": g711}, "output": {"format": g711}},
                }
            )
            await events.wait("session.updated")
            frames = [LOUD] * 4 + [QUIET] * 15
            data = base64.b64encode(pcmu.encode(np.concatenate(frames))).decode()
            await connection.input_audio_buffer.append(audio=data)
            completed = await events.wait("conversation.item.input_audio_transcription.completed")
            assert events.all[completed]["transcript"].startswith("u0 u1 u2")
            delta = await events.event("response.output_audio.delta")
            assert len(base64.b64decode(delta["delta"])) == 640  # 80 ms at 8 kHz, a byte each

    run(body())


def test_a_wrong_key_or_model_is_refused(address):
    async def attempt(key: str, model: str):
        client = openai.AsyncOpenAI(api_key=key, base_url=f"http://{address}/v1")
        async with client.realtime.connect(model=model) as connection:
            await connection.recv()

    with pytest.raises(Exception, match="401"):
        run(attempt("wrong", MODELS["llm"]))
    with pytest.raises(Exception, match="404"):
        run(attempt("sk-test", "gpt-realtime"))


def test_moshi_full_duplex_is_one_long_response(address, parts):
    """A Moshi session (`?model=` names it; a fake full-duplex conversation): the persona from
    `voice` and `instructions`, a reply frame per mic frame as audio deltas of one response,
    Moshi's words as transcript deltas; `response.cancel` silences it until `response.create`."""

    async def body():
        async with connected(address, model=MODELS["moshi"]) as (connection, events):
            created = events.all[0]["session"]
            assert created["audio"]["input"]["turn_detection"] is None
            await connection.session.update(
                session={"type": "realtime", "instructions": "You teach maths.",
                         "audio": {"output": {"voice": "NATF2"}}}
            )  # fmt: skip
            await events.wait("session.updated")
            await connection.input_audio_buffer.append(audio=pcm16([QUIET] * 6))
            response = (await events.event("response.created"))["response"]
            deltas = 0
            while deltas < 6:
                at = await events.wait("response.output_audio.delta")
                deltas = len(events.of("response.output_audio.delta"))
            assert parts.duplexes[-1].persona == ("NATF2", "You teach maths.")
            deltas = events.of("response.output_audio.delta")
            assert all(e["response_id"] == response["id"] for e in deltas)
            words = [e["delta"] for e in events.of("response.output_audio_transcript.delta")]
            assert words == ["m0 ", "m1 "]
            await connection.response.cancel()
            done = (await events.event("response.done", at))["response"]
            assert (
                done["status"] == "cancelled"
                and done["output"][0]["content"][0]["transcript"] == "m0 m1 "
            )
            await connection.input_audio_buffer.append(audio=pcm16([QUIET] * 3))
            await asyncio.sleep(0.3)  # heard, not answered: silenced
            assert parts.duplexes[-1].frames == 9
            assert len(events.of("response.output_audio.delta")) == 6
            await connection.response.create(response={"metadata": {"client_event_id": "r2"}})
            again = await events.wait("response.created", at + 1)
            assert events.all[again]["response"]["metadata"] == {"client_event_id": "r2"}
            await connection.input_audio_buffer.append(audio=pcm16([QUIET]))
            await events.wait("response.output_audio.delta", again)
            await connection.input_audio_buffer.commit()
            error = (await events.event("error", again))["error"]
            assert error["code"] == "unsupported_event"

    run(body())


def test_a_first_response_greets_under_its_own_instructions(address, parts):
    async def body():
        async with connected(address) as (connection, events):
            await connection.response.create(response={"instructions": "Greet the user."})
            done = (await events.event("response.done"))["response"]
            assert done["status"] == "completed"
            prompt = parts.llm.prompts[-1]
            assert prompt[0] == {"role": "system", "content": "Greet the user."}
            assert prompt[1]["role"] == "user" and len(prompt) == 2  # the greeting request

    run(body())


def test_a_text_only_session_writes_its_answers(address, parts):
    """`output_modalities: ["text"]` (the `openai` package's README example): the answer as
    `response.output_text.delta`s, the LLM's text whole, no audio; a response may ask for
    audio again."""

    async def body():
        async with connected(address) as (connection, events):
            await connection.session.update(
                session={"type": "realtime", "output_modalities": ["text"]}
            )
            await events.wait("session.updated")
            await ask(connection, "Say hello!")
            await connection.response.create()
            done = (await events.event("response.done"))["response"]
            assert done["status"] == "completed" and done["output_modalities"] == ["text"]
            text = "".join(e["delta"] for e in events.of("response.output_text.delta"))
            assert text == "Paris is **lovely**. "  # as the LLM wrote it
            written = (await events.event("response.output_text.done"))["text"]
            assert written == text and done["output"][0]["content"][0]["text"] == text
            assert not events.of("response.output_audio.delta")
            await connection.response.create(response={"output_modalities": ["audio"]})
            first_done = await events.wait("response.done")
            spoken = (await events.event("response.done", first_done + 1))["response"]
            assert spoken["output_modalities"] == ["audio"]
            assert events.of("response.output_audio.delta")

    run(body())
