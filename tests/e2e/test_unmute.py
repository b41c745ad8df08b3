"""Kyutai's Unmute backend, unmodified, as a client of `python -m moshi_mlx serve`: a spoken
conversation through its `/v1/realtime` websocket, as its browser frontend holds one.

Our server serves the TTS (tiny random checkpoint, random full-size Mimi) and the LLM (tiny random
mlx-lm model); the STT is tests/helpers/unmute_stt.py's scripted stand-in, because random STT weights
neither hear words nor predict an end of turn (docs/unmute.md says what Unmute expects of each).
Unmute runs from the venv scripts/make_unmute_env.sh builds; without it the test skips.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from unmute_backend import free_port, get_json, unmute_backend, unmute_missing_reason, wait_until
from unmute_client import ANSWER_HEARD, SAMPLE_RATE, converse
from unmute_stt import SttLog, start_scripted_stt

from moshi_mlx.testing.echo_path import speak
from moshi_mlx.tts.voices import DEFAULT_VOICE

ROOT = Path(__file__).resolve().parents[2]
TTS_FIXTURES = ROOT / "tests" / "fixtures" / "tts"
USER_TEXT = "What time is it in Paris"
# What the stock frontend sends: a voice of voices.yaml (its `path_on_server`), instructions.
VOICE = "unmute-prod-website/p329_022.wav"
INSTRUCTIONS = {"type": "constant", "text": "Answer in one short sentence."}
VOICE_SIG, VOICE_EPOCH = "1e68beda", 240
DONE_TURN_HEARD = 0.5  # s: a one-word answer's speech, at least
CONVERSATION_SECONDS = 420  # the greeting alone is ~3 min on a 2-core CPU box

pytestmark = pytest.mark.skipif(
    unmute_missing_reason() is not None, reason=str(unmute_missing_reason())
)


def _tiny_tts_folder(root: Path, mimi: Path) -> Path:
    """A TTS folder as Kyutai's repos lay one out: config.json naming its files, and a model id
    that names its voice files as kyutai/tts-voices does (`{voice}.1e68beda@240.safetensors`)."""
    folder = root / "tts"
    folder.mkdir()
    config = json.loads((TTS_FIXTURES / "config.json").read_text())
    config.update(mimi_name=mimi.name, model_id={"sig": VOICE_SIG, "epoch": VOICE_EPOCH})
    (folder / "config.json").write_text(json.dumps(config))
    for source in (
        TTS_FIXTURES / config["moshi_name"],
        TTS_FIXTURES / config["tokenizer_name"],
        mimi,
    ):
        (folder / source.name).symlink_to(source)
    return folder


def _voice_repo(root: Path) -> Path:
    """A folder laid out like kyutai/tts-voices holding the voice Unmute asks for and our
    default voice (the fixture's random embeddings)."""
    folder = root / "voices"
    for voice, embedding in ((VOICE, "alice"), (DEFAULT_VOICE, "bob")):
        path = folder / f"{voice}.{VOICE_SIG}@{VOICE_EPOCH}.safetensors"
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(TTS_FIXTURES / "voices" / f"{embedding}.safetensors", path)  # no link out
    return folder


@pytest.fixture(scope="module")
def our_server(tmp_path_factory, request):
    """`python -m moshi_mlx serve` with a tiny TTS and a tiny LLM on a loopback port: its URL
    and its log file."""
    from moshi_mlx.testing.llm import write_tiny_llm

    root = tmp_path_factory.mktemp("unmute_server")
    tts = _tiny_tts_folder(root, Path(request.getfixturevalue("full_mimi_checkpoint")))
    llm = write_tiny_llm(root / "llm", max_positions=8192)  # the system prompt is ~1800 tokens
    port = free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(root / "hf"))
    env["MOSHI_MLX_WEIGHTS"] = str(root / "no_weights")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "moshi_mlx", "serve", "--tts", str(tts), "--llm", str(llm)]
    command += ["--voice-repo", str(_voice_repo(root)), "--max-tokens", "24"]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    base = f"http://127.0.0.1:{port}"
    with open(root / "server.log", "wb") as log:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log)
        try:
            wait_until(lambda: get_json(f"{base}/v1/models") is not None, 300, server)
            yield base, str(llm), root / "server.log"
        finally:
            server.terminate()
            server.wait(timeout=30)


async def _talk(server: str, llm_model: str, logs: Path) -> tuple:
    speech = speak(USER_TEXT)
    if speech is None:
        pytest.skip("espeak-ng is not installed")
    stt_log = SttLog()
    stt, stt_port = await start_scripted_stt(USER_TEXT.lower().split(), stt_log)
    ws_server = server.replace("http://", "ws://")
    stt_url = f"ws://127.0.0.1:{stt_port}"
    backend = unmute_backend(stt_url, ws_server, server, logs / "unmute.log", llm_model)
    try:
        base = await asyncio.to_thread(backend.__enter__)
        try:
            url = base.replace("http://", "ws://") + "/v1/realtime"
            talk = await converse(url, speech, VOICE, INSTRUCTIONS, CONVERSATION_SECONDS)
        finally:
            await asyncio.to_thread(backend.__exit__, None, None, None)
    finally:
        await stt.cleanup()
    return speech, stt_log, talk


def test_unmute_talks_through_our_tts_and_llm(our_server, tmp_path):
    server, llm_model, server_log = our_server
    speech, stt_log, talk = asyncio.run(_talk(server, llm_model, tmp_path))
    logs = [
        path.read_text(errors="replace")[-2000:] for path in (tmp_path / "unmute.log", server_log)
    ]
    context = f"events {sorted(set(talk.event_types))}, closed {talk.closed}\n" + "\n".join(logs)
    assert talk.errors == [], context
    assert talk.count("session.updated") == 1, context
    assert len(talk.turns) == 2 and talk.turns[0].done, context
    greeting, answer = talk.turns

    # The user was heard: all of the speech reached the STT through Unmute's Opus and msgpack.
    assert stt_log.api_keys == ["public_token"]
    assert stt_log.samples[0] >= speech.size
    assert talk.transcription == USER_TEXT.lower().split()
    assert talk.count("input_audio_buffer.speech_stopped") == 1
    assert answer.chat_history[-2] == {"role": "user", "content": USER_TEXT.lower()}

    # Our LLM's words went to our TTS, whose audio came back through Unmute as Opus: the whole
    # greeting, and the start of the answer.
    assert greeting.llm_words and greeting.text_done == "".join(greeting.llm_words)
    assert answer.llm_words, context
    for turn in (greeting, answer):
        # A turn still speaking is heard for ANSWER_HEARD s (the client stops there); a turn
        # spoken to its end lasts as long as its text, which the random LLM makes as short as
        # one word (seen: 24 tokens as the one word "$$$...eat", 0.96 s of speech).
        heard = DONE_TURN_HEARD if turn.done else ANSWER_HEARD
        assert turn.pcm.size >= heard * SAMPLE_RATE, context
        assert float(np.sqrt(np.mean(turn.pcm**2))) > 1e-3
