"""`python -m moshi_mlx tts` on the tiny random TTS checkpoint of tests/fixtures/tts with a
random full-size Mimi: a text (argument, stdin or file) to a wav, a JSONL batch to a folder,
the speakers through a private PulseAudio server, and one-line refusals."""

from __future__ import annotations

import itertools
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from cli_checks import ROOT, error_line, offline_env, run_python
from pulse import PulseServer, pulseaudio_missing_reason

FIXTURES = Path("tests/fixtures/tts")  # relative to ROOT, where the command runs
ALICE = str(FIXTURES / "voices" / "alice.safetensors")
BOB = str(FIXTURES / "voices" / "bob.safetensors")
TEXT = "Hello there."
FRAME = 1920  # samples per 80 ms at 24 kHz


@pytest.fixture(scope="module")
def env(tmp_path_factory, full_mimi_checkpoint) -> dict[str, str]:
    """Offline, no weights folder, this checkout's package; the random Mimi's path."""
    root = tmp_path_factory.mktemp("tts_env")
    return offline_env(root, TEST_MIMI=str(full_mimi_checkpoint))


def _tts(env: dict[str, str], *args, stdin: str | None = None) -> subprocess.CompletedProcess:
    """`python -m moshi_mlx tts` on the fixture's files, `args` after them."""
    model = [
        "--moshi-weight",
        str(FIXTURES / "weights.safetensors"),
        "--lm-config",
        str(FIXTURES / "config.json"),
        "--tokenizer",
        str(FIXTURES / "tokenizer.model"),
        "--mimi-weight",
        env["TEST_MIMI"],
    ]
    return run_python(
        env, "-m", "moshi_mlx", "tts", *model, *args, cwd=ROOT, stdin=stdin, timeout=180
    )


def _ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done


def _wav(path: Path) -> np.ndarray:
    """A speech wav's samples, checked: mono 24 kHz, whole 80 ms frames."""
    info = sf.info(str(path))
    assert (info.samplerate, info.channels) == (24_000, 1), info
    pcm, _ = sf.read(str(path), dtype="float32")
    assert len(pcm) > 0 and len(pcm) % FRAME == 0
    assert np.abs(pcm).max() > 0
    return pcm


@pytest.fixture(scope="module")
def spoken(env, tmp_path_factory) -> tuple[np.ndarray, subprocess.CompletedProcess]:
    """TEXT as an argument to a wav, with --words: (the samples, the finished run)."""
    out = tmp_path_factory.mktemp("spoken") / "hello.wav"
    done = _ok(_tts(env, TEXT, "-o", out, "--voice", ALICE, "--seed", 4, "--words"))
    return _wav(out), done


def test_a_text_to_a_wav_with_its_words(spoken):
    pcm, done = spoken
    lines = done.stdout.splitlines()
    seconds = len(pcm) / 24_000
    assert lines[0].endswith(f"hello.wav ({seconds:.1f} s)")
    words = [line.split() for line in lines[1:]]
    assert [word for _, word in words] == TEXT.split()
    starts = [float(start) for start, _ in words]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] < seconds


def test_stdin_and_a_text_file_speak_as_the_argument(env, spoken, tmp_path):
    """Same text, voice and seed: the same samples; --force writes over an existing file."""
    pcm, _ = spoken
    from_stdin = tmp_path / "stdin.wav"
    _ok(_tts(env, "-", "-o", from_stdin, "--voice", ALICE, "--seed", 4, stdin=TEXT + "\n"))
    np.testing.assert_array_equal(_wav(from_stdin), pcm)
    text_file, from_file = tmp_path / "text.txt", tmp_path / "file.wav"
    text_file.write_text(TEXT, encoding="utf-8")
    from_file.write_bytes(b"old")
    args = ("--text-file", text_file, "-o", from_file, "--voice", ALICE, "--seed", 4, "--force")
    _ok(_tts(env, *args))
    np.testing.assert_array_equal(_wav(from_file), pcm)


