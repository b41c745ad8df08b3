"""`python -m moshi_mlx infer` on espeak-ng speech with tiny random weights."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from tiny_moshi import (
    VOICE_NAMES,
    cached_tiny_hibiki,
    cached_tiny_moshi,
    cached_tiny_personaplex,
    espeak_speech,
    fast_codec,
    weight_flags,
    write_voice,
)

from moshi_mlx.chat.persona.cache import CACHE_ENV
from moshi_mlx.cli.infer import lead_in, main, max_tail_frames, translate
from moshi_mlx.models.config import LmConfig

FRAME = 1920
HIBIKI_CONFIG = Path(__file__).parents[1] / "fixtures" / "hibiki" / "config.json"


@pytest.fixture(scope="module")
def speech(tmp_path_factory):
    # 44.1 kHz stereo, so reading also mixes down and resamples
    path = espeak_speech(
        tmp_path_factory.mktemp("speech") / "user.wav", "Hello Moshi, how are you?", 44100, 2
    )
    if path is None:
        pytest.skip("espeak-ng and sox are not installed (Debian: apt install espeak-ng sox)")
    return path


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    # rustymimi keeps this test short; the MLX codec runs in test_local_e2e.py
    return [*weight_flags(cached_tiny_moshi(tmp_path_factory)), "--codec", fast_codec()]


def _run(capsys, speech, out, flags, seed):
    code = main([str(speech), str(out), "--seed", str(seed), *flags])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def test_same_seed_same_output_and_length(tmp_path, capsys, speech, flags):
    text_a = _run(capsys, speech, tmp_path / "a.wav", flags, seed=7)
    text_b = _run(capsys, speech, tmp_path / "b.wav", flags, seed=7)
    _run(capsys, speech, tmp_path / "c.wav", flags, seed=8)
    a, rate = sf.read(tmp_path / "a.wav", dtype="int16")
    b, _ = sf.read(tmp_path / "b.wav", dtype="int16")
    c, _ = sf.read(tmp_path / "c.wav", dtype="int16")
    info = sf.info(str(speech))
    expected = round(info.frames * 24000 / info.samplerate)
    assert rate == 24000 and a.ndim == 1
    assert abs(len(a) - expected) < FRAME
    np.testing.assert_array_equal(a, b)
    assert text_a == text_b
    assert not np.array_equal(a, c)  # the seed matters
    # Moshi is silent until its delays fill, then speaks (random weights: noise-like audio).
    assert not a[:FRAME].any() and np.abs(a[2 * FRAME :]).max() > 30


def test_never_overwrites_the_input_or_an_existing_file(tmp_path, capsys, speech, flags):
    recording = tmp_path / "me.wav"
    recording.write_bytes(speech.read_bytes())
    link = tmp_path / "link.wav"
    link.hardlink_to(recording)
    kept = recording.read_bytes()
    for output, message in (
        (recording, "is the input recording"),
        (link, "is the input recording"),
        (tmp_path / "missing" / "out.wav", "folder"),
        (tmp_path / "out.mp4", "use a .wav, .flac or .ogg"),
    ):
        assert main([str(recording), str(output), *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert recording.read_bytes() == kept
    folder = tmp_path / "folder.wav"
    folder.mkdir()
    assert main([str(recording), str(folder), "--force", *flags]) == 2  # before any inference
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a folder" in err, err
    folder.rmdir()
    existing = tmp_path / "reply.wav"
    existing.write_bytes(b"mine")
    assert main([str(recording), str(existing), *flags]) == 2
    assert "--force" in capsys.readouterr().err and existing.read_bytes() == b"mine"
    assert main([str(recording), str(existing), "--seed", "1", "--force", *flags]) == 0
    assert sf.info(str(existing)).samplerate == 24000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.wav", "me.wav", "reply.wav"]


# --- PersonaPlex: --voice, --role, --list-voices ----------------------------------------------
@pytest.fixture(scope="module")
def persona(tmp_path_factory):
    """The tiny PersonaPlex model (voices NATF2, NATM1 beside it) and a user turn of 0.5 s."""
    files = cached_tiny_personaplex(tmp_path_factory)
    user = write_voice(tmp_path_factory.mktemp("persona") / "user.wav", seconds=0.5)
    return files, user, [*weight_flags(files), "--codec", fast_codec()]


@pytest.fixture
def prompt_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "prompts"))
    return tmp_path / "prompts"


def _persona_run(capsys, persona, out, *flags):
    _, user, weights = persona
    code = main([str(user), str(out), "--seed", "3", *weights, *map(str, flags)])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    audio, _ = sf.read(out, dtype="int16")
    return audio, captured.err


def test_voice_and_role_choose_the_prompt(tmp_path, capsys, persona, prompt_cache):
    files = persona[0]
    tutor, err = _persona_run(capsys, persona, tmp_path / "a.wav", "--role", "You are a tutor.")
    assert "[moshi_mlx.chat.persona] prompt (voice NATF2, role of" in err and "computed" in err, err
    again, err = _persona_run(capsys, persona, tmp_path / "b.wav", "--role", "You are a tutor.")
    assert "read from the prompt cache" in err, err
    role_file = tmp_path / "role.txt"
    role_file.write_text("You sell bicycles.")
    seller, _ = _persona_run(capsys, persona, tmp_path / "c.wav", "--role", f"@{role_file}")
    recorded, err = _persona_run(
        capsys, persona, tmp_path / "d.wav", "--voice", files["voice"], "--role", "You are a tutor."
    )
    assert f"prompt (voice {files['voice']}" in err, err
    np.testing.assert_array_equal(tutor, again)  # the cached prompt is the computed one
    assert np.abs(tutor).max() > 30
    assert not np.array_equal(tutor, seller)  # the role matters
    assert not np.array_equal(tutor, recorded)  # the voice matters


def test_list_voices(capsys, persona):
    assert main(["--list-voices", *persona[2]]) == 0
    assert capsys.readouterr().out.split() == list(VOICE_NAMES)


def _one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), err
    return err


def test_persona_errors_are_one_line(tmp_path, capsys, persona, prompt_cache, flags):
    _, user, weights = persona
    out = tmp_path / "out.wav"
    long_voice = tmp_path / "long.wav"
    sf.write(long_voice, np.full(31 * 8000, 0.1, np.float32), 8000)
    for choice, words in (
        (["--voice", "NOPE"], ["unknown voice 'NOPE'", "NATF2, NATM1"]),
        (["--voice", long_voice], ["31.0 s long", "at most 30 s"]),
        (["--voice", tmp_path / "missing.wav"], ["voice file not found", "missing.wav"]),
        (["--role", f"@{tmp_path / 'missing.txt'}"], ["role file not found", "missing.txt"]),
    ):
        err = _one_line_error(capsys, main([str(user), str(out), *weights, *map(str, choice)]))
        assert all(word in err for word in words), err
    moshi = [str(user), str(out), *flags]  # Moshi's tiny model
    for choice in (["--voice", "NATF2"], ["--role", "You are a tutor."]):
        err = _one_line_error(capsys, main([*moshi, *choice]))
        assert "this model is Moshi" in err, err
    err = _one_line_error(capsys, main(["--list-voices", *flags]))
    assert "this model is Moshi" in err, err
    assert not out.exists()


@pytest.fixture(scope="module")
def hibiki_flags(tmp_path_factory):
    return [*weight_flags(cached_tiny_hibiki(tmp_path_factory)), "--codec", fast_codec()]


def test_hibiki_translates_past_the_end_of_its_source(tmp_path, capsys, speech, hibiki_flags):
    """The source, the end-of-input frame, then silence until the text ends (random weights:
    anywhere up to the cap); guidance from the config (3) or the flag (1) changes the audio."""
    _run(capsys, speech, tmp_path / "a.wav", hibiki_flags, seed=7)
    _run(capsys, speech, tmp_path / "b.wav", [*hibiki_flags, "--cfg-coef", "1"], seed=7)
    a, _ = sf.read(tmp_path / "a.wav", dtype="int16")
    b, _ = sf.read(tmp_path / "b.wav", dtype="int16")
    info = sf.info(str(speech))
    source = round(info.frames * 24000 / info.samplerate)
    for translation in (a, b):
        tail = len(translation) - source
        assert FRAME <= tail <= max_tail_frames(-(-source // FRAME)) * FRAME + 1
    assert not np.array_equal(a[: len(b)], b[: len(a)])


class _EndingConversation:
    """Steps whose text ends at step `end` (counted from the first)."""

    def __init__(self, end: int):
        self.steps, self.end = 0, end

    def step(self, pcm):
        from moshi_mlx.chat.model import StepResult

        self.steps += 1
        return StepResult(np.full(FRAME, self.steps, np.float32), "", None, self.steps == self.end)

    def end_of_input(self):
        return self.step(None)

    def step_without_input(self):
        return self.step("no input")


@pytest.mark.parametrize("end", [2, 5])
def test_translation_stops_its_audio_lag_after_the_end_of_text(end):
    """An end of text before the end of input (step 2: the 3-frame source) is ignored; one
    at or after it stops the translation `audio_lag` frames later; the first `audio_lag`
    steps' audio (silence while the delays fill) is not kept."""
    conversation = _EndingConversation(end)
    pcm = translate(conversation, np.zeros(3 * FRAME, np.float32), FRAME, audio_lag=2)
    frames = pcm.reshape(-1, FRAME)[:, 0]
    last = 3 + max_tail_frames(3) if end <= 3 else end + 2
    np.testing.assert_array_equal(frames, np.arange(3, last + 1))


