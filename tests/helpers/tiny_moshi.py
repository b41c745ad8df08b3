"""Tiny random Moshi weight files for the app tests (tiny LM, full-size random Mimi).

Run as a script to write them into a folder: `python tests/helpers/tiny_moshi.py DIR`.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from moshi_mlx.models.config import LmConfig
    from moshi_mlx.tts.synthesizer import TtsModel

# The tiny random TTS checkpoint (with its tokenizer and voices), see tests/fixtures/tts.
TINY_TTS = Path(__file__).parents[1] / "fixtures" / "tts"

SENTENCES = [
    "hello there how are you today",
    "i am moshi a speech model running on your computer",
    "the quick brown fox jumps over the lazy dog",
    "what a nice day to talk about the weather",
]


def write_tokenizer(path: Path) -> Path:
    """Train a small SentencePiece model (tens of pieces) at `path`."""
    import sentencepiece

    prefix = path.with_suffix("")
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(SENTENCES * 20),
        model_prefix=str(prefix),
        vocab_size=100,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def tiny_config():
    """The LM tests' tiny config, with Mimi's 2048 audio tokens per codebook."""
    from moshi_mlx.models.lm import LmConfig

    return replace(LmConfig.tiny(), card=2048)


def tiny_personaplex_config():
    """`tiny_config` in PersonaPlex's layout: 16 depformer slices, voice and role prompts, and
    a context that holds a short prompt."""
    return replace(tiny_config(), dep_q=16, user_codebooks=8, generator="personaplex", context=120)


def write_voice(path: Path, seconds: float = 1.2, sample_rate: int = 16_000) -> Path:
    """A short voice-like recording (harmonics under a syllable envelope), stereo at 16 kHz:
    what the voice reader must mix, resample and normalize."""
    import numpy as np
    import soundfile

    t = np.arange(int(seconds * sample_rate)) / sample_rate
    pitch = 140 + 30 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / sample_rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 * (1 - np.cos(2 * np.pi * 4 * t)) * 0.2
    mono = (voice * envelope).astype(np.float32)
    soundfile.write(str(path), np.stack([mono, 0.5 * mono], axis=1), sample_rate)
    return path


def write_tiny_personaplex(root: Path) -> dict[str, Path]:
    """Like `write_tiny_moshi` for PersonaPlex (bf16 LM in PyTorch naming), with a voice."""
    import json

    import mlx.core as mx

    from moshi_mlx.checkpoints.conversion import to_pytorch_naming
    from moshi_mlx.checkpoints.spec import CONFIG_FILE, MIMI_FILE, TOKENIZER_FILE
    from moshi_mlx.testing.checkpoints import (
        write_random_lm_checkpoint,
        write_random_mimi_checkpoint,
    )

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config = tiny_personaplex_config()
    mlx_file = write_random_lm_checkpoint(root / "mlx.safetensors", config, seed=7)
    moshi = root / "model.safetensors"
    weights = mx.load(str(mlx_file))
    for name in weights:  # PyTorch shares the depformer's norms between its steps
        if ".norm" in name and name.startswith("depformer.slices."):
            weights[name] = weights["depformer.slices.0." + name.split(".", 3)[3]]
    mx.save_safetensors(str(moshi), to_pytorch_naming(weights))
    mlx_file.unlink()
    (root / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
    return {
        "moshi": moshi,
        "lm_config": root / CONFIG_FILE,
        "mimi": write_random_mimi_checkpoint(root / MIMI_FILE, seed=5),
        "tokenizer": write_tokenizer(root / TOKENIZER_FILE),
        "voice": write_voice(root / "voice.wav"),
    }


def write_eight_step_file(sixteen_steps: Path, path: Path) -> Path:
    """A PersonaPlex file in PyTorch naming cut down to the 8-step files NVIDIA's loader
    repairs: the depformer's attention rows of steps 0-7, no gating, linears or depformer_in
    of steps 8-15, no depformer_emb past 7."""
    import mlx.core as mx

    kept = {}
    for name, array in mx.load(str(sixteen_steps)).items():
        parts = name.split(".")
        if parts[0] in ("linears", "depformer_in", "depformer_emb") and int(parts[1]) >= 8:
            continue
        if name.startswith("depformer.layers.") and parts[3] == "gating" and int(parts[4]) >= 8:
            continue
        if name.startswith("depformer.layers.") and parts[3] == "self_attn":
            array = array[: array.shape[0] // 2]
        kept[name] = array
    mx.save_safetensors(str(path), kept)
    return path


VOICE_NAMES = ("NATF2", "NATM1")


def write_voices_archive(path: Path, names: tuple[str, ...] = VOICE_NAMES) -> Path:
    """A `voices.tgz` like NVIDIA's whose voices are all `persona_voice.pt`, a voice that the
    tiny PersonaPlex model takes (tests/fixtures/torch_zip)."""
    import tarfile

    voice = Path(__file__).parents[1] / "fixtures" / "torch_zip" / "persona_voice.pt"
    with tarfile.open(path, "w:gz") as archive:
        for name in names:
            archive.add(voice, f"voices/{name}.pt")
    return path


def cached_tiny_personaplex(tmp_path_factory) -> dict[str, Path]:
    """`write_tiny_personaplex` with a `write_voices_archive` beside the weights, once per
    pytest session."""
    from moshi_mlx.checkpoints.spec import CONFIG_FILE, MIMI_FILE, TOKENIZER_FILE

    root = tmp_path_factory.getbasetemp() / "tiny_personaplex"
    files = {
        "moshi": root / "model.safetensors",
        "lm_config": root / CONFIG_FILE,
        "mimi": root / MIMI_FILE,
        "tokenizer": root / TOKENIZER_FILE,
        "voice": root / "voice.wav",
        "voices": root / "voices.tgz",
    }
    if not all(path.is_file() for path in files.values()):
        files = write_tiny_personaplex(root)
        files["voices"] = write_voices_archive(root / "voices.tgz")
    return files


def write_tiny_moshi(root: Path) -> dict[str, Path]:
    """Write moshi (tiny LM, q4) + config.json, mimi (random, full size) and a tokenizer."""
    from moshi_mlx.checkpoints.spec import MIMI_FILE, TOKENIZER_FILE
    from moshi_mlx.testing.checkpoints import (
        write_random_lm_checkpoint,
        write_random_mimi_checkpoint,
    )

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    moshi = write_random_lm_checkpoint(
        root / "model.q4.safetensors",
        tiny_config(),
        bits=4,
        group_size=32,
        seed=3,
        write_config=True,
    )
    return {
        "moshi": moshi,
        "lm_config": root / "config.json",
        "mimi": write_random_mimi_checkpoint(root / MIMI_FILE, seed=5),
        "tokenizer": write_tokenizer(root / TOKENIZER_FILE),
    }


HIBIKI_VALUES = ["very_bad", "bad", "neutral", "good", "very_good"]


def tiny_hibiki_config():
    """`tiny_config` in Hibiki's layout: a "description" LUT condition summed into the input,
    delays 2, and guidance 3 in its `lm_gen_config` (as the published config.json)."""
    from moshi_mlx.models.config import LmConfig
    from moshi_mlx.models.config_sections import GenDefaults

    lut = {"type": "lut", "lut": {"n_bins": 31, "dim": 16, "possible_values": HIBIKI_VALUES}}
    hibiki = tiny_config().to_dict() | {
        "delays": [0, 0] + [2] * 7 + [0] + [2] * 7,
        "conditioners": {"description": lut},
        "fuser": {"sum": ["description"]},
        "model_type": "hibiki",
    }
    return replace(LmConfig.from_dict(hibiki), lm_gen_config=GenDefaults(cfg_coef=3.0))


def cached_tiny_hibiki(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Hibiki (`tiny_hibiki_config`, bf16, MLX naming) and its config.json with
    `cached_tiny_moshi`'s Mimi and tokenizer, once per pytest session."""
    return _cached_lm(tmp_path_factory, "tiny_hibiki", tiny_hibiki_config, seed=4)