def test_an_existing_wav_is_kept_without_force(env, tmp_path):
    out = tmp_path / "taken.wav"
    out.write_bytes(b"keep me")
    line = error_line(_tts(env, TEXT, "-o", out, "--voice", ALICE))
    assert line == f"error: {out} already exists; pass --force to overwrite it"
    assert out.read_bytes() == b"keep me"


def _jsonl(path: Path, *requests) -> Path:
    path.write_text("".join(f"{r if isinstance(r, str) else json.dumps(r)}\n" for r in requests))
    return path


def test_a_jsonl_batch_writes_a_wav_and_words_per_id(env, tmp_path):
    requests = _jsonl(
        tmp_path / "requests.jsonl",
        {"id": "greeting", "turns": [TEXT], "voices": [ALICE]},
        "",
        {"id": "dialog", "turns": ["Hi.", "Yes."], "voices": [ALICE, BOB], "cfg_coef": 1.5},
    )
    out = tmp_path / "out"
    done = _ok(_tts(env, "--jsonl", requests, "-o", out, "--seed", 2))
    assert sorted(path.name for path in out.iterdir()) == [
        "dialog.json",
        "dialog.wav",
        "greeting.json",
        "greeting.wav",
    ]
    for name, words in (("greeting", TEXT.split()), ("dialog", ["Hi.", "Yes."])):
        pcm = _wav(out / f"{name}.wav")
        assert f"{out / name}.wav ({len(pcm) / 24_000:.1f} s)" in done.stdout
        info = json.loads((out / f"{name}.json").read_text())
        assert info["complete"] is True
        assert [entry["word"] for entry in info["words"]] == words
        starts = [entry["start"] for entry in info["words"]]
        assert starts[0] == 0.0 and starts == sorted(starts)
        assert starts[-1] < len(pcm) / 24_000
    assert "2 requests" in done.stderr


JSONL_ERRORS = {  # name: (the lines, what the error says of them)
    "not_json": (
        [{"id": "a", "turns": [TEXT]}, "{oops"],
        ":2: not a request (JSONDecodeError",
    ),
    "no_turns": ([{"id": "a"}], ":1: not a request (KeyError: 'turns')"),
    "voices_not_a_list": (
        [{"id": "a", "turns": [TEXT], "voices": ALICE}],
        ":1: not a request (TypeError: voices must be a list of strings)",
    ),
    "id_leaves_the_folder": ([{"id": "../x", "turns": [TEXT]}], ":1: id '../x' is not a plain"),
    "hidden_id": ([{"id": ".x", "turns": [TEXT]}], ":1: id '.x' is not a plain file name"),
    "id_twice": (
        [{"id": "a", "turns": [TEXT]}, {"id": "a", "turns": ["Hi."]}],
        ":2: id 'a' is given twice",
    ),
    "no_request": ([""], " holds no request"),
}


@pytest.mark.parametrize("case", JSONL_ERRORS)
def test_a_bad_jsonl_batch_is_refused_in_one_line(env, tmp_path, case):
    lines, message = JSONL_ERRORS[case]
    requests = _jsonl(tmp_path / "requests.jsonl", *lines)
    out = tmp_path / "folder" / "out"
    line = error_line(_tts(env, "--jsonl", requests, "--out-folder", out))
    assert line.startswith(f"error: {requests}") and message in line
    assert not (tmp_path / "folder").exists() and not (tmp_path / "x.wav").exists()


def _sine(path: Path, seconds: float = 2.0) -> Path:
    """A recording to clone a voice from: a sine at 24 kHz."""
    t = np.arange(int(seconds * 24_000)) / 24_000
    sf.write(str(path), (0.3 * np.sin(2 * np.pi * 180 * t)).astype(np.float32), 24_000)
    return path


