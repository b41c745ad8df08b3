"""PersonaPlex over the web: what a client may choose, and its choice from `/api/chat`'s query.

NVIDIA's client puts the persona on the URL: `voice_prompt=NATF2.pt&text_prompt=You are ...`.
NVIDIA's server joins `voice_prompt` to its voices folder, so a client can name any file the
server can read; ours takes only a published voice's name (with or without `.pt`), and never
hands the client's role to `read_role` as `@file`.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from moshi_mlx.chat.persona.role import DEFAULT_ROLE, EXAMPLE_ROLES, read_role
from moshi_mlx.chat.persona.voice import DEFAULT_VOICE, VOICE_SUFFIX, is_voice_name
from moshi_mlx.serve.chat.protocol import ProtocolError

if TYPE_CHECKING:
    from moshi_mlx.chat.model import MoshiModel

MAX_ROLE_CHARS = 2000
_SHOWN_CHARS = 40  # of a refused value, in the reason sent back


@dataclass(frozen=True)
class PersonaOptions:
    """What `/api/persona` tells a page: whether the model takes a persona, the voices a
    client may name, and the server's defaults (`--voice`, `--role`)."""

    prompted: bool = False
    voices: tuple[str, ...] = ()
    default_voice: str = DEFAULT_VOICE
    default_role: str = DEFAULT_ROLE
    example_roles: tuple[str, ...] = field(default=EXAMPLE_ROLES)

    def as_json(self) -> dict:
        if not self.prompted:
            return {"prompted": False, "voices": []}
        return {
            "prompted": True,
            "voices": list(self.voices),
            "default_voice": self.default_voice,
            "default_role": self.default_role,
            "example_roles": list(self.example_roles),
            "max_role_chars": MAX_ROLE_CHARS,
        }


def persona_options(
    model: MoshiModel, voice: str | None, role: str | None, voices: list[str]
) -> PersonaOptions:
    """The options of `model` with the server's `voice` and `role` (flag values) and the
    published `voices`."""
    if model.prompts is None:
        return PersonaOptions()
    if voice is None:
        default_voice = DEFAULT_VOICE
    else:
        default_voice = voice if is_voice_name(voice) else Path(voice).name
    return PersonaOptions(
        prompted=True,
        voices=tuple(voices),
        default_voice=default_voice,
        default_role=read_role(role) if role is not None else DEFAULT_ROLE,
    )


def prompt_choice(
    query: Mapping[str, str], options: PersonaOptions
) -> tuple[str | None, str | None]:
    """(voice, role) that the query chooses, None where it leaves the server's default.

    `voice_prompt`: a name from `options.voices`, `.pt` allowed; empty: the default.
    `text_prompt`: the role, at most `MAX_ROLE_CHARS` characters without control characters;
    empty: no role (as NVIDIA's server). `ProtocolError` with the reason otherwise, and for
    any choice sent to a model without a persona.
    """
    voice, role = query.get("voice_prompt") or None, query.get("text_prompt")
    if not options.prompted:
        if voice is not None or role:
            raise ProtocolError(
                "query parameters voice_prompt and text_prompt choose PersonaPlex's persona; "
                "this server's model is Moshi, which takes neither"
            )
        return None, None
    if voice is not None:
        name = voice.removesuffix(VOICE_SUFFIX)
        if not is_voice_name(name) or name not in options.voices:
            known = ", ".join(options.voices) or "none: this server has no published voices"
            raise ProtocolError(
                f"query parameter voice_prompt must name a voice ({known}), got {_shown(voice)}"
            )
        voice = name
    if role is not None:
        if len(role) > MAX_ROLE_CHARS:
            raise ProtocolError(
                f"query parameter text_prompt is {len(role)} characters long; the limit is "
                f"{MAX_ROLE_CHARS}"
            )
        if any(unicodedata.category(char) == "Cc" for char in role):
            raise ProtocolError("query parameter text_prompt holds control characters")
        if role.startswith("@"):  # `read_role` would read a file of the server's
            raise ProtocolError("query parameter text_prompt may not start with @")
    return voice, role


def _shown(value: str) -> str:
    """`value` quoted for a one-line reason, cut short."""
    cut = value[:_SHOWN_CHARS] + ("..." if len(value) > _SHOWN_CHARS else "")
    return repr(cut)
