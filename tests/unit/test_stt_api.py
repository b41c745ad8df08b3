"""The speech-to-text API and `python -m moshi_mlx stt` on a tiny random STT checkpoint."""

import json
import subprocess

import numpy as np
import pytest
from tiny_moshi import cached_tiny_stt, espeak_speech, load_tiny_stt, tiny_moshi_command

from moshi_mlx.audio.wav import read_audio
from moshi_mlx.errors import AudioError
from moshi_mlx.stt.events import EndOfTurn, WordEnded, WordStarted
from moshi_mlx.stt.transcriber import transcribe
from moshi_mlx.stt.words import finished_words

SENTENCES = ["hello there how are you today", "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cached_tiny_stt(tmp_path_factory)


@pytest.fixture(scope="module")
def model(files):
    return load_tiny_stt(files)


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    root = tmp_path_factory.mktemp("speech")
    paths = [espeak_speech(root / f"s{i}.wav", text) for i, text in enumerate(SENTENCES)]
    if None in paths:
        pytest.skip("needs espeak-ng and sox")
    return paths


def test_files_batched_together_get_the_words_of_each_alone(model, speech):
    audio = [read_audio(path) for path in speech]
    together = transcribe(model, audio, batch=2)
    for pcm, events in zip(audio, together):
        alone = transcribe(model, [pcm], batch=1)[0]
        assert finished_words(events) == finished_words(alone)
    words = [w for events in together for w in finished_words(events)]
    assert words and all(0 <= w.start <= w.end for w in words)


def test_a_stream_reports_steps_with_head_probabilities_and_ordered_events(model, speech):
    stt = model.speech_to_text()
    pcm = read_audio(speech[0])
    steps = [stt.step(pcm[i : i + 1920]) for i in range(0, len(pcm) - 1919, 1920)]
    assert [s.index for s in steps] == list(range(len(steps)))
    assert all(len(s.pause_probabilities) == 4 for s in steps[1:])
    events = [e for s in steps for e in s.events] + list(stt.flush())
    kinds = [type(e) for e in events if not isinstance(e, EndOfTurn)]
    assert kinds == [WordStarted, WordEnded] * (len(kinds) // 2)
    with pytest.raises(AudioError, match=r"shape \(1, 1920\)"):
        stt.step(np.zeros(100, np.float32))


def test_flush_is_to_flush_batch_as_step_is_to_step_batch(model):
    """One stream: `flush` gives its events, as `step` gives its step (issue 41.9)."""
    one = model.speech_to_text()
    one.step(np.zeros(1920, np.float32))
    assert all(not isinstance(event, list) for event in one.flush())
    two = model.speech_to_text(streams=2)
    two.step_batch(np.zeros((2, 1920), np.float32))
    with pytest.raises(AudioError, match="has 2 streams: use flush_batch"):
        two.flush()
    assert len(two.flush_batch()) == 2


def _stt_command(files, *flags):
    command = tiny_moshi_command("moshi_mlx stt", files, *flags)
    return subprocess.run(command, check=False, capture_output=True, text=True, timeout=300)


def test_the_command_writes_json_and_srt_and_never_overwrites(files, speech, tmp_path):
    shown = _stt_command(files, "--json", *map(str, speech))
    assert shown.returncode == 0, shown.stderr
    lines = [json.loads(line) for line in shown.stdout.splitlines()]
    assert [line["file"] for line in lines] == list(map(str, speech))
    assert all({"text", "words"} <= set(line) for line in lines)
    out = tmp_path / "subs" / "out"  # a missing folder is made, as `tts -o out/` makes it
    written = _stt_command(files, "--srt", "-o", str(out), *map(str, speech))
    assert written.returncode == 0, written.stderr
    assert sorted(p.name for p in out.iterdir()) == ["s0.srt", "s1.srt"]
    again = _stt_command(files, "--srt", "-o", str(out), str(speech[0]))
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert "exists" in again.stderr


def test_bad_input_is_a_one_line_error(files, tmp_path):
    missing = _stt_command(files, str(tmp_path / "nope.wav"))
    assert missing.returncode == 2 and "not found" in missing.stderr
    assert missing.stderr.count("\n") == 1, missing.stderr


def test_serve_speaks_kyutais_protocol_with_the_real_model(files, model, speech):
    """As Kyutai's stt_from_file_rust_server.py does: audio, a marker, then silence until the
    marker comes back; the words equal the file transcription's."""
    import asyncio
    import time

    import aiohttp
    import msgpack
    from web_harness import free_port

    port = free_port()
    command = tiny_moshi_command(
        "moshi_mlx stt", files, "--serve", "--host", "127.0.0.1", "--port", port
    )
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    pcm = read_audio(speech[1])

    def pack(message: dict) -> bytes:
        return msgpack.packb(message, use_single_float=True)

    async def talk() -> list[dict]:
        url = f"ws://127.0.0.1:{port}/api/asr-streaming"
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            for start in range(0, len(pcm), 24_000):  # chunks of 1 s, not frames
                await ws.send_bytes(
                    pack({"type": "Audio", "pcm": pcm[start : start + 24_000].tolist()})
                )
            await ws.send_bytes(pack({"type": "Marker", "id": 7}))
            silence = pack({"type": "Audio", "pcm": [0.0] * 1920})
            for _ in range(40):
                await ws.send_bytes(silence)
            messages = []
            while not messages or messages[-1] != {"type": "Marker", "id": 7}:
                message = await ws.receive(timeout=60)
                assert message.type == aiohttp.WSMsgType.BINARY, message
                messages.append(msgpack.unpackb(message.data))
            return messages

    try:
        deadline = time.monotonic() + 120
        while "ready: " not in (line := server.stderr.readline()):
            assert line and time.monotonic() < deadline, "the server did not get ready"
        messages = asyncio.run(talk())
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert messages[0] == {"type": "Ready"}
    steps = [m for m in messages if m["type"] == "Step"]
    assert steps and all(len(m["prs"]) == 4 for m in steps)
    words = [m["text"] for m in messages if m["type"] == "Word"]
    expected = [w.text for w in finished_words(transcribe(model, [pcm], 1)[0])]
    assert words == expected[: len(words)] and words, (words, expected)


# --- tokens from step 0, the silence prefix's included ---------------------------------------
class _ScriptedStepper:
    """An `SttStepper` that writes `script`'s tokens (then padding), the same in every
    stream, with head probabilities of zero."""

    def __init__(self, lm, batch=1, text_sampling=None, compiled_steps=None, *, script: list[int]):
        self.batch, self.step_index, self.script = batch, 0, script

    @property
    def ready(self) -> bool:
        return self.step_index > 0

    def step(self, codes):
        import mlx.core as mx

        from moshi_mlx.runtime.step_state import StepOutput

        script = self.script
        token = script[self.step_index] if self.step_index < len(script) else 3
        self.step_index += 1
        batch = self.batch
        text = mx.full((batch,), token, mx.int32)
        return StepOutput(
            None,
            text,
            None,
            mx.zeros((batch, 33), mx.int32),
            text_logits=mx.zeros((batch, 1)),
            head_probabilities=mx.zeros((batch, 4, 2)),
        )


def test_words_written_while_the_silence_prefix_is_fed_are_kept(model, monkeypatch):
    """As Kyutai's scripts keep every token from step 0: a word the model writes and closes
    within the silence prefix (1 s, 13 steps, as stt-2.6b-en's) is reported, with the first step after it."""
    from dataclasses import replace
    from functools import partial
    from types import SimpleNamespace

    from moshi_mlx.models.config_sections import SttTiming
    from moshi_mlx.stt import transcriber
    from moshi_mlx.stt.words import Word

    hello = model.tokenizer.encode("hello")
    script = [0, *hello, 0]
    assert len(script) < 13
    monkeypatch.setattr(transcriber, "SttStepper", partial(_ScriptedStepper, script=script))
    config = replace(model.lm.config, stt_config=SttTiming(0.5, 1.0))
    prefixed = replace(model, lm=SimpleNamespace(config=config))
    assert prefixed.silence_prefix_steps == 13

    stt = prefixed.speech_to_text()
    [prefix] = stt.prefix_steps
    assert [s.text_token for s in prefix] == script + [3] * (13 - len(script))
    assert all(not s.events and not s.text for s in prefix)  # reported with the next step
    first = stt.step(np.zeros(1920, np.float32))
    assert first.index == 13 and first.text.strip() == "hello"
    assert finished_words(first.events) == [Word("hello", 0.0, 0.0)]

    [alone] = transcriber.transcribe(prefixed, [np.zeros(3 * 1920, np.float32)])
    assert [w.text for w in finished_words(alone)] == ["hello"]


def test_the_tokens_file_holds_every_step_of_each_file(files, model, speech, tmp_path):
    """--tokens: one row per file, every step from step 0, equal to the API's steps; Kyutai's
    rule over those tokens (a `WordTimer` from step 0) gives the command's words."""
    from moshi_mlx.stt.transcriber import transcribe_steps
    from moshi_mlx.stt.words import WordTimer

    tokens = tmp_path / "steps.npz"
    done = _stt_command(files, "--json", "--batch", "2", "--tokens", tokens, *map(str, speech))
    assert done.returncode == 0, done.stderr
    written = dict(np.load(tokens))
    assert sorted(written) == ["pause_probs", "prefix_steps", "steps", "text_tokens"]
    api = transcribe_steps(model, [read_audio(path) for path in speech], batch=2)
    np.testing.assert_array_equal(written["steps"], [len(t.steps) for t in api])
    assert written["prefix_steps"] == model.silence_prefix_steps
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    config = model.lm.config
    for row, (transcription, line) in enumerate(zip(api, lines)):
        steps = len(transcription.steps)
        text_tokens = written["text_tokens"][row]
        assert [s.text_token for s in transcription.steps] == text_tokens[:steps].tolist()
        assert (text_tokens[steps:] == -1).all()
        probs = written["pause_probs"][row]
        np.testing.assert_array_equal(
            probs[:steps], [s.pause_probabilities for s in transcription.steps]
        )
        assert np.isnan(probs[steps:]).all() and probs.shape[-1] == 4
        timer = WordTimer(
            model.tokenizer,
            audio_delay=config.stt_config.audio_delay_seconds,
            silence_prefix=config.stt_config.audio_silence_prefix_seconds,
            padding_id=config.existing_text_padding_id,
        )
        events = [
            e for step, token in enumerate(text_tokens[:steps]) for e in timer.push(step, token)
        ]
        words = finished_words([*events, *timer.finish()])
        assert words == finished_words(transcription.events)
        assert [w.text for w in words] == [w["text"] for w in line["words"]]
    again = _stt_command(files, "--tokens", tokens, str(speech[0]))
    assert again.returncode == 2 and again.stderr.count("\n") == 1, again.stderr
    assert "--force" in again.stderr
