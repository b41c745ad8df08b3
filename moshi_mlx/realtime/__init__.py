"""OpenAI's Realtime API without a socket: the conversation engine behind `/v1/realtime` and
an app's in-process session (`RealtimeSession`)."""

from moshi_mlx.realtime.config import (
    DUPLEX,
    REALTIME,
    TRANSCRIPTION,
    SessionConfig,
    SessionError,
)
from moshi_mlx.realtime.local import LocalRealtime, LocalSession
from moshi_mlx.realtime.session import RealtimeSession, SessionParts

__all__ = [
    "DUPLEX",
    "REALTIME",
    "TRANSCRIPTION",
    "LocalRealtime",
    "LocalSession",
    "RealtimeSession",
    "SessionConfig",
    "SessionError",
    "SessionParts",
]