def tiny_hibiki_zero_config():
    """The Hibiki-Zero parity fixture's config (tests/fixtures/hibiki_zero: grouped-query
    attention, split-halves RoPE, depformer norms and schedule) over Mimi's 2048 tokens per
    codebook, with the published file names."""
    import json

    from moshi_mlx.models.config import LmConfig

    fixture = Path(__file__).parents[1] / "fixtures" / "hibiki_zero" / "config.json"
    return LmConfig.from_dict(
        json.loads(fixture.read_text())
        | {
            "card": 2048,
            "moshi_name": "hibiki-pytorch-77f82164@110.safetensors",
            "tokenizer_name": "tokenizer_spm_48k_multi6_2.model",
        }
    )


def cached_tiny_hibiki_zero(tmp_path_factory) -> dict[str, Path]:
    """A tiny random Hibiki-Zero (`tiny_hibiki_zero_config`, bf16, MLX naming) and its
    config.json with `cached_tiny_moshi`'s Mimi and tokenizer, once per pytest session."""
    return _cached_lm(tmp_path_factory, "tiny_hibiki_zero", tiny_hibiki_zero_config, seed=5)


def _cached_lm(tmp_path_factory, folder: str, config, seed: int) -> dict[str, Path]:
    """`cached_tiny_moshi`'s files with a random LM of `config()` (bf16, MLX naming) and its
    config.json in `folder` of the session's temporary root, written once per session."""
    from moshi_mlx.testing.checkpoints import write_random_lm_checkpoint

    root = tmp_path_factory.getbasetemp() / folder
    files = cached_tiny_moshi(tmp_path_factory) | {
        "moshi": root / "model.safetensors",
        "lm_config": root / "config.json",
    }
    if not all(path.is_file() for path in files.values()):
        write_random_lm_checkpoint(root, config(), seed=seed, write_config=True)
    return files


