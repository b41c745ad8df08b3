"""Every user error ends the CLIs with one line on stderr, no traceback, exit code 2."""

import json
import os
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf
from cli_checks import error_line, run_python
from tiny_moshi import cached_tiny_moshi, tiny_config, weight_flags

HIDE_PORTAUDIO = (
    "import ctypes.util, runpy, sys\n"
    "find = ctypes.util.find_library\n"
    "ctypes.util.find_library = lambda name: None if name == 'portaudio' else find(name)\n"
    "sys.argv = ['moshi_mlx.local', *sys.argv[1:]]\n"
    "runpy.run_module('moshi_mlx.local', run_name='__main__')\n"
)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return cached_tiny_moshi(tmp_path_factory)


@pytest.fixture
def env(tmp_path):
    """Offline, empty caches, and a sound server that does not exist (so: no devices)."""
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "hf"),
        MOSHI_MLX_WEIGHTS=str(tmp_path / "no_weights"),
        PULSE_SERVER=f"unix:{tmp_path / 'no_pulse'}",
        XDG_RUNTIME_DIR=str(tmp_path),
    )
    return env


@pytest.fixture
def wav(tmp_path):
    path = tmp_path / "in.wav"
    sf.write(path, np.zeros(4800, np.float32), 24000)
    return path


def _fails(env, *args, module="moshi_mlx infer"):
    """Run the CLI; assert it failed cleanly and return its one-line error."""
    command = ["-m", *module.split()] if module else []
    return error_line(run_python(env, *command, *args))


def test_corrupt_wav(env, tmp_path):
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x10\x00\x00\x00WAVEfmt " + bytes(range(40)))
    line = _fails(env, bad, tmp_path / "out.wav")
    assert f"cannot read {bad} as audio" in line and "give a valid wav/flac/ogg file" in line


def test_missing_wav(env, tmp_path):
    line = _fails(env, tmp_path / "nope.wav", tmp_path / "out.wav")
    assert line == f"error: audio file not found: {tmp_path / 'nope.wav'}"


def test_wav_sample_rate_too_low(env, tmp_path):
    low = tmp_path / "low.wav"
    sf.write(low, np.zeros(4000, np.float32), 4000)
    line = _fails(env, low, tmp_path / "out.wav")
    assert "4000 Hz, too low for speech" in line and "24000 Hz is best" in line


def test_offline_without_weights(env, wav, tmp_path):
    line = _fails(env, wav, tmp_path / "out.wav")
    assert "cannot get model.q4.safetensors" in line and "huggingface.co/kyutai" in line
    assert "no_weights/" in line


def test_missing_weight_file(env, wav, tmp_path, files):
    flags = weight_flags({**files, "mimi": tmp_path / "gone.safetensors"})
    line = _fails(env, wav, tmp_path / "out.wav", *flags)
    assert line == f"error: --mimi-weight {tmp_path / 'gone.safetensors'}: file not found"


def test_corrupt_weight_file(env, wav, tmp_path, files):
    junk = tmp_path / "model.q4.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}" + bytes(100))
    line = _fails(env, wav, tmp_path / "out.wav", *weight_flags({**files, "moshi": junk}))
    assert line.startswith(f"error: {junk} is not a safetensors file")


def _not_safetensors(tmp_path, wav, kind: str):
    """A file given as weights that is not safetensors: a wav, a text, empty, cut short."""
    if kind == "wav":
        return wav
    path = tmp_path / f"{kind}.safetensors"
    if kind == "text":
        path.write_text("notes: try the q8 model tomorrow, then the q4 one\n" * 3)
    elif kind == "empty":
        path.write_bytes(b"")
    else:  # a download cut short: a whole header, a part of the data
        import mlx.core as mx

        from moshi_mlx.checkpoints.io import SafetensorsWriter

        with open(path, "wb") as file:
            SafetensorsWriter(file, {"w": ((64, 64), mx.float32)}, {})
        path.write_bytes(path.read_bytes()[:200])
    return path


@pytest.mark.parametrize("kind", ["wav", "text", "empty", "cut"])
@pytest.mark.parametrize("command", ["quantize", "stt", "infer"])
def test_a_file_that_is_not_safetensors_is_named_in_one_line(env, wav, tmp_path, kind, command):
    """No `MemoryError` from a length read out of a wav or a text file (issue 41.1)."""
    bad = _not_safetensors(tmp_path, wav, kind)
    args = {
        "quantize": [bad, "-o", tmp_path / "out.safetensors"],
        "stt": [wav, "--moshi-weight", bad],
        "infer": [wav, "-o", tmp_path / "out.wav", "--moshi-weight", bad],
    }[command]
    line = _fails(env, command, *args, module="moshi_mlx")
    assert line.startswith(f"error: {bad} is not a safetensors file"), line