def _fed_translation(kv_repeat: int) -> tuple[list, np.ndarray]:
    """What `translate` feeds a conversation ending its text at step 6 (the 3-frame source of
    ones, with `lead_in` of the tiny Hibiki's config, max_delay 2, with `kv_repeat`: 2 makes it
    a Hibiki-Zero), and the audio's frames."""
    config = LmConfig.from_dict(json.loads(HIBIKI_CONFIG.read_text()))
    config = replace(config, kv_repeat=kv_repeat)
    assert config.max_delay == 2
    conversation = _EndingConversation(end=6)
    fed = []
    step = conversation.step
    conversation.step = lambda pcm: fed.append(pcm) or step(pcm)
    source = np.ones(3 * FRAME, np.float32)
    pcm = translate(conversation, source, FRAME, 2, lead=lead_in(config, FRAME))
    fed = [f if f is None or isinstance(f, str) else float(f.max()) for f in fed]
    return fed, pcm.reshape(-1, FRAME)[:, 0]


def test_hibiki_zero_hears_its_lead_in_silence_and_keeps_none_of_its_audio():
    """Hibiki-Zero's lead-in (its `max_delay`, 2): two frames of silence before the source,
    as `hibiki-zero generate` warms its `LMGen` up; the audio starts with the third step's
    (the model's first frame), not with the two silent frames the delays give."""
    fed, frames = _fed_translation(kv_repeat=2)
    assert fed[:6] == [0, 0, 1, 1, 1, None]
    np.testing.assert_array_equal(frames, np.arange(3, 6 + 2 + 1))


