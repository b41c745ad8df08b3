"""`moshi_mlx.realtime.LocalRealtime`, the Realtime API inside an app: mic frames pushed from
an "audio callback" thread (never blocking), events and the answer's frames back, a text turn
sent from another thread; scripted parts (tests/helpers/realtime_helpers.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
from realtime_helpers import LOUD, QUIET, Parts, checked

from moshi_mlx.assistant import TurnRules
from moshi_mlx.realtime import LocalRealtime


def _events_until(session, kind: str, timeout: float = 30.0) -> list[dict]:
    seen = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        event = session.next_event(0.5)
        if event is None:
            continue
        seen.append(checked(event))
        if event["type"] == kind:
            return seen
    raise AssertionError(f"no {kind}: {[e['type'] for e in seen]}")


def _pulled_frames(session) -> list[np.ndarray]:
    """The audio frames a session has ready, pulled until none is left."""
    frames = []
    while (frame := session.pull()) is not None:
        frames.append(frame)
    return frames


def test_an_app_talks_to_the_assistant_in_process():
    realtime = LocalRealtime(Parts().make, rules=TurnRules(ignore_start=0.0))
    try:
        session = realtime.session({"type": "realtime", "instructions": "Be brief."})
        assert session.next_event(5)["type"] == "session.created"
        pulled: list[np.ndarray] = []
        push_seconds: list[float] = []

        def audio_callback_thread():  # 80 ms frames, as a sound card's callback would
            for frame in [LOUD] * 4 + [QUIET] * 40:
                start = time.perf_counter()
                session.push(frame)
                reply = session.pull()
                push_seconds.append(time.perf_counter() - start)
                if reply is not None:
                    pulled.append(reply)
                time.sleep(0.02)

        callback = threading.Thread(target=audio_callback_thread)
        callback.start()
        seen = _events_until(session, "response.done")
        callback.join()
        kinds = [event["type"] for event in seen]
        assert "input_audio_buffer.speech_started" in kinds
        assert seen[-1]["response"]["status"] == "completed"
        while (frame := session.pull()) is not None:
            pulled.append(frame)
        assert len(pulled) == 9 and all(f.shape == (1920,) for f in pulled)
        # never waits for the model: well under a frame (on a loaded machine a preempted
        # thread may wait for a CPU now and then, whatever it runs)
        assert np.median(push_seconds) < 0.001, push_seconds
        assert np.percentile(push_seconds, 90) < 0.005, push_seconds

        session.send({"type": "conversation.item.create", "item": {"type": "message",
                      "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})  # fmt: skip
        session.send({"type": "response.create"})
        assert _events_until(session, "response.done")[-1]["response"]["status"] == "completed"
        session.send({"type": "bogus"})
        assert _events_until(session, "error")[-1]["error"]["code"] == "unknown_event"
        session.close()
    finally:
        realtime.close()


def test_load_talks_with_real_tiny_models(tmp_path):
    """`LocalRealtime.load` on the tiny STT, TTS and LLM folders (tests/helpers/assistant_cli.py): a
    text turn is answered in audio."""
    from assistant_cli import write_model_flags

    from moshi_mlx.tts.voices import DEFAULT_VOICE

    flags = write_model_flags(tmp_path)
    folders = dict(zip(flags[0:6:2], flags[1:6:2], strict=True))
    voices = tmp_path / "voices"
    voice = voices / f"{DEFAULT_VOICE}.0badf00d@7.safetensors"  # the tiny TTS's model id
    voice.parent.mkdir(parents=True)
    voice.symlink_to(flags[flags.index("--voice") + 1])
    realtime = LocalRealtime.load(
        folders["--stt"], folders["--tts"], folders["--llm"], voice_repo=str(voices)
    )
    try:
        session = realtime.session({"type": "realtime", "max_output_tokens": 8})
        session.send({"type": "conversation.item.create", "item": {"type": "message",
                      "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})  # fmt: skip
        session.send({"type": "response.create"})
        done = _events_until(session, "response.done", timeout=120)[-1]["response"]
        assert done["status"] == "completed", done
        frames = _pulled_frames(session)
        assert frames and all(f.shape == (1920,) and f.dtype == np.float32 for f in frames)
        session.close()
    finally:
        realtime.close()


def test_a_tts_of_cloned_voices_only_speaks_in_a_recordings_voice(tmp_path):
    """`LocalRealtime.load` with the tiny tts-0.75b layout (cloned voices only): a session
    starts with no voice; a spoken answer, or a voice name, is an `error` saying to give a
    recording; a recording as the session's voice is cloned and a text turn answered in it."""
    import soundfile as sf
    from assistant_cli import ROOT, write_model_flags

    from moshi_mlx.realtime.local import CLONED_VOICES_ONLY

    flags = write_model_flags(tmp_path, tts_fixtures=ROOT / "tests" / "fixtures" / "tts_075")
    folders = dict(zip(flags[0:6:2], flags[1:6:2], strict=True))
    recording = tmp_path / "me.wav"
    tone = 0.3 * np.sin(2 * np.pi * 200 * np.arange(24_000) / 24_000)
    sf.write(recording, tone.astype(np.float32), 24_000)
    realtime = LocalRealtime.load(folders["--stt"], folders["--tts"], folders["--llm"])
    try:
        session = realtime.session({"type": "realtime", "max_output_tokens": 4})
        created = _events_until(session, "session.created")[-1]
        assert created["session"]["audio"]["output"]["voice"] is None
        session.send({"type": "conversation.item.create", "item": {"type": "message",
                      "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}})  # fmt: skip
        session.send({"type": "response.create"})
        assert _events_until(session, "error")[-1]["error"]["message"] == CLONED_VOICES_ONLY
        for voice in ("alloy", str(recording.with_name("absent.wav"))):
            session.send({"type": "session.update", "session": {"type": "realtime",
                          "audio": {"output": {"voice": voice}}}})  # fmt: skip
            error = _events_until(session, "error")[-1]["error"]
            assert error["param"] == "session.audio.output.voice", error
            assert "give voice=speech.wav" in error["message"], error
        session.send({"type": "session.update", "session": {"type": "realtime",
                      "audio": {"output": {"voice": str(recording)}}}})  # fmt: skip
        updated = _events_until(session, "session.updated")[-1]["session"]
        assert updated["audio"]["output"]["voice"] == str(recording)
        session.send({"type": "response.create"})
        done = _events_until(session, "response.done", timeout=120)[-1]["response"]
        assert done["status"] == "completed", done
        frames = _pulled_frames(session)
        assert frames and max(np.abs(f).max() for f in frames) > 0
        session.close()
    finally:
        realtime.close()


def test_an_app_talks_to_moshi_in_process():
    """A full-duplex session in process (a fake conversation, see realtime_helpers): a reply
    frame to pull for each mic frame pushed, Moshi's words as events."""
    parts = Parts()
    realtime = LocalRealtime(parts.make)
    realtime.duplex = True
    try:
        session = realtime.session({"type": "realtime", "instructions": "Be a pirate."})
        assert session.next_event(5)["session"]["audio"]["input"]["turn_detection"] is None
        for _ in range(6):
            session.push(QUIET)
        seen = _events_until(session, "response.output_audio_transcript.delta")
        assert seen[-1]["delta"] == "m0 "
        time.sleep(0.3)
        frames = _pulled_frames(session)
        assert len(frames) == 6 and parts.duplexes[-1].persona == (None, "Be a pirate.")
        session.close()
    finally:
        realtime.close()