def test_a_jsonl_line_whose_voice_is_a_recording_clones_it(env, tmp_path):
    """A line's voice that is a recording (a path relative to the JSONL file's folder) is its
    audio prefix: its steps feed "no input" text, while the other line's start at once."""
    folder = tmp_path / "batch"
    folder.mkdir()
    _sine(folder / "speech.wav")
    requests = _jsonl(
        folder / "requests.jsonl",
        {"id": "cloned", "turns": [TEXT], "voices": [ALICE, "speech.wav"]},
        {"id": "plain", "turns": [TEXT], "voices": [ALICE]},
    )
    tokens = tmp_path / "steps.npz"
    batch = ("--jsonl", requests, "-o", tmp_path / "out", "--temp", 0, "--tokens", tokens)
    _ok(_tts(env, *batch))
    fed = np.load(tokens)["fed_text_tokens"]
    prefix_frames = 25 - 2  # 2 s at 12.5 Hz, less the 2 frames dropped
    assert (fed[0, :prefix_frames] == -1).all() and fed[0, prefix_frames] != -1
    assert (fed[1, :prefix_frames] != -1).any()
    _wav(tmp_path / "out" / "cloned.wav")


def test_a_jsonl_lines_bad_recording_is_named_in_one_line(env, tmp_path):
    (tmp_path / "noise.wav").write_text("not audio")
    _sine(tmp_path / "long.wav", seconds=31.0)
    good = {"id": "a", "turns": [TEXT], "voices": [ALICE]}
    out = tmp_path / "out"
    for voice, message in (
        ("missing.wav", ":2: voice 'missing.wav' is no audio file here (a recording to clone)"),
        ("noise.wav", f":2: cannot read {tmp_path / 'noise.wav'} as audio"),
        ("long.wav", f":2: {tmp_path / 'long.wav'}: the recording lasts 31.0 s"),
    ):
        requests = _jsonl(
            tmp_path / "r.jsonl", good, {"id": "b", "turns": [TEXT], "voices": [ALICE, voice]}
        )
        line = error_line(_tts(env, "--jsonl", requests, "-o", out, "--force"))
        assert line.startswith(f"error: {requests}") and message in line, line
    two = {"id": "b", "turns": [TEXT], "voices": ["long.wav", "noise.wav"]}
    line = error_line(_tts(env, "--jsonl", _jsonl(tmp_path / "r.jsonl", two), "-o", out))
    assert line.endswith(":1: one recording to clone a voice from, not 2")
    assert not any(out.glob("*.wav"))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "give exactly one of TEXT, --text-file or --jsonl"),
        ((TEXT, "--text-file", "t.txt", "-o", "x.wav"), "give exactly one of TEXT"),
        ((TEXT,), "say where the speech goes: -o WAV and/or --play"),
        (("--jsonl", "r.jsonl", "--play"), "--jsonl writes into the -o folder; --play is for one"),
        ((TEXT, "-o", "x.wav", "--temp", "hot"), "argument --temp: invalid float value: 'hot'"),
    ],
)
def test_bad_arguments_are_refused(env, args, message):
    assert message in error_line(_tts(env, *args))


def test_bad_texts_and_voices_are_refused_in_one_line(env, tmp_path):
    out = tmp_path / "out.wav"
    assert error_line(_tts(env, "  \n", "-o", out)) == "error: the text is empty"
    missing = tmp_path / "missing.txt"
    line = error_line(_tts(env, "--text-file", missing, "-o", out))
    assert line.startswith(f"error: cannot read --text-file {missing}")
    voice = tmp_path / "nope.safetensors"
    line = error_line(_tts(env, TEXT, "-o", out, "--voice", voice))
    assert line == f"error: voice file {voice} not found"
    line = error_line(_tts(env, TEXT, "-o", out, "--voice", ALICE, "--cfg-coef", 2.2))
    assert "'2.2'" in line and "1.0, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0" in line
    assert not out.exists()


# --- the speakers, through a private PulseAudio server ---------------------------------------


