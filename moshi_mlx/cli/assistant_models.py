"""The assistant's model flags, its three models loaded and warmed on the model thread, and
its `--memory-plan`."""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from moshi_mlx.assistant.history import DEFAULT_SYSTEM
from moshi_mlx.checkpoints.spec import DEFAULT_STT_REPO, DEFAULT_TTS_REPO, DEFAULT_VOICE_REPO
from moshi_mlx.cli.common import add_alias, bounded, non_negative_float, positive_int
from moshi_mlx.errors import ConfigError
from moshi_mlx.runtime.loading import LoadOptions, find_model
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.tts.prefix import request_voices
from moshi_mlx.tts.synthesizer import DEFAULT_CFG_COEF
from moshi_mlx.tts.voices import DEFAULT_VOICE

# A 3B instruct model in 4 bits (1.8 GB): answers well in English and French, runs at tens of
# tokens per second on an M1, and with the STT and TTS fits a 16 GB Mac (docs/assistant.md).
DEFAULT_LLM = "mlx-community/Llama-3.2-3B-Instruct-4bit"
_WARM_UP_TEXT = "Hello there."


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    models = parser.add_argument_group("models")
    models.add_argument(
        "--llm",
        default=DEFAULT_LLM,
        metavar="REPO|FOLDER",
        help="an mlx-lm chat model (default %(default)s)",
    )
    models.add_argument(
        "--stt", default=DEFAULT_STT_REPO, metavar="REPO|FOLDER", help="default %(default)s"
    )
    models.add_argument(
        "--tts", default=DEFAULT_TTS_REPO, metavar="REPO|FOLDER", help="default %(default)s"
    )
    models.add_argument(
        "--voice-repo",
        default=DEFAULT_VOICE_REPO,
        metavar="REPO|FOLDER",
        help="the TTS voices (default %(default)s)",
    )
    models.add_argument(
        "--voice",
        metavar="NAME|FILE",
        help=f"the TTS voice: a name in the voice repo or a .safetensors file (default "
        f"{DEFAULT_VOICE}), or a recording (.wav, .flac, ...) whose voice it clones, which "
        "kyutai/tts-0.75b-en-public requires",
    )
    models.add_argument(
        "--system",
        metavar="TEXT|@FILE",
        help="the LLM's system prompt (default: a brief spoken assistant)",
    )
    models.add_argument(
        "--greeting",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the assistant speaks first (default on)",
    )
    models.add_argument(
        "--temp",
        type=non_negative_float,
        default=0.7,
        help="the LLM's temperature, 0 = greedy (default %(default)s)",
    )
    add_alias(models, "--temperature", dest="temp", type=non_negative_float)
    models.add_argument(
        "--top-p",
        type=bounded(float, 0, 1, above=True),
        default=0.95,
        help="the LLM's top-p (default %(default)s)",
    )
    models.add_argument(
        "--max-tokens",
        type=positive_int,
        default=256,
        help="the LLM's answer length at most, in tokens (default %(default)s)",
    )
    models.add_argument(
        "--memory-plan",
        action="store_true",
        help="print what the three models need in memory, and which Macs hold them; exit",
    )


def read_system_prompt(value: str | None) -> str:
    """`--system`: the text, or `@FILE`'s content; the default prompt when not given."""
    if value is None:
        return DEFAULT_SYSTEM
    if not value.startswith("@"):
        return value
    path = Path(value[1:])
    try:
        return path.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read the system prompt {path}: {exc}") from None


@dataclass
class Models:
    """The loaded parts, on the model thread: a STT stream, the LLM, a TTS stream maker."""

    stt: object
    llm: object
    make_speech: Callable[[], object]
    names: str


def load_models(
    args: argparse.Namespace, thread: ModelThread, system: str, stop: threading.Event
) -> Models | None:
    """Load and warm the three models on `thread`; None if `stop` is set meanwhile."""

    def call(label: str, fn: Callable[[], object]) -> object | None:
        print(f"[{label}...]", file=sys.stderr, flush=True)
        future = thread.call_soon(fn)
        while not stop.is_set():
            try:
                return future.result(0.05)
            except TimeoutError:
                continue
        return None

    from moshi_mlx.llm import LlmModel
    from moshi_mlx.stt.transcriber import SttModel
    from moshi_mlx.tts.synthesizer import TtsModel

    def load_tts():
        tts = TtsModel.load(args.tts, voice_repo=args.voice_repo)
        voices = [args.voice] if args.voice else []
        return tts, *request_voices(voices, tts.config, tts.mimi)  # a recording: cloned

    stt_model = call(f"loading STT {args.stt}", lambda: SttModel.load(args.stt))
    loaded = stt_model and call(f"loading TTS {args.tts}", load_tts)
    llm = loaded and call(f"loading LLM {args.llm}", lambda: LlmModel.load(args.llm))
    if llm is None:
        return None
    tts, voices, prefix = loaded

    def make_speech():
        return tts.stream(voice=voices, cfg_coef=DEFAULT_CFG_COEF, prefix=prefix)

    def warm_up():
        speech = make_speech()  # compiles the TTS step and checks the voice
        speech.push(_WARM_UP_TEXT)
        speech.close()
        for _, _ in zip(range(tts.delay_steps + 8), speech.steps()):
            pass
        messages = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        for _ in llm.generate(messages, max_tokens=1):  # keeps the system prompt's cache
            pass
        return stt_model.speech_to_text()

    stt = call("warming up", warm_up)
    if stt is None:
        return None
    return Models(stt, llm, make_speech, f"{args.stt} + {args.llm} + {args.tts}")


def print_memory_plan(args: argparse.Namespace) -> int:
    """`--memory-plan`: the STT's and TTS's plans (no weight read) and the LLM's file size."""
    stt = find_model(args.stt, LoadOptions(), "stt").memory
    tts = find_model(args.tts, LoadOptions(), "tts").memory
    llm = _llm_bytes(args.llm)
    total = stt.total + tts.total + (llm or 0)
    print(f"STT {args.stt}:\n{stt.table()}\nTTS {args.tts}:\n{tts.table()}")
    llm_line = f"{llm / 1e9:.1f} GB of weights" if llm else "size unknown (not downloaded)"
    print(f"LLM {args.llm}: {llm_line} (+ its KV cache: a few hundred MB for a conversation)")
    fits = ", ".join(
        f"{gb} GB Mac: {'fits' if total <= gb * 1e9 * (2 / 3 if gb <= 16 else 3 / 4) else 'no'}"
        for gb in (8, 16, 24)
    )
    print(f"together: {total / 1e9:.1f} GB; {fits}")
    return 0


def _llm_bytes(repo_or_folder: str) -> int | None:
    """The LLM's weight files' size: a local folder's, or the hub cache's (None if absent)."""
    folder = Path(repo_or_folder)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(repo_or_folder, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the cache: no size to read
            return None
    return sum(f.stat().st_size for f in folder.glob("*.safetensors")) or None
