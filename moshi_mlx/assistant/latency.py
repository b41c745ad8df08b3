"""The latency of each answer, split by stage, from the end of the user's speech (the last
voiced frame) to the first sample of the answer at the speaker."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

STAGES = ("detection", "stt_flush", "llm_first_token", "tts_first_audio", "audio_out")


@dataclass
class TurnTimes:
    """Monotonic times (seconds) of one turn's milestones, filled in as they happen."""

    last_voiced: float | None = None  # the user's last voiced mic frame reached the app
    end_of_turn: float | None = None  # the pause head fired; the STT flush starts
    flushed: float | None = None  # the flush is over; the LLM starts
    first_token: float | None = None  # the LLM's first text
    first_audio: float | None = None  # the TTS's first frame of the answer
    at_speaker: float | None = None  # that frame's first sample reaches the speaker

    def latency(self) -> TurnLatency | None:
        """The split, or None if the turn did not get that far (cut off before its audio)."""
        marks = [
            self.last_voiced,
            self.end_of_turn,
            self.flushed,
            self.first_token,
            self.first_audio,
            self.at_speaker,
        ]
        if any(mark is None for mark in marks):
            return None
        return TurnLatency(*(b - a for a, b in itertools.pairwise(marks)))


@dataclass(frozen=True)
class TurnLatency:
    """Seconds spent in each stage of one answer (`STAGES`)."""

    detection: float  # last voiced frame -> the pause head says the turn is over
    stt_flush: float  # the STT's delay flushed with silence
    llm_first_token: float  # prompt prefill and the first token
    tts_first_audio: float  # first words -> first frame of audio
    audio_out: float  # that frame -> the speaker (queues, device latency)

    @property
    def total(self) -> float:
        return sum(getattr(self, stage) for stage in STAGES)

    def line(self) -> str:
        parts = ", ".join(f"{stage} {getattr(self, stage) * 1000:.0f}" for stage in STAGES)
        return f"latency {self.total * 1000:.0f} ms ({parts} ms)"


@dataclass
class LatencyLog:
    """Every answer's latency; `summary()` is the line printed at exit."""

    turns: list[TurnLatency] = field(default_factory=list)

    def add(self, latency: TurnLatency) -> None:
        self.turns.append(latency)

    def medians(self) -> dict[str, float]:
        """Each stage's median and the total's, in seconds (empty without answers)."""
        if not self.turns:
            return {}
        result = {stage: _median([getattr(t, stage) for t in self.turns]) for stage in STAGES}
        result["total"] = _median([t.total for t in self.turns])
        return result

    def summary(self) -> str:
        medians = self.medians()
        if not medians:
            return "no answer timed"
        parts = ", ".join(f"{stage} {medians[stage] * 1000:.0f}" for stage in STAGES)
        return (
            f"{len(self.turns)} answers, median latency {medians['total'] * 1000:.0f} ms "
            f"({parts} ms)"
        )

    def as_dict(self) -> dict:
        return {
            "turns": [{**asdict(t), "total": t.total} for t in self.turns],
            "median": self.medians(),
        }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) / 2
    if len(ordered) % 2:
        return ordered[math.floor(middle)]
    return (ordered[int(middle) - 1] + ordered[int(middle)]) / 2