@pytest.mark.audio
@pytest.mark.skipif(
    pulseaudio_missing_reason() is not None, reason=str(pulseaudio_missing_reason())
)
def test_play_reaches_the_speaker(env, spoken, tmp_path):
    """--list-devices shows the server's device; --play (with -o, same seed) through a null
    sink: the command ends once the speech is played, and the sink's monitor heard every
    frame of the wav, the last one included."""
    pcm, _ = spoken
    with PulseServer(tmp_path / "pulse") as pulse:
        listing = _ok(_tts({**env, **pulse.env()}, "--list-devices"))
        assert "idx  in  out  name" in listing.stdout and "pulse" in listing.stdout
        recording = tmp_path / "speaker.raw"
        pulse.start_recording(recording)
        out = tmp_path / "played.wav"
        args = (TEXT, "--play", "--output-device", "pulse", "-o", out, "--voice", ALICE)
        _ok(_tts({**env, **pulse.env()}, *args, "--seed", 4))
        pulse.stop_recording()
    np.testing.assert_array_equal(_wav(out), pcm)
    heard = np.fromfile(recording, "<i2").astype(np.float32) / 32768
    assert np.abs(heard).max() > 0, "the speaker's monitor heard nothing"
    starts = _frames_in(heard, pcm.reshape(-1, FRAME))
    assert None not in starts, f"frames not heard: {starts}"
    # In order; silence may come between frames when the model is slower than real time.
    assert all(b - a >= FRAME for a, b in itertools.pairwise(starts)), starts


def _frames_in(heard: np.ndarray, frames: np.ndarray, tolerance: float = 2.5 / 32768) -> list:
    """Where each frame is found in `heard` after the previous one (None: nowhere), sample
    for sample within 16-bit rounding."""
    starts, position = [], 0
    for frame in frames:
        candidates = np.flatnonzero(np.abs(heard[position:] - frame[0]) <= tolerance) + position
        found = next(
            (
                int(start)
                for start in candidates
                if start + FRAME <= len(heard)
                and np.abs(heard[start : start + FRAME] - frame).max() <= tolerance
            ),
            None,
        )
        starts.append(found)
        position = found + FRAME if found is not None else position
    return starts


# --- --tokens ---------------------------------------------------------------------------------
# Row 0 of PyTorch's greedy "batch" run (tests/fixtures/tts/golden_generate.json).
GOLDEN = json.loads((ROOT / FIXTURES / "golden_generate.json").read_text())["runs"]["batch"]
GOLDEN_ROW = GOLDEN["rows"][0]


def test_the_tokens_of_a_greedy_text_are_pytorchs(env, tmp_path):
    """--tokens of one text: a row of every step's predicted and fed text tokens and each
    frame's audio codes, equal to PyTorch's greedy run step for step (until this text's own
    end: PyTorch's row ran on beside a longer one)."""
    tokens = tmp_path / "steps.npz"
    args = ("-o", tmp_path / "out.wav", "--voice", ALICE, "--temp", 0, "--tokens", tokens)
    _ok(_tts(env, GOLDEN_ROW["text"], "--cfg-coef", GOLDEN_ROW["cfg"], *args))
    written = dict(np.load(tokens))
    assert sorted(written) == ["audio_codes", "fed_text_tokens", "predicted_text_tokens"]
    predicted, fed = written["predicted_text_tokens"], written["fed_text_tokens"]
    steps = predicted.shape[1]
    assert predicted.shape == fed.shape == (1, steps) and steps > 40
    logged = np.stack([predicted[0], fed[0]], axis=1).tolist()
    assert logged == GOLDEN_ROW["logged_text_tokens"][:steps]
    codes = written["audio_codes"]
    frames = np.array(GOLDEN_ROW["frames"][: codes.shape[2]])
    assert codes.shape == (1, frames.shape[1] - 1, steps - 2)  # max_delay 2
    np.testing.assert_array_equal(codes[0], frames[:, 1:].T)


