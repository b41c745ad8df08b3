"""A Realtime session's settings (`SessionConfig`), read from the client's `session.update` and
shown back in `session.created` / `session.updated`, as the GA protocol's session objects.

Turn detection maps onto Kyutai's pause head, a semantic end-of-turn detector: `server_vad`
and `semantic_vad` both end a turn when the head says "done" above a threshold, which
`semantic_vad`'s `eagerness` sets (`EAGERNESS_THRESHOLDS`; `server_vad` keeps Unmute's 0.6 and
its `threshold`, `silence_duration_ms`, `prefix_padding_ms` are shown but not used);
`create_response` and `interrupt_response` say whether a turn's end starts the answer and
whether speech stops one; `null` leaves turns to `input_audio_buffer.commit`.
Fields the server cannot honour (tools, tracing, noise reduction...) are accepted and ignored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from moshi_mlx.assistant.turns import TurnRules
from moshi_mlx.realtime.formats import AudioFormat, parse_format

REALTIME, TRANSCRIPTION = "realtime", "transcription"
# A Moshi (PersonaPlex) session: of the protocol's type "realtime", full duplex.
DUPLEX = "duplex"
EAGERNESS_THRESHOLDS = {"low": 0.8, "medium": 0.6, "auto": 0.6, "high": 0.4}
DEFAULT_VOICE_NAME = "alloy"  # an OpenAI voice: the TTS's default voice
# Include this in `session.include` for each word's timing as a
# `conversation.item.input_audio_transcription.segment` event.
# (taken in `include`, not shown in the session object, whose types list only OpenAI's).
WORD_TIMINGS = "item.input_audio_transcription.word_timings"
SHOWN_INCLUDES = ("item.input_audio_transcription.logprobs",)
MAX_INSTRUCTIONS_CHARS = 32_000


class SessionError(ValueError):
    """A client event the session refuses: a message and the parameter it concerns."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class SessionConfig:
    """What the client may set; `as_dict()` is the session object the protocol shows."""

    kind: str = REALTIME
    model: str = ""
    instructions: str = ""
    voice: str | None = DEFAULT_VOICE_NAME  # None: none yet (a TTS of cloned voices only)
    input_format: AudioFormat = field(default_factory=AudioFormat)
    output_format: AudioFormat = field(default_factory=AudioFormat)
    turn_detection: dict | None = field(default_factory=lambda: {"type": "server_vad"})
    transcription: dict | None = None
    max_output_tokens: int | None = None
    include: tuple[str, ...] = ()
    output_modalities: tuple[str, ...] = ("audio",)  # or ("text",): answers written only

    def rules(self, base: TurnRules) -> TurnRules:
        """`base` (the server's turn-taking) as this session's turn detection sets it."""
        detection = self.turn_detection
        if detection is None:
            return replace(base, ends_turns=False, replies=False, barge_in=False)
        threshold = base.pause_threshold
        if detection["type"] == "semantic_vad":
            threshold = EAGERNESS_THRESHOLDS[detection.get("eagerness") or "auto"]
        return replace(
            base,
            pause_threshold=threshold,
            ends_turns=True,
            replies=self.kind == REALTIME and detection.get("create_response", True),
            barge_in=detection.get("interrupt_response", True),
        )

    @property
    def speaks(self) -> bool:
        """Whether answers are spoken (else only written)."""
        return "audio" in self.output_modalities

    @property
    def word_timings(self) -> bool:
        return WORD_TIMINGS in self.include

    def update(self, session: object) -> None:
        """Apply a `session.update`'s `session` object; SessionError names a bad field (and
        nothing is changed then)."""
        if not isinstance(session, dict):
            raise SessionError("session must be an object", "session")
        kind = session.get("type", self.kind)
        if kind != self.kind:
            raise SessionError(f"this session is of type {self.kind!r}", "session.type")
        new = replace(self)
        if "instructions" in session and self.kind == REALTIME:
            new.instructions = _text(session["instructions"], "session.instructions")
        if "model" in session and session["model"] is not None:
            new.model = _text(session["model"], "session.model", 256)
        if session.get("output_modalities") is not None:
            new.output_modalities = output_modalities(
                session["output_modalities"], "session.output_modalities"
            )
        if "max_output_tokens" in session:
            new.max_output_tokens = _max_tokens(session["max_output_tokens"])
        if "include" in session:
            include = session["include"] or []
            if not isinstance(include, list) or not all(isinstance(i, str) for i in include):
                raise SessionError("include must be a list of strings", "session.include")
            new.include = tuple(include[:16])
        audio = _object(session.get("audio"), "session.audio")
        audio_in = _object(audio.get("input"), "session.audio.input")
        audio_out = _object(audio.get("output"), "session.audio.output")
        if audio_in.get("format") is not None:
            new.input_format = _format(audio_in["format"], "session.audio.input.format")
        if audio_out.get("format") is not None:
            new.output_format = _format(audio_out["format"], "session.audio.output.format")
        if "turn_detection" in audio_in:
            new.turn_detection = _turn_detection(audio_in["turn_detection"])
        if "transcription" in audio_in:
            value = audio_in["transcription"]
            new.transcription = _object(value, "session.audio.input.transcription") or None
        voice = audio_out.get("voice")
        if isinstance(voice, dict):  # {"id": ...}
            voice = voice.get("id")
        if voice is not None:
            new.voice = _text(voice, "session.audio.output.voice", 256)
        self.__dict__.update(new.__dict__)

    def as_dict(self, session_id: str) -> dict[str, Any]:
        """The session object of `session.created` / `session.updated`."""
        audio_in = {
            "format": self.input_format.as_dict(),
            "noise_reduction": None,
            "transcription": self.transcription,
            "turn_detection": self.turn_detection,
        }
        common = {"id": session_id, "object": f"realtime.{self.kind}_session", "include": None}
        shown = [name for name in self.include if name in SHOWN_INCLUDES]
        if shown:  # the protocol's types know these only (WORD_TIMINGS is ours)
            common["include"] = shown
        if self.kind == TRANSCRIPTION:
            common["object"] = "realtime.transcription_session"
            return {"type": TRANSCRIPTION, **common, "audio": {"input": audio_in}}
        return {
            "type": REALTIME,
            **common,
            "object": "realtime.session",
            "model": self.model,
            "output_modalities": list(self.output_modalities),
            "instructions": self.instructions,
            "audio": {
                "input": audio_in,
                "output": {
                    "format": self.output_format.as_dict(),
                    "voice": self.voice,
                    "speed": 1.0,
                },
            },
            "tools": [],
            "tool_choice": "auto",
            "max_output_tokens": self.max_output_tokens or "inf",
            "tracing": None,
            "truncation": "auto",
            "prompt": None,
        }