def tiny_stt_config(heads: int = 4):
    """A tiny model in Kyutai's STT layout (32 audio streams in, no depformer, voice-activity
    heads, text 0.5 s behind the audio) over Mimi's 2048 tokens per codebook."""
    from moshi_mlx.models.config import LmConfig
    from moshi_mlx.models.config_sections import SttTiming

    return LmConfig(
        dim=32, num_heads=2, num_layers=2, hidden_scale=2.0, context=40, card=2048,
        text_card=100, n_q=32, dep_q=0, delays=(0,) * 33, model_type="stt",
        extra_heads_num_heads=heads, stt_config=SttTiming(0.5, 0.0),
        tokenizer_name="tokenizer_spm_32k_3.model",
    )  # fmt: skip


def write_tiny_stt(
    root: Path, mimi: Path, tokenizer: Path, config: LmConfig | None = None
) -> dict[str, Path]:
    """A tiny random STT checkpoint of `config` (default `tiny_stt_config()`; bf16 values,
    PyTorch naming, as kyutai/stt-1b-en_fr) and its config.json in `root`, beside the given
    Mimi and tokenizer. Its text head favours padding (3) and word boundaries (0), as a
    trained model's does, so that words come out."""
    import json

    import mlx.core as mx
    import numpy as np
    from safetensors.numpy import save_file

    from moshi_mlx.checkpoints.conversion import to_pytorch_naming
    from moshi_mlx.testing.checkpoints import write_random_lm_checkpoint

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    config = config or tiny_stt_config()
    weights = mx.load(str(write_random_lm_checkpoint(root / "mlx.safetensors", config, seed=11)))
    text_linear = np.array(weights["text_linear.weight"].astype(mx.float32))
    text_linear[[0, 3]] *= 6.0
    weights["text_linear.weight"] = mx.array(text_linear).astype(mx.bfloat16)
    tensors = {
        k: np.ascontiguousarray(np.array(v.astype(mx.float32)))
        for k, v in to_pytorch_naming(weights).items()
    }
    moshi = root / "model.safetensors"
    save_file(tensors, str(moshi))
    (root / "mlx.safetensors").unlink()
    (root / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    return {"moshi": moshi, "lm_config": root / "config.json", "mimi": mimi, "tokenizer": tokenizer}


def cached_tiny_stt(tmp_path_factory) -> dict[str, Path]:
    """`write_tiny_stt` beside `cached_tiny_moshi`'s Mimi and tokenizer, once per pytest
    session."""
    moshi = cached_tiny_moshi(tmp_path_factory)
    root = tmp_path_factory.getbasetemp() / "tiny_stt"
    files = {**moshi, "moshi": root / "model.safetensors", "lm_config": root / "config.json"}
    if not all(path.is_file() for path in files.values()):
        files = write_tiny_stt(root, moshi["mimi"], moshi["tokenizer"])
    return files


def load_tiny_stt(files: dict[str, Path]):
    """`SttModel.load` over `files` (`cached_tiny_stt`), with `fast_codec`."""
    from moshi_mlx.stt.transcriber import SttModel

    return SttModel.load(**_load_arguments(files))


def load_tiny_tts(mimi_weight: Path) -> TtsModel:
    """`TtsModel.load` of the tiny random TTS in tests/fixtures/tts, in float32, with the Mimi
    at `mimi_weight`."""
    import mlx.core as mx

    from moshi_mlx.tts.synthesizer import TtsModel

    return TtsModel.load(
        moshi_weight=TINY_TTS / "weights.safetensors",
        mimi_weight=mimi_weight,
        tokenizer=TINY_TTS / "tokenizer.model",
        lm_config=TINY_TTS / "config.json",
        dtype=mx.float32,
    )


def fast_codec() -> str:
    """rustymimi (about 3x faster than the MLX Mimi on a CPU) when installed, else mlx."""
    import importlib.util

    return "rustymimi" if importlib.util.find_spec("rustymimi") else "mlx"


def weight_flags(files: dict[str, Path]) -> list[str]:
    """The CLI flags that point at `files`."""
    return [
        "--moshi-weight",
        str(files["moshi"]),
        "--mimi-weight",
        str(files["mimi"]),
        "--tokenizer",
        str(files["tokenizer"]),
        "--lm-config",
        str(files["lm_config"]),
    ]


def tiny_moshi_command(module: str, files: dict[str, Path], *flags) -> list[str]:
    """`python -m MODULE` (a module and its command: "moshi_mlx web") over `files` with
    `fast_codec`, then `flags`."""
    return [
        sys.executable,
        "-m",
        *module.split(),
        *weight_flags(files),
        "--codec",
        fast_codec(),
        *map(str, flags),
    ]


def cached_tiny_moshi(tmp_path_factory) -> dict[str, Path]:
    """`write_tiny_moshi` once per pytest session (shared by the test files that need it)."""
    from moshi_mlx.checkpoints.spec import MIMI_FILE, TOKENIZER_FILE

    root = tmp_path_factory.getbasetemp() / "tiny_moshi"
    files = {
        "moshi": root / "model.q4.safetensors",
        "lm_config": root / "config.json",
        "mimi": root / MIMI_FILE,
        "tokenizer": root / TOKENIZER_FILE,
    }
    if not all(path.is_file() for path in files.values()):
        files = write_tiny_moshi(root)
    return files


def espeak_speech(
    path: Path, text: str, rate: int = 24_000, channels: int = 1, voice: str = "en"
) -> Path | None:
    """Speech from `espeak-ng` in `voice` (a language: "en", "fr", ...) converted by `sox` to
    `rate`/`channels`; None if not installed."""
    import shutil
    import subprocess

    if shutil.which("espeak-ng") is None or shutil.which("sox") is None:
        return None
    raw = path.with_suffix(".espeak.wav")
    subprocess.run(["espeak-ng", "-v", voice, "-w", str(raw), text], check=True)
    subprocess.run(["sox", str(raw), "-r", str(rate), "-c", str(channels), str(path)], check=True)
    return path


def load_tiny_model(files: dict[str, Path]):
    """`MoshiModel.load` over `files` (`cached_tiny_moshi`), with `fast_codec`."""
    from moshi_mlx.chat.model import MoshiModel

    return MoshiModel.load(**_load_arguments(files))


def _load_arguments(files: dict[str, Path]) -> dict:
    """A model's `load` arguments for the tiny `files`, with `fast_codec`."""
    return {
        "moshi_weight": files["moshi"],
        "mimi_weight": files["mimi"],
        "tokenizer": files["tokenizer"],
        "lm_config": files["lm_config"],
        "codec_backend": fast_codec(),
    }


if __name__ == "__main__":
    for name, path in write_tiny_moshi(Path(sys.argv[1])).items():
        print(name, path)