def test_the_tokens_of_a_jsonl_batch_are_the_apis(env, tmp_path, full_mimi_checkpoint):
    """--jsonl --tokens: one row per line, what `TtsModel.synthesize` gives the same requests,
    seed and sampling; an existing tokens file is kept without --force."""
    from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest

    requests = _jsonl(
        tmp_path / "requests.jsonl",
        {"id": "greeting", "turns": [TEXT], "voices": [ALICE]},
        {"id": "dialog", "turns": ["Hi.", "Yes."], "voices": [ALICE, BOB], "cfg_coef": 1.5},
    )
    tokens = tmp_path / "steps.npz"
    batch = ("--jsonl", requests, "--out-folder", tmp_path / "out", "--seed", 2)
    _ok(_tts(env, *batch, "--tokens", tokens))
    written = dict(np.load(tokens))
    model = TtsModel.load(
        moshi_weight=ROOT / FIXTURES / "weights.safetensors",
        mimi_weight=full_mimi_checkpoint,
        tokenizer=ROOT / FIXTURES / "tokenizer.model",
        lm_config=ROOT / FIXTURES / "config.json",
    )
    speeches = model.synthesize(
        [
            TtsRequest([TEXT], (ROOT / ALICE,)),
            TtsRequest(["Hi.", "Yes."], (ROOT / ALICE, ROOT / BOB), 1.5),
        ],
        seed=2,
    )
    for row, speech in enumerate(speeches):
        np.testing.assert_array_equal(
            written["predicted_text_tokens"][row], speech.predicted_tokens
        )
        np.testing.assert_array_equal(written["fed_text_tokens"][row], speech.fed_tokens)
        np.testing.assert_array_equal(written["audio_codes"][row], speech.audio_codes)
    steps = written["fed_text_tokens"].shape[1]
    assert written["audio_codes"].shape == (2, model.config.dep_q, steps - model.config.max_delay)
    assert (written["audio_codes"][:, :, -1] >= 0).all()
    line = error_line(_tts(env, *batch, "--force", "--tokens", tmp_path / "steps.wav"))
    assert ".npz" in line
    tokens.write_bytes(b"mine")
    line = error_line(_tts(env, *batch, "--out-folder", tmp_path / "again", "--tokens", tokens))
    assert "--force" in line and tokens.read_bytes() == b"mine"


def test_a_recording_as_voice_is_continued(env, tmp_path, full_mimi_checkpoint):
    """`--voice speech.wav` clones its voice: the recording's Mimi codes are the audio prefix
    (its last 2 frames dropped), its steps feed "no input" text, its audio is not played; the
    tokens start as the API's (`TtsModel.voice_prefix` and a `TtsRequest` prefix)."""
    from moshi_mlx.runtime.sampling import GREEDY
    from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest

    recording = _sine(tmp_path / "speech.wav")
    tokens, out = tmp_path / "steps.npz", tmp_path / "cloned.wav"
    args = ("--voice", ALICE, "--voice", recording, "--temp", 0, "--tokens", tokens)
    done = _ok(_tts(env, TEXT, "-o", out, *args))
    _wav(out)
    fed = np.load(tokens)["fed_text_tokens"][0]
    prefix_frames = 25 - 2  # 2 s at 12.5 Hz, less the 2 frames dropped
    assert (fed[:prefix_frames] == -1).all() and fed[prefix_frames] != -1
    model = TtsModel.load(
        moshi_weight=str(ROOT / FIXTURES / "weights.safetensors"),
        lm_config=str(ROOT / FIXTURES / "config.json"),
        tokenizer=str(ROOT / FIXTURES / "tokenizer.model"),
        mimi_weight=str(full_mimi_checkpoint),
        codec_backend="mlx",
    )
    prefix = model.voice_prefix(recording)
    assert prefix.shape == (model.codebooks, prefix_frames)
    request = TtsRequest(TEXT, (ROOT / ALICE,), prefix=prefix)
    (speech,) = model.synthesize([request], GREEDY, GREEDY)
    # The prefix and the speech's start are the API's; later steps of this random model
    # have near-ties that the CPU's BLAS may break either way between processes (the exact
    # run against Kyutai's code is tests/parity/test_tts_clone_parity.py).
    start = prefix_frames + 5
    np.testing.assert_array_equal(speech.fed_tokens[:start], fed[:start])
    assert "Traceback" not in done.stderr
    two = error_line(
        _tts(env, TEXT, "-o", tmp_path / "x.wav", "--voice", recording, "--voice", recording)
    )
    assert two == "error: one recording to clone a voice from, not 2"
