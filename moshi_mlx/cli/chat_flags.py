"""The chat model's flags (Moshi, PersonaPlex, Hibiki) and what they give: the weights, memory,
sampling, guidance and persona flags of `local`, `infer` and `serve --moshi`, the model they
load, a conversation's arguments, `--memory-plan` and `--list-voices`."""

from __future__ import annotations

import argparse

from moshi_mlx.chat.generate import AUDIO_SAMPLING, TEXT_SAMPLING
from moshi_mlx.chat.persona.role import DEFAULT_ROLE, read_role
from moshi_mlx.chat.persona.voice import (
    DEFAULT_VOICE,
    MAX_VOICE_SECONDS,
    existing_voice_file,
    is_voice_name,
)
from moshi_mlx.checkpoints.spec import DEFAULT_REPO
from moshi_mlx.cli.common import (
    SamplingDefaults,
    add_sampling_args,
    add_weight_args,
    load_options,
    non_negative_float,
    positive_int,
)
from moshi_mlx.errors import ConfigError
from moshi_mlx.modules.kv_quant import DEFAULT_KV_GROUP_SIZE, KV_BITS, KV_GROUP_SIZES
from moshi_mlx.runtime.loading import find_model, load_parts
from moshi_mlx.runtime.sampling import Sampling

CHAT_SAMPLING = SamplingDefaults(
    why="Kyutai's Moshi defaults (its LMGen): audio sampled hotter than text, so that the voice "
    "sounds natural while the words stay on topic",
    temp=AUDIO_SAMPLING.temp,
    top_k=AUDIO_SAMPLING.top_k,
    text_temp=TEXT_SAMPLING.temp,
    text_top_k=TEXT_SAMPLING.top_k,
)


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The chat models' flags: weights (with `-q`), memory and sampling."""
    add_weight_args(parser, DEFAULT_REPO, precision=True)
    memory = parser.add_argument_group("memory")
    memory.add_argument(
        "--context",
        type=positive_int,
        metavar="STEPS",
        help="attention window in 80 ms steps, at most the model's 3000 (a shorter one saves "
        "KV-cache memory)",
    )
    memory.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        help="store the KV cache in 8 or 4 bits (about 1/2 or 1/3 of its bf16 size)",
    )
    memory.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        help="values per scale of the quantized KV cache (default "
        + ", ".join(f"{size} for {bits} bits" for bits, size in DEFAULT_KV_GROUP_SIZE.items())
        + ")",
    )
    memory.add_argument(
        "--memory-plan",
        action="store_true",
        help="print how much memory the model would take and whether it fits, then exit",
    )
    add_sampling_args(parser, CHAT_SAMPLING)
    parser.add_argument_group("guidance").add_argument(
        "--cfg-coef",
        type=non_negative_float,
        help="Hibiki: classifier-free guidance, 1 = none (default: the model's config, else 1)",
    )


def add_persona_args(parser: argparse.ArgumentParser) -> None:
    """`--voice`, `--role` and `--list-voices`: PersonaPlex's persona (Moshi takes none)."""
    persona = parser.add_argument_group(
        "persona", "PersonaPlex only: who Moshi is (its prompt is computed once, then cached)"
    )
    persona.add_argument(
        "--voice",
        metavar="NAME|FILE",
        help=f"a published voice's name (default {DEFAULT_VOICE}; see --list-voices), a "
        f"recording of up to {MAX_VOICE_SECONDS:.0f} s (.wav, .flac, ...) or NVIDIA's voice .pt",
    )
    persona.add_argument(
        "--role",
        metavar="TEXT|@FILE",
        help=f"the role, as text or @file.txt to read a file (default: {DEFAULT_ROLE!r})",
    )
    persona.add_argument(
        "--list-voices", action="store_true", help="print the published voices' names and exit"
    )


def check_persona_args(args: argparse.Namespace) -> None:
    """Before the model loads: `ConfigError` for a role file or voice file that is not there."""
    if args.role is not None:
        read_role(args.role)
    if args.voice is not None and not is_voice_name(args.voice):
        existing_voice_file(args.voice)


def sampling_from_args(args: argparse.Namespace) -> tuple[Sampling, Sampling]:
    """The text's and the audio's `Sampling` that the sampling flags describe."""
    return Sampling(args.text_temp, args.text_top_k), Sampling(args.temp, args.top_k)


def print_memory_plan(args: argparse.Namespace) -> int:
    """`--memory-plan`: print the plan of the model the flags describe (no weight is read)."""
    options = load_options(args)
    print(find_model(args.hf_repo, options, "chat").memory.table())
    return 0


def print_voice_names(args: argparse.Namespace) -> int:
    """`--list-voices`: the published voices of the PersonaPlex model the flags describe, one
    name a line (no weight is read)."""
    from moshi_mlx.chat.persona.voice import voice_names
    from moshi_mlx.checkpoints.hub import resolve_voices

    found = find_model(args.hf_repo, load_options(args), "chat")
    if not found.config.prompted:
        raise ConfigError(
            "--list-voices lists PersonaPlex's voices; this model is Moshi, whose voice is in "
            "its weights (load nvidia/personaplex-7b-v1)"
        )
    print("\n".join(voice_names(resolve_voices(found.files))))
    return 0


def load_model(args: argparse.Namespace):
    """Load the chat model (`MoshiModel`) that the weight flags describe."""
    from moshi_mlx.chat.model import MoshiModel

    return MoshiModel.from_parts(load_parts(args.hf_repo, load_options(args), "chat"), args.codec)


def conversation_options(args: argparse.Namespace) -> dict[str, object]:
    """The sampling, seed, persona and guidance flags as `MoshiModel.conversation`'s
    arguments by name."""
    text_sampling, audio_sampling = sampling_from_args(args)
    return {
        "text_sampling": text_sampling,
        "audio_sampling": audio_sampling,
        "seed": args.seed,
        "voice": args.voice,
        "role": args.role,
        "cfg_coef": args.cfg_coef,
    }
