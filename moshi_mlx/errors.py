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
