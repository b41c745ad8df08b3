"""PersonaPlex's text role prompt: what Moshi is told about who it is and what it does."""

from __future__ import annotations

from pathlib import Path

import sentencepiece

from moshi_mlx.errors import ConfigError

SYSTEM_TAG = "<system>"
DEFAULT_ROLE = "You enjoy having a good conversation."
MAX_ROLE_FILE_BYTES = 64 << 10
# Example roles in the three kinds PersonaPlex was trained on: an assistant, a service agent
# with facts to use, and open conversation on a topic.
EXAMPLE_ROLES = (
    (
        "You are a patient and cheerful tutor. Explain things simply and check that the "
        "listener follows."
    ),
    (
        "You work for Harbor Bikes, a bicycle repair shop, and your name is Lena. Information: "
        "the shop opens at 9 am; a tune-up costs $45 and takes two days."
    ),
    (
        "You enjoy having a good conversation. Have a relaxed chat about your favourite "
        "places to travel."
    ),
)


def read_role(choice: str) -> str:
    """The role of `--role`: the text itself, or with a leading `@`, a UTF-8 file's text."""
    if not choice.startswith("@"):
        return choice
    path = Path(choice[1:]).expanduser()
    if not path.is_file():
        raise ConfigError(f"role file not found: {path}")
    if path.stat().st_size > MAX_ROLE_FILE_BYTES:
        raise ConfigError(f"the role file {path} is over {MAX_ROLE_FILE_BYTES >> 10} KB")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"the role file {path} is not UTF-8 text") from None


def wrapped(role: str) -> str:
    """The role between `<system>` tags, as the model was trained (unless already so)."""
    cleaned = role.strip()
    if cleaned.startswith(SYSTEM_TAG) and cleaned.endswith(SYSTEM_TAG):
        return cleaned
    return f"{SYSTEM_TAG} {cleaned} {SYSTEM_TAG}"


def role_tokens(role: str, tokenizer: sentencepiece.SentencePieceProcessor) -> list[int]:
    """The role's text tokens, wrapped; none for an empty role (then the prompt has no
    role frames)."""
    if not role.strip():
        return []
    return list(tokenizer.encode(wrapped(role)))
