"""The speech-to-text API: load Kyutai's STT once, then transcribe 80 ms at a time.

    from moshi_mlx.stt.transcriber import SttModel

    model = SttModel.load()  # kyutai/stt-1b-en_fr, or local files
    stt = model.speech_to_text()
    for frame in frames:  # float32 (1920,) at 24 kHz
        step = stt.step(frame)  # step.events: words with times, end of turn
    for event in stt.flush():  # the words still behind the model's delay
        ...

`SpeechToText(model, streams=B)` transcribes B streams in one batch (`step_batch`): one read
of the weights per step serves them all, in Mimi and in the LM. Each stream has its own codec
state (a row of the batch's), word timer and turn detector; they start together (pad shorter
audio with silence).

As Kyutai's scripts, a transcription starts with the config's silence prefix and keeps every
token from step 0: what the model writes while the silence is fed counts (`prefix_steps`
holds those steps, and the first step after them reports their words and text).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import mlx.core as mx
import numpy as np

from moshi_mlx.checkpoints.hub import WeightFiles
from moshi_mlx.errors import AudioError, ConfigError
from moshi_mlx.models.lm import Lm
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE, Codec
from moshi_mlx.runtime.loading import LoadedParts, LoadOptions, load_parts
from moshi_mlx.runtime.memory_plan import MemoryPlan
from moshi_mlx.runtime.model_memo import ModelMemo
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.runtime.tokenizer import TextDecoder
from moshi_mlx.stt.events import EndOfTurn, SttEvent, SttStep
from moshi_mlx.stt.stepper import SttStepFunction, SttStepper
from moshi_mlx.stt.words import WordTimer

FRAME_SECONDS = FRAME_SIZE / SAMPLE_RATE
# Kyutai's end-of-turn rule: the voice-activity head 2's "done" class (0) above one half,
# once a word was heard since the last turn.
TURN_HEAD, TURN_THRESHOLD = 2, 0.5
# Silence fed after a file, beyond the model's delay, as Kyutai's run_inference pads it.
FLUSH_EXTRA_SECONDS = 1.0


@dataclass(frozen=True)
class SttModel:
    """Loaded speech-to-text weights: the LM (no depformer), the Mimi codec, the tokenizer."""

    lm: Lm
    codec: Codec
    tokenizer: object  # sentencepiece.SentencePieceProcessor
    files: WeightFiles
    memory: MemoryPlan | None = None  # the plan it was loaded under
    # The compiled steps its transcriptions share, per sampling.
    compiled_steps: ModelMemo[SttStepFunction] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "compiled_steps", ModelMemo(self.lm))

    @classmethod
    def load(cls, hf_repo: str | None = None, **options: object) -> SttModel:
        """Load Kyutai's speech-to-text.

        Args:
            hf_repo: a hub repo id or a local folder laid out like one (default
                kyutai/stt-1b-en_fr, whose config.json names the files); None with the files
                given in `options`.
            **options: the fields of `moshi_mlx.runtime.loading.LoadOptions`, by name.

        Returns:
            The loaded `SttModel`.
        """
        return cls.from_parts(load_parts(hf_repo, LoadOptions.named(**options), "stt"))

    @classmethod
    def from_parts(cls, parts: LoadedParts) -> SttModel:
        """The model of what `moshi_mlx.runtime.loading.load_parts` loaded."""
        if parts.lm.config.stt_config is None:
            raise ConfigError(
                f"{parts.files.config.path} is not a speech-to-text config (no stt_config)"
            )
        return cls(parts.lm, parts.codec, parts.tokenizer, parts.files, parts.memory)

    @property
    def has_pause_heads(self) -> bool:
        """Whether the model says when a speaker is done (its voice-activity heads: the
        ends of turns); kyutai/stt-2.6b-en has none."""
        return self.lm.config.extra_heads_num_heads > TURN_HEAD

    @property
    def silence_prefix_steps(self) -> int:
        """Steps of silence a transcription starts with (the config's silence prefix)."""
        return math.ceil(self.lm.config.stt_config.audio_silence_prefix_seconds / FRAME_SECONDS)

    def speech_to_text(
        self, streams: int = 1, text_sampling: Sampling | None = None
    ) -> SpeechToText:
        """A fresh transcription.

        Args:
            streams: how many audio streams step together (a batch, one row each).
            text_sampling: how the text is drawn (default: greedy, as Kyutai's STT).

        Returns:
            A `SpeechToText`: `step` 80 ms of every stream's audio, `flush` at the end.
        """
        return SpeechToText(self, streams, text_sampling)


class _TurnDetector:
    """End of turn from the voice-activity heads, once per turn (after some text was heard)."""

    def __init__(self):
        self.heard = False

    def update(self, text: str, done: float | None, time: float) -> tuple[EndOfTurn, ...]:
        self.heard = self.heard or bool(text.strip())
        if done is not None and done > TURN_THRESHOLD and self.heard:
            self.heard = False
            return (EndOfTurn(time),)
        return ()


class StreamReader:
    """One stream's text tokens into its steps: text pieces, timed words, ends of turn."""

    def __init__(self, model: SttModel):
        timing = model.lm.config.stt_config
        self.timing = timing
        self.timer = WordTimer(
            model.tokenizer,
            audio_delay=timing.audio_delay_seconds,
            silence_prefix=timing.audio_silence_prefix_seconds,
            padding_id=model.lm.config.existing_text_padding_id,
        )
        self._decoder = TextDecoder(model.tokenizer)
        self._turns = _TurnDetector()

    def read(self, index: int, token: int, heads: np.ndarray) -> SttStep:
        """The stream's step `index` (its own count, the silence prefix included) that gave
        `token` and the heads' "done" probabilities `heads` (heads,)."""
        time = max(0.0, index * FRAME_SECONDS - self.timing.audio_silence_prefix_seconds)
        text = self._decoder.decode(token)
        events = self.timer.push(index, token)
        done = heads[TURN_HEAD] if heads.shape[0] > TURN_HEAD else None
        events += self._turns.update(text, done, time)
        pause = tuple(float(p) for p in heads)
        return SttStep(index, events, pause, text, token)


class SpeechToText:
    """A streaming transcription of one or several streams; see the module docstring."""

    frame_size = FRAME_SIZE
    sample_rate = SAMPLE_RATE

    def __init__(self, model: SttModel, streams: int = 1, text_sampling: Sampling | None = None):
        config = model.lm.config
        self.model = model
        self.streams = streams
        self.timing = config.stt_config
        # Steps between a frame's audio and the words it yields (Kyutai's asr_delay_in_tokens).
        self.delay_steps = math.ceil(self.timing.audio_delay_seconds / FRAME_SECONDS)
        self._stepper = SttStepper(
            model.lm, streams, text_sampling, compiled_steps=model.compiled_steps
        )
        self._encoder = model.codec.batch_encoder(streams)
        self._readers = [StreamReader(model) for _ in range(streams)]
        self._silence = np.zeros((streams, FRAME_SIZE), np.float32)
        prefix = [self._step(self._silence) for _ in range(model.silence_prefix_steps)]
        # The prefix's words and text wait for the first step after it (`_advance`).
        self._carried: list[SttStep] | None = None
        if prefix:
            self._carried = [
                joined_steps([steps[stream] for steps in prefix]) for stream in range(streams)
            ]
        self.prefix_steps: list[list[SttStep]] = [
            [replace(steps[stream], events=(), text="") for steps in prefix]
            for stream in range(streams)
        ]  # per stream, the silence prefix's steps: their tokens and probabilities

    @property
    def step_index(self) -> int:
        """Steps taken, the silence before the audio included."""
        return self._stepper.step_index

    def step(self, pcm: np.ndarray) -> SttStep:
        """One frame (1920,) float32 at 24 kHz of a single-stream transcription."""
        if self.streams != 1:
            raise AudioError(f"this transcription has {self.streams} streams: use step_batch")
        return self.step_batch(np.asarray(pcm)[None])[0]

    def step_batch(self, pcm: np.ndarray) -> list[SttStep]:
        """One frame of every stream, (streams, 1920) float32 at 24 kHz."""
        pcm = np.asarray(pcm, np.float32)
        if pcm.shape != (self.streams, FRAME_SIZE):
            raise AudioError(
                f"expected audio of shape ({self.streams}, {FRAME_SIZE}), got {pcm.shape}"
            )
        return self._advance(pcm)

    @property
    def flush_steps(self) -> int:
        """Steps of silence after a stream's audio that bring out its last words."""
        seconds = self.timing.audio_delay_seconds + FLUSH_EXTRA_SECONDS
        return math.ceil(seconds / FRAME_SECONDS)

    def flush(self) -> list[SttEvent]:
        """End a single-stream transcription: `flush_steps` of silence, then its last words
        (as `step` is to `step_batch`, this is to `flush_batch`)."""
        if self.streams != 1:
            raise AudioError(f"this transcription has {self.streams} streams: use flush_batch")
        return self.flush_batch()[0]

    def flush_batch(self) -> list[list[SttEvent]]:
        """End every stream: `flush_steps` of silence, then the last words (per stream)."""
        events: list[list[SttEvent]] = [[] for _ in range(self.streams)]
        for _ in range(self.flush_steps):
            for stream, step in enumerate(self._advance(self._silence)):
                events[stream].extend(step.events)
        for stream in range(self.streams):
            events[stream].extend(self.finish_stream(stream))
        return events

    def finish_stream(self, stream: int) -> tuple[SttEvent, ...]:
        """The words still open in `stream`, whose audio (and flush) is over; its later steps
        are the caller's to ignore."""
        return self._readers[stream].timer.finish()

    def _advance(self, pcm: np.ndarray) -> list[SttStep]:
        """`_step`; the first one also reports what the silence prefix's steps produced."""
        steps = self._step(pcm)
        if self._carried is not None:
            steps = [joined_steps([carried, step]) for carried, step in zip(self._carried, steps)]
            self._carried = None
        return steps

    def _step(self, pcm: np.ndarray) -> list[SttStep]:
        out = self._stepper.step(self._encoder.encode_frames(pcm))
        mx.eval(out.text, out.head_probabilities, self._encoder.state)
        index = self._stepper.step_index - 1
        if not self._stepper.ready:
            return [SttStep(index) for _ in range(self.streams)]
        tokens = np.array(out.text).tolist()
        heads = done_probabilities(out.head_probabilities)
        return [
            reader.read(index, token, heads[stream])
            for stream, (reader, token) in enumerate(zip(self._readers, tokens))
        ]


def done_probabilities(head_probabilities: mx.array) -> np.ndarray:
    """Each row's pause heads' "done" probabilities (rows, heads) of a step's
    `head_probabilities` (rows, heads, classes); (rows, 0) for a model without pause heads."""
    probabilities = np.array(head_probabilities)
    return probabilities[:, :, :1].reshape(probabilities.shape[0], -1)


def joined_steps(steps: list[SttStep]) -> SttStep:
    """The last of `steps`, with the events and text of them all."""
    events = tuple(event for step in steps for event in step.events)
    text = "".join(step.text for step in steps)
    return replace(steps[-1], events=events, text=text)


@dataclass(frozen=True)
class Transcription:
    """One audio's transcription: its `events` (words, ends of turn), and its `steps` from
    step 0, the silence prefix's first, to the end of its own flush (each event is in one
    step, but for the last words, which `finish_stream` reports after the steps)."""

    events: list[SttEvent]
    steps: list[SttStep]


def transcribe(
    model: SttModel,
    audio: list[np.ndarray],
    batch: int = 8,
    text_sampling: Sampling | None = None,
    on_frames: Callable[[int], None] | None = None,
) -> list[list[SttEvent]]:
    """The events of each audio (float32 mono at 24 kHz), `batch` of them stepping together;
    each ends with its own flush, so its words are those it has transcribed alone.
    `on_frames(n)` after each step: n frames of the audio (80 ms each) were transcribed."""
    return [
        result.events for result in transcribe_steps(model, audio, batch, text_sampling, on_frames)
    ]


def transcribe_steps(
    model: SttModel,
    audio: list[np.ndarray],
    batch: int = 8,
    text_sampling: Sampling | None = None,
    on_frames: Callable[[int], None] | None = None,
) -> list[Transcription]:
    """`transcribe`, with every step of each audio (`Transcription`)."""
    results: list[Transcription] = []
    for first in range(0, len(audio), batch):
        group = audio[first : first + batch]
        stt = model.speech_to_text(len(group), text_sampling)
        frames = [math.ceil(len(pcm) / FRAME_SIZE) for pcm in group]
        ends = [stt.step_index + n + stt.flush_steps for n in frames]
        padded = np.zeros((len(group), max(frames) * FRAME_SIZE), np.float32)
        for stream, pcm in enumerate(group):
            padded[stream, : len(pcm)] = pcm
        events: list[list[SttEvent]] = [[] for _ in group]
        steps = [list(prefix) for prefix in stt.prefix_steps]
        for step in range(max(ends) - stt.step_index):
            frame = padded[:, step * FRAME_SIZE : (step + 1) * FRAME_SIZE]
            if frame.shape[1] < FRAME_SIZE:
                frame = np.zeros((len(group), FRAME_SIZE), np.float32)
            for stream, out in enumerate(stt.step_batch(frame)):
                if out.index < ends[stream]:
                    events[stream].extend(out.events)
                    steps[stream].append(out)
                if out.index == ends[stream] - 1:
                    events[stream].extend(stt.finish_stream(stream))
            if on_frames is not None:
                on_frames(sum(step < n for n in frames))
        results.extend(map(Transcription, events, steps))
    return results
