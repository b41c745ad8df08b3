"""Exceptions for problems a user can fix: bad files, bad configs, missing devices.

The command-line entry points catch `MoshiError` and print its one-line message without a
traceback; anything else is a bug and keeps its traceback. A message names the API
parameters it is about as `Setting`s, so that a command line shows each as its flag
(`MoshiError.spelled`): `kv_bits=3` to a Python caller, `--kv-bits 3` to a shell.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

NO_VALUE = object()  # a `Setting` that names a parameter without a value


@dataclass(frozen=True)
class Setting:
    """An API parameter named in a message, with the value it is (or would be) given."""

    name: str
    value: object = NO_VALUE

    def in_api_terms(self) -> str:
        """`name`, or `name=value`."""
        return self.name if self.value is NO_VALUE else f"{self.name}={self.value}"


class MoshiError(Exception):
    """A problem with the user's input or environment, described in one sentence.

    The message is given as parts: text, and `Setting`s for the API parameters it names;
    `str()` spells them as the API does. `parameter`: the one the error concerns, if any.
    """

    def __init__(self, *parts: object, parameter: str | None = None):
        self.parts = parts
        self.parameter = parameter
        super().__init__(self.spelled())

    def spelled(self, spell: Callable[[Setting], str] = Setting.in_api_terms) -> str:
        """The message with each `Setting` spelled by `spell` (e.g. as a command's flag)."""
        return "".join(spell(p) if isinstance(p, Setting) else str(p) for p in self.parts)


class ConfigError(MoshiError):
    """An invalid or inconsistent model configuration."""


class WeightsError(MoshiError):
    """A checkpoint that is missing, unreadable, or does not match the model."""


class AudioError(MoshiError):
    """An audio device, PortAudio or audio-file problem."""


class WeightsMismatchError(WeightsError):
    """A readable checkpoint whose tensors (names, shapes, dtypes) do not match the model."""


class TtsError(MoshiError):
    """A text-to-speech request that cannot be run: a bad voice, script, entry or option."""


ONE_LINE_CHARS = 200  # the most of an error's message a client or a log line gets


def one_line(exc: BaseException) -> str:
    """`exc`'s message on one line (each run of whitespace a single space), at most
    `ONE_LINE_CHARS` characters (an exception may carry a client's data: it never reaches a
    log or a client whole), or its type's name when it has no message."""
    return " ".join(str(exc).split())[:ONE_LINE_CHARS] or type(exc).__name__


def removed_names(module: str, replacements: dict[str, str]) -> Callable[[str], NoReturn]:
    """A module's `__getattr__` (PEP 562) that answers each name it no longer has with an
    `ImportError` saying what replaced it (`replacements`: name -> a short sentence, e.g.
    "LmGen is now ChatStepper (moshi_mlx.chat.generate)"), and any other with the usual
    `AttributeError`. ImportError, because `from module import name` would turn an
    AttributeError into its own message and lose ours."""

    def __getattr__(name: str) -> NoReturn:
        if name in replacements:
            raise ImportError(replacements[name], name=module)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
