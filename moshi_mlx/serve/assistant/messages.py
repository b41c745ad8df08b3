"""The assistant's events as messages of Kyutai's chat protocol (`serve.chat.protocol`).

The assistant's words go out as 0x02 text, so any Kyutai client shows them; everything else
is 0x04 metadata, one JSON object per event:

| event | metadata |
| --- | --- |
| the user's words, as the STT recognises them | `{"user": "words"}` |
| the user's turn, complete | `{"user_said": "text"}` |
| the answer, played out or cut off | `{"answer_ended": "text as heard", "cut_off": bool}` |
| an answer's latency split | `{"latency": {"detection": ms, ..., "total": ms}}` |
| a notice (the LLM failed) | `{"notice": "text"}` |
"""

from __future__ import annotations

from moshi_mlx.assistant.latency import STAGES, TurnLatency
from moshi_mlx.assistant.pipeline import AnswerText, AssistantWords, Event, Notice, UserWords
from moshi_mlx.assistant.turns import (
    AnswerEnded,
    FlushStt,
    StartReply,
    StopReply,
    UserSaid,
    UserStarted,
)
from moshi_mlx.serve.chat import protocol


def event_message(event: Event) -> bytes | None:
    """The protocol message that tells the client about `event`; None for the turn-taking's
    own steps (a turn begins or ends, an answer starts or stops), which the page does not
    show."""
    if isinstance(event, AssistantWords):
        return protocol.text(f"{event.text} ")
    if isinstance(event, UserWords):
        return protocol.metadata({"user": event.text})
    if isinstance(event, UserSaid):
        return protocol.metadata({"user_said": event.text})
    if isinstance(event, AnswerEnded):
        return protocol.metadata({"answer_ended": event.text, "cut_off": event.cut_off})
    if isinstance(event, TurnLatency):
        split = {stage: round(getattr(event, stage) * 1000, 1) for stage in STAGES}
        return protocol.metadata({"latency": {**split, "total": round(event.total * 1000, 1)}})
    if isinstance(event, Notice):
        return protocol.metadata({"notice": event.text})
    if isinstance(event, UserStarted | FlushStt | StartReply | StopReply | AnswerText):
        return None
    raise TypeError(f"not an assistant event: {event!r}")