def test_weights_do_not_fit_the_config(env, wav, tmp_path, files):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(replace(tiny_config(), num_layers=3).to_dict()))
    line = _fails(env, wav, tmp_path / "out.wav", *weight_flags({**files, "lm_config": config}))
    assert str(files["moshi"]) in line and "missing tensor(s) transformer.layers.2" in line
    assert f"do not fit the LM config ({config}): pass the config.json" in line


def test_no_audio_device(env):
    line = _fails(env, module="moshi_mlx.local")
    assert "no audio input device found" in line and "--list-devices" in line


def test_portaudio_missing(env):
    line = _fails(env, "-c", HIDE_PORTAUDIO, "--list-devices", module=None)
    assert "PortAudio is not available" in line and "apt install libportaudio2" in line


def test_hf_repo_that_is_no_folder(env, wav, tmp_path):
    line = _fails(env, wav, tmp_path / "out.wav", "--hf-repo", tmp_path / "nope")
    assert line.startswith(f"error: the repo {tmp_path / 'nope'} does not exist")
    assert "huggingface.co" not in line


@pytest.mark.parametrize(
    ("module", "args", "message"),
    [
        ("moshi_mlx.local", ["--max-lag", "soon"], "argument --max-lag: invalid float value"),
        ("moshi_mlx web", ["--max-conversations", "0"], "--max-conversations: must be >= 1"),
        ("moshi_mlx infer", ["in.wav", "--kv-bits", "3"], "argument --kv-bits: invalid"),
        ("moshi_mlx infer", ["in.wav"], "arguments are required: -o OUTPUT"),
        ("moshi_mlx quantize", ["m.safetensors", "-q", "5"], "argument -q/--quantize: invalid"),
        ("moshi_mlx quantize", ["m.safetensors", "--bits", "5"], "argument --bits: invalid"),
        ("moshi_mlx stt", ["a.wav", "--batch", "0"], "--batch: must be >= 1, got 0"),
        ("moshi_mlx stt", ["a.wav", "--text-temp", "hot"], "argument --text-temp: invalid"),
        ("moshi_mlx tts", ["Hi.", "-o", "x.wav", "--top-k", "many"], "argument --top-k: invalid"),
        ("moshi_mlx", ["infer", "in.wav", "-o", "out.wav", "--temp", "x"], "argument --temp"),
        ("moshi_mlx", ["nope"], "no command 'nope'; one of: local, web, infer"),
        ("moshi_mlx", ["infer", "-o", "out.wav"], "arguments are required: input"),
        ("moshi_mlx", ["infer", "in.wav", "--top-k", "-1"], "--top-k: must be >= 0, got -1"),
        ("moshi_mlx tts", ["Hi.", "-o", "x.wav", "--seed", "-1"], "--seed: must be from 0 to"),
        ("moshi_mlx tts", ["Hi.", "-o", "x.wav", "--temp", "-1"], "--temp: must be >= 0, got -1"),
        ("moshi_mlx tts", ["Hi.", "-o", "x.wav", "--top-k", "-5"], "--top-k: must be >= 0"),
        ("moshi_mlx tts", ["Hi.", "-o", "x.wav", "--max-seconds", "-1"], "must be > 0, got -1"),
        ("moshi_mlx tts", ["Hi.", "-o", "{tmp}/newdir/"], "newdir/: use a .wav, .flac or .ogg"),
        ("moshi_mlx stt", ["a.wav", "--text-temp", "-1"], "--text-temp: must be >= 0, got -1"),
        ("moshi_mlx web", ["--temp", "-1"], "argument --temp: must be >= 0, got -1"),
        ("moshi_mlx web", ["--port", "99999"], "--port: must be from 1 to 65535"),
        ("moshi_mlx stt", ["--serve", "--port", "0"], "--port: must be from 1 to 65535, got 0"),
        ("moshi_mlx", ["serve", "--stt", "--port", "-1"], "--port: must be from 1 to 65535"),
        ("moshi_mlx", ["serve", "--tts", "--port", "99999"], "--port: must be from 1 to 65535"),
        ("moshi_mlx", ["assistant", "--top-p", "0"], "--top-p: must be > 0 and <= 1, got 0"),
    ],
)
def test_every_command_refuses_a_bad_value_in_one_line(env, tmp_path, module, args, message):
    """argparse's refusals too: one line `error: ...`, no usage dump, exit code 2; a bad port
    or sampling value before any model loads."""
    args = [arg.format(tmp=tmp_path) for arg in args]
    assert message in _fails(env, *args, module=module)
