"""Exceptions for problems a user can fix: bad files, bad configs, missing devices.

The command-line entry points catch `MoshiError` and print its one-line message without a
traceback; anything else is a bug and keeps its traceback.
"""


class MoshiError(Exception):
    """A problem with the user's input or environment, described in one sentence."""


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