def test_hibiki_starts_with_a_step_without_input_and_keeps_no_empty_frame():
    """Hibiki 1B as `moshi.run_inference` runs it: the source's first frame fed twice, where
    `LMGen` never reads the first step's input, so here a step without input, then the
    source; no audio of the steps `LMGen` answers None (max_delay, 2): the audio starts with
    the model's first frame, one frame before the source's end on its timeline, as there."""
    fed, frames = _fed_translation(kv_repeat=1)
    assert fed[:5] == ["no input", 1, 1, 1, None]
    np.testing.assert_array_equal(frames, np.arange(3, 6 + 2 + 1))


# --- --tokens ---------------------------------------------------------------------------------
def test_tokens_file_holds_every_step_the_api_produced(tmp_path, capsys, speech, flags):
    """--tokens writes the text token, Moshi's codes and the inputs of every step: those the
    API's conversation gives for the same audio, seed and sampling."""
    from moshi_mlx.audio.wav import read_audio
    from moshi_mlx.cli.chat_flags import load_model, sampling_from_args
    from moshi_mlx.cli.infer import converse, parse_args

    tokens = tmp_path / "steps.npz"
    argv = [str(speech), str(tmp_path / "a.wav"), "--seed", "7", *flags, "--tokens", str(tokens)]
    assert main(argv) == 0, capsys.readouterr().err
    written = dict(np.load(tokens))

    args = parse_args(argv)
    model = load_model(args)
    steps = []
    with model.conversation(*sampling_from_args(args), seed=7) as conversation:
        converse(conversation, read_audio(speech, 24_000), FRAME, on_step=steps.append)
    config = model.lm.config
    assert sorted(written) == ["audio_codes", "input_tokens", "text_tokens"]
    np.testing.assert_array_equal(written["text_tokens"], [s.text_token for s in steps])
    codes = written["audio_codes"]
    assert codes.shape == (config.moshi_codebooks, len(steps)) and codes.dtype == np.int32
    for t, step in enumerate(steps):
        if step.moshi_codes is None:
            assert (codes[:, t] == -1).all()
        else:
            np.testing.assert_array_equal(codes[:, t], step.moshi_codes)
        np.testing.assert_array_equal(written["input_tokens"][:, t], step.input_tokens)
    assert written["input_tokens"].shape == (config.num_codebooks, len(steps))
    assert (codes[:, config.max_delay :] >= 0).all()


def test_tokens_file_is_refused_like_the_audio_output(tmp_path, capsys, speech, flags):
    existing = tmp_path / "taken.npz"
    existing.write_bytes(b"mine")
    for tokens, message in (
        (existing, "--force"),
        (tmp_path / "steps.txt", ".npz"),
        (tmp_path / "missing" / "steps.npz", "folder"),
    ):
        argv = [str(speech), str(tmp_path / "out.wav"), *flags, "--tokens", str(tokens)]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert existing.read_bytes() == b"mine" and not (tmp_path / "out.wav").exists()
