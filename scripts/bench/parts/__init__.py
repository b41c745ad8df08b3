"""The bench's parts, by name, in the order a run measures them (`--parts` picks)."""

from __future__ import annotations

from ..part import Part
from . import (
    assistant,
    echo,
    kv,
    kv_fidelity,
    lm,
    mimi,
    ops,
    persona,
    pipeline,
    realtime,
    serve,
    stt,
    tts,
    web,
)

PARTS: dict[str, Part] = {
    part.name: part
    for part in (
        lm.PART,
        mimi.PART,
        pipeline.PART,
        echo.PART,
        ops.PART,
        kv.PART,
        kv_fidelity.PART,
        stt.PART,
        persona.PART,
        tts.PART,
        serve.PART,
        assistant.PART,
        realtime.PART,
        web.PART,
    )
}
