"""The sections of Kyutai's `config.json` that say how a model runs rather than what it is:
`stt_config`, `lm_gen_config`, `tts_config` and `model_id`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moshi_mlx.errors import ConfigError
from moshi_mlx.models.condition_config import known_keys


@dataclass(frozen=True)
class SttTiming:
    """`stt_config`: the text stream lags the audio by `audio_delay_seconds`; files are
    transcribed after `audio_silence_prefix_seconds` of silence."""

    audio_delay_seconds: float
    audio_silence_prefix_seconds: float

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SttTiming:
        data = known_keys(
            "stt_config", data, ("audio_delay_seconds", "audio_silence_prefix_seconds")
        )
        try:
            timing = cls(
                float(data.get("audio_delay_seconds", 0.0)),
                float(data.get("audio_silence_prefix_seconds", 0.0)),
            )
        except (TypeError, ValueError):
            raise ConfigError(f"LM config stt_config has a value that is not a number: {data}")
        if timing.audio_delay_seconds < 0 or timing.audio_silence_prefix_seconds < 0:
            raise ConfigError(f"LM config stt_config values must be >= 0, got {data}")
        return timing


_GEN_DEFAULT_KEYS = ("temp", "temp_text", "top_k", "top_k_text", "cfg_coef")


@dataclass(frozen=True)
class GenDefaults:
    """`lm_gen_config`: the sampling a checkpoint is meant to run with (None: ours)."""

    temp: float | None = None
    temp_text: float | None = None
    top_k: int | None = None
    top_k_text: int | None = None
    cfg_coef: float | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GenDefaults:
        data = known_keys("lm_gen_config", data, (*_GEN_DEFAULT_KEYS, "text_temp"))
        data = dict(data)
        if "text_temp" in data:  # the TTS's spelling of temp_text
            data.setdefault("temp_text", data.pop("text_temp"))
        try:
            defaults = cls(
                **{
                    key: (int if key.startswith("top_k") else float)(value)
                    for key, value in data.items()
                    if value is not None
                }
            )
        except (TypeError, ValueError):
            raise ConfigError(f"LM config lm_gen_config has a value that is not a number: {data}")
        return defaults


@dataclass(frozen=True)
class TtsTiming:
    """`tts_config`: the audio streams lag the text by `audio_delay` seconds; the second text
    stream carries the word `second_stream_ahead` words ahead of the one being spoken."""

    audio_delay: float
    second_stream_ahead: int = 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TtsTiming:
        data = known_keys("tts_config", data, ("audio_delay", "second_stream_ahead", "multistream"))
        if data.get("multistream"):
            raise ConfigError("LM config tts_config multistream models are not supported")
        try:
            timing = cls(float(data["audio_delay"]), int(data.get("second_stream_ahead", 0)))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"LM config tts_config needs a numeric audio_delay, got {data}")
        if timing.audio_delay < 0 or timing.second_stream_ahead < 0:
            raise ConfigError(f"LM config tts_config values must be >= 0, got {data}")
        return timing

    def to_dict(self) -> dict[str, Any]:
        return {"audio_delay": self.audio_delay, "second_stream_ahead": self.second_stream_ahead}


@dataclass(frozen=True)
class ModelId:
    """`model_id`: the training run (`sig`) and epoch of a checkpoint; Kyutai's voice files
    are named after the model they were made for (`{voice}.{sig}@{epoch}.safetensors`)."""

    sig: str
    epoch: int

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelId:
        data = known_keys("model_id", data, ("sig", "epoch"))
        try:
            return cls(str(data["sig"]), int(data["epoch"]))
        except (KeyError, TypeError, ValueError):
            raise ConfigError(f"LM config model_id needs a sig and an epoch, got {data}")