def output_modalities(value: object, param: str) -> tuple[str, ...]:
    """`["audio"]` (spoken answers, with their transcripts) or `["text"]` (written only)."""
    if value not in (["audio"], ["text"]):
        raise SessionError(f'{param} must be ["audio"] or ["text"]', param)
    return tuple(value)


def _object(value: object, param: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SessionError(f"{param} must be an object", param)
    return value


def _text(value: object, param: str, max_chars: int = MAX_INSTRUCTIONS_CHARS) -> str:
    if not isinstance(value, str):
        raise SessionError(f"{param} must be a string", param)
    if len(value) > max_chars:
        raise SessionError(f"{param} is over {max_chars} characters", param)
    return value


def _format(value: object, param: str) -> AudioFormat:
    try:
        return parse_format(value)
    except ValueError as exc:
        raise SessionError(f"{param}: {exc}", param) from None


def _max_tokens(value: object) -> int | None:
    if value is None or value == "inf":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 4096:
        raise SessionError(
            "max_output_tokens must be an integer from 1 to 4096 or 'inf'",
            "session.max_output_tokens",
        )
    return value


def _turn_detection(value: object) -> dict | None:
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    detection = _object(value, param)
    kind = detection.get("type")
    if kind not in ("server_vad", "semantic_vad"):
        raise SessionError(f"{param}.type must be 'server_vad' or 'semantic_vad'", param)
    eagerness = detection.get("eagerness")
    if kind == "semantic_vad" and eagerness not in (None, *EAGERNESS_THRESHOLDS):
        raise SessionError(f"{param}.eagerness must be low, medium, high or auto", param)
    for flag in ("create_response", "interrupt_response"):
        if detection.get(flag) is not None and not isinstance(detection[flag], bool):
            raise SessionError(f"{param}.{flag} must be true or false", param)
    shown = {"type": kind}
    for name in ("create_response", "interrupt_response"):
        shown[name] = True if detection.get(name) is None else detection[name]
    if kind == "semantic_vad":
        shown["eagerness"] = eagerness or "auto"
    else:
        for name, default in (("threshold", 0.5), ("prefix_padding_ms", 300)):
            shown[name] = _number(detection.get(name), default)
        shown["silence_duration_ms"] = _number(detection.get("silence_duration_ms"), 500)
        shown["idle_timeout_ms"] = None
    return shown


def _number(value: object, default: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return value
