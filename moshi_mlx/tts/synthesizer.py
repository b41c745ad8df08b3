"""The text-to-speech API: load Kyutai's TTS once, then speak texts, in batches or as words
arrive.

    from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest

    model = TtsModel.load()  # kyutai/tts-1.6b-en_fr, or local files
    [speech] = model.synthesize([TtsRequest("Hello there.", voices=("expresso/...",))])
    speech.pcm  # float32 at 24 kHz; speech.words: (word, start seconds)

    stream = model.stream(voice="expresso/...")  # words in as they come, 80 ms frames out
    stream.push("Hello")  # more words at any time; close() after the last
    for pcm in stream.frames():  # yields as soon as the model has spoken; None: waiting
        ...

Both run `TtsRun`: B requests in one batch, each with its own text schedule
(`moshi_mlx.tts.machine`), voices and distilled-guidance value, stepped together by
`TtsStepper` and decoded by one batched Mimi. Audio is cut as Kyutai's `TTSModel` cuts it:
from `delay_steps + 2` frames on, `end_step` frames per request.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import mlx.core as mx
import numpy as np

from moshi_mlx.checkpoints.hub import WeightFiles
from moshi_mlx.checkpoints.spec import DEFAULT_VOICE_REPO
from moshi_mlx.errors import TtsError
from moshi_mlx.models.config import LmConfig
from moshi_mlx.models.depformer import ZERO_TOKEN
from moshi_mlx.models.lm import Lm
from moshi_mlx.models.mimi import Mimi
from moshi_mlx.modules.transformer import CrossKV
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE, Codec
from moshi_mlx.runtime.loading import LoadedParts, LoadOptions, load_parts
from moshi_mlx.runtime.memory_plan import MemoryPlan
from moshi_mlx.runtime.model_memo import ModelMemo
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.runtime.step_state import StepOutput
from moshi_mlx.tts.conditions import step_conditions
from moshi_mlx.tts.machine import Entry, Outcomes, TextSchedule, TokenIds, script_to_entries
from moshi_mlx.tts.prefix import AudioPrefixes, clones_only, recording_codes
from moshi_mlx.tts.stepper import STEP_FUNCTIONS_KEPT, TtsStepFunction, TtsStepper
from moshi_mlx.tts.text_feed import TextFeed
from moshi_mlx.tts.token_log import TokenLog, TtsTokens
from moshi_mlx.tts.voices import DEFAULT_VOICE, Voice, VoiceCache

FRAME_RATE = SAMPLE_RATE / FRAME_SIZE  # 12.5 steps per second
DEFAULT_CFG_COEF = 2.0  # Kyutai's default guidance, given as the "cfg" condition
FINAL_PADDING = 4  # steps generated past the last word's audio (Kyutai's)
SKIPPED_FRAMES = 2  # decoded but not played at the start of the audio (Kyutai's)


@dataclass(frozen=True)
class TtsRequest:
    """One text to speak: `text` (words, `<break time="0.5s"/>` pauses; a list: turns of
    alternating speakers, the first the main one), one to five voices (names in the voice repo,
    `.safetensors` files, or embeddings: `VoiceEmbedding`), and the guidance strength
    `cfg_coef` (one of the config's "cfg" values; None: none given). `prefix`: audio the
    speech continues, in its voice (cloning; `TtsModel.voice_prefix` of a wav): Mimi codes
    (codebooks, frames), at least the codebooks generated."""

    text: str | Sequence[str]
    voices: tuple[Voice, ...] = (DEFAULT_VOICE,)
    cfg_coef: float | None = DEFAULT_CFG_COEF
    prefix: np.ndarray | None = None


def _no_tokens() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass
class Speech:
    """A spoken request: `pcm` float32 at 24 kHz, `words` [(word, start seconds)], and
    `complete`: False when the step budget ran out before the text's end. Its tokens at every
    step of the run (`TokenLog.arrays`, this request's row): `predicted_tokens` (T,) and
    `fed_tokens` (T,) the text tokens, `audio_codes` (n_q, T - max_delay) each frame's."""

    pcm: np.ndarray
    words: list[tuple[str, float]] = field(default_factory=list)
    complete: bool = True
    predicted_tokens: np.ndarray = field(default_factory=_no_tokens)
    fed_tokens: np.ndarray = field(default_factory=_no_tokens)
    audio_codes: np.ndarray = field(default_factory=_no_tokens)


@dataclass(frozen=True)
class TtsModel:
    """Loaded TTS weights: the LM, the Mimi codec (all 32 codebooks), the tokenizer.
    `n_q`: the audio codebooks its runs generate and decode, the first n_q (None: all;
    Kyutai's `TTSModel(n_q=...)`: fewer is faster, the later codebooks adding detail)."""

    lm: Lm
    codec: Codec
    tokenizer: object  # sentencepiece.SentencePieceProcessor
    files: WeightFiles
    voice_repo: str = DEFAULT_VOICE_REPO
    memory: MemoryPlan | None = None  # the plan it was loaded under
    n_q: int | None = None
    # The compiled steps its runs share, and the voices they spoke in lately, read and
    # projected (`VoiceCache`).
    compiled_steps: ModelMemo[TtsStepFunction] = field(init=False, repr=False, compare=False)
    voice_cache: VoiceCache = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        dep_q = self.lm.config.dep_q
        if self.n_q is not None and not 1 <= self.n_q <= dep_q:
            raise TtsError(f"this model generates 1 to {dep_q} audio codebooks, not {self.n_q}")
        object.__setattr__(self, "compiled_steps", ModelMemo(self.lm, STEP_FUNCTIONS_KEPT))
        object.__setattr__(self, "voice_cache", VoiceCache(self.lm, self.voice_repo))

    @property
    def codebooks(self) -> int:
        """The audio codebooks generated and decoded: `n_q`, or all."""
        return self.lm.config.dep_q if self.n_q is None else self.n_q

    @cached_property
    def mimi(self) -> Mimi:
        """The Mimi that decodes the generated codebooks and encodes recordings (the codec's,
        on `codebooks` and the LM's `card` codes each: a recording's codes are ones the LM
        reads)."""
        return self.codec.model.with_codebooks(self.codebooks, self.config.card)

    @classmethod
    def load(
        cls,
        hf_repo: str | None = None,
        *,
        voice_repo: str = DEFAULT_VOICE_REPO,
        n_q: int | None = None,
        **options: object,
    ) -> TtsModel:
        """Load Kyutai's text-to-speech.

        Args:
            hf_repo: a hub repo id or a local folder laid out like one (default
                kyutai/tts-1.6b-en_fr, whose config.json names the files); None with the files
                given in `options`. Files made by `moshi_mlx.quantize` load as they are.
            voice_repo: where voices come from, a hub repo id or a folder.
            n_q: the audio codebooks to generate (`TtsModel.n_q`; None: all).
            **options: the fields of `moshi_mlx.runtime.loading.LoadOptions`, by name.

        Returns:
            The loaded `TtsModel`.
        """
        parts = load_parts(hf_repo, LoadOptions.named(**options), "tts")
        return cls.from_parts(parts, voice_repo, n_q)

    @classmethod
    def from_parts(
        cls, parts: LoadedParts, voice_repo: str = DEFAULT_VOICE_REPO, n_q: int | None = None
    ) -> TtsModel:
        """The model of what `moshi_mlx.runtime.loading.load_parts` loaded."""
        return cls(
            parts.lm, parts.codec, parts.tokenizer, parts.files, voice_repo, parts.memory, n_q
        )

    @property
    def config(self) -> LmConfig:
        return self.lm.config

    @property
    def clones_only(self) -> bool:
        """Whether it speaks in cloned voices only (no voice embeddings:
        tts-0.75b-en-public; `prefix.clones_only`)."""
        return clones_only(self.config)

    @property
    def delay_steps(self) -> int:
        """Steps the audio lags the text (Kyutai truncates `audio_delay * 12.5`)."""
        return int(self.config.tts_config.audio_delay * FRAME_RATE)

    @property
    def token_ids(self) -> TokenIds:
        return TokenIds(self.config.text_card + 1)

    def entries(self, text: str | Sequence[str], padding_between: int = 1) -> list[Entry]:
        """The words and pauses of `text` (or of its turns), as the schedule takes them."""
        turns = [text] if isinstance(text, str) else list(text)
        multi_speaker = bool(self.config.fuser.cross)
        return script_to_entries(
            self.tokenizer, self.token_ids, FRAME_RATE, turns, multi_speaker, padding_between
        )

    def schedule(self) -> TextSchedule:
        """An empty text schedule for one stream (Kyutai's paddings: 8 at most, 2 first)."""
        ahead = self.config.tts_config.second_stream_ahead
        return TextSchedule(self.token_ids, second_stream_ahead=ahead)

    def voice(self, voice: Voice) -> mx.array:
        """A voice's embedding (frames, dim), by name in the voice repo, as a file or as given
        (`VoiceEmbedding`)."""
        return self.voice_cache.embedding(voice)

    def voice_prefix(self, recording: str | Path | np.ndarray) -> np.ndarray:
        """The audio prefix (`TtsRequest.prefix`) that clones the voice of a recording (an
        audio file, or float32 mono samples at 24 kHz): Mimi's codes (codebooks, frames), as
        Kyutai's `TTSModel.get_prefix`. Each of its frames costs one step before the speech."""
        return recording_codes(self.mimi, recording)

    def voice_keys_values(self, rows: Sequence[Sequence[Voice]]) -> list[CrossKV]:
        """The temporal layers' cross-attention keys and values of each batch row's voices
        (names in the voice repo, files or embeddings), kept for the next requests in the same voices
        (`VoiceCache`)."""
        return self.voice_cache.rows_keys_values(rows)

    def synthesize(
        self,
        requests: Sequence[TtsRequest],
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        seed: int | None = None,
        max_steps: int = 30_000,
        on_step: Callable[[], None] | None = None,
        padding_bonus: float = 0.0,
    ) -> list[Speech]:
        """Speak every request, in one batch.

        Args:
            requests: the texts, each with its voices and guidance (`TtsRequest`).
            text_sampling, audio_sampling: how the text and the audio are drawn (default
                Kyutai's).
            seed: the batch's random stream (None: drawn at random).
            max_steps: the most steps (80 ms each) before the batch stops.
            on_step: called after each step.
            padding_bonus: added to the padding logit (> 0: slower speech), as `TtsStepper`'s.

        Returns:
            One `Speech` per request: its audio, word timings and tokens.
        """
        run = TtsRun(self, requests, text_sampling, audio_sampling, seed, padding_bonus)
        for request, schedule in zip(requests, run.schedules):
            schedule.push(self.entries(request.text))
            schedule.close()
        pcm: list[list[np.ndarray]] = [[] for _ in requests]
        log = TokenLog(self.codebooks)
        while not run.finished and run.step_index < max_steps:
            step = run.step()
            log.add(step.tokens)
            for row, frame in enumerate(step.pcm):
                if frame is not None:
                    pcm[row].append(frame)
            if on_step is not None:
                on_step()
        tokens = log.arrays(len(requests))
        return [
            Speech(
                np.concatenate(frames) if frames else np.zeros(0, np.float32),
                run.words(row),
                run.schedules[row].end_step is not None,
                tokens["predicted_text_tokens"][row],
                tokens["fed_text_tokens"][row],
                tokens["audio_codes"][row],
            )
            for row, frames in enumerate(pcm)
        ]

    def stream(
        self,
        voice: Voice | Sequence[Voice] = DEFAULT_VOICE,
        cfg_coef: float | None = DEFAULT_CFG_COEF,
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        seed: int | None = None,
        padding_bonus: float = 0.0,
        prefix: np.ndarray | None = None,
    ) -> TtsStream:
        """A stream that speaks words pushed at any time.

        Args:
            voice: a voice, or the voices of several speakers.
            cfg_coef: the distilled guidance, one of the config's "cfg" values (None: none).
            text_sampling, audio_sampling, seed, padding_bonus: as `synthesize`'s.
            prefix: audio codes to continue (`voice_prefix`: a recording's voice).

        Returns:
            A `TtsStream`: `push` words, `close`, and iterate its `frames()`.
        """
        voices = (voice,) if isinstance(voice, Voice) else tuple(voice)
        request = TtsRequest("", voices, cfg_coef, prefix)
        run = TtsRun(self, [request], text_sampling, audio_sampling, seed, padding_bonus)
        return TtsStream(self, run)


def spoken_words(schedule: TextSchedule, prefix_frames: int = 0) -> list[tuple[str, float]]:
    """The words `schedule` took, with the time (s) each starts in the audio played: a word
    taken at text step s is heard `delay_steps` frames later, and the audio played starts
    at frame `delay_steps + SKIPPED_FRAMES`, after an audio prefix's `prefix_frames`."""
    start = SKIPPED_FRAMES + prefix_frames
    return [(word, (step - start) / FRAME_RATE) for word, step in schedule.transcript]


@dataclass(frozen=True)
class TtsStep:
    """One step of a `TtsRun`: per request its next 80 ms of audio (float32 (1920,)) or None
    (none yet, or its audio ended), and the step's `tokens`."""

    pcm: list[np.ndarray | None]
    tokens: TtsTokens


class TtsRun:
    """B requests stepped together: each has a `TextSchedule` (push its words), and each
    `step` returns, per request, an 80 ms frame of audio (float32 (1920,)) or None."""

    def __init__(
        self,
        model: TtsModel,
        requests: Sequence[TtsRequest],
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        seed: int | None = None,
        padding_bonus: float = 0.0,
    ):
        if not requests:
            raise TtsError("nothing to speak: no request given")
        self.model = model
        lm = model.lm
        self.prefixes = AudioPrefixes.of([r.prefix for r in requests], lm.config, model.delay_steps)
        conditions = step_conditions(
            lm,
            [request.voices for request in requests],
            [request.cfg_coef for request in requests],
            [self.prefixes.length(row) for row in range(len(requests))],
            model.delay_steps,
            model.voice_keys_values,
        )
        self.seed = seed if seed is not None else int.from_bytes(os.urandom(4), "little")
        self.stepper = TtsStepper(
            lm,
            conditions.condition,
            conditions.cross,
            model.delay_steps,
            text_sampling,
            audio_sampling,
            self.seed,
            compiled_steps=model.compiled_steps,
            n_q=model.n_q,
            padding_bonus=padding_bonus,
            masked_until=conditions.masked_until,
            cfg_coef=conditions.cfg_coef,
        )
        self.schedules = [model.schedule() for _ in requests]
        self._mimi_state = None  # made at the first frame decoded
        self._first_audio = model.delay_steps  # the first frame Mimi can decode

    @property
    def step_index(self) -> int:
        return self.stepper.step_index

    @property
    def finished(self) -> bool:
        """Kyutai's stop rule: every request's text ended, and its audio had its final
        padding."""
        step = self.stepper.step_index
        delay = self.model.delay_steps
        return all(s.done(step, delay, FINAL_PADDING) for s in self.schedules)

    def step_tokens(self) -> TtsTokens:
        """One step of the LM for every request, its schedule updated; no audio decoded."""
        return self._commit(*self._queue_step())

    def _queue_step(self) -> tuple[int, StepOutput]:
        """Queue one LM step (lazy): the step's index and its output."""
        t = self.stepper.step_index
        outcomes = [
            Outcomes(ZERO_TOKEN, ZERO_TOKEN) if self.prefixes.text_held(row, t) else s.speculate()
            for row, s in enumerate(self.schedules)
        ]
        words, others = [o.word for o in outcomes], [o.other for o in outcomes]
        depformer = t >= self.model.delay_steps and not self.prefixes.replaced(
            t, self.model.codebooks
        )
        return t, self.stepper.step(words, others, self.prefixes.forced(t), depformer)

    def _commit(self, t: int, out: StepOutput) -> TtsTokens:
        """Step `t`'s predictions into the schedules (read on the host: a wait unless they
        were evaluated) and its tokens."""
        predicted = np.array(out.text).tolist()
        fed = [
            ZERO_TOKEN if self.prefixes.text_held(row, t) else s.commit(t, token)
            for row, (s, token) in enumerate(zip(self.schedules, predicted))
        ]
        return TtsTokens(predicted, fed, out.frame if self.stepper.ready else None)

    def step(self) -> TtsStep:
        """One step for every request: its next 80 ms of audio, or None (none yet, or its
        audio ended), and the step's tokens. The LM step and Mimi's decoding of its frame are
        queued together and waited for once."""
        t, out = self._queue_step()
        frame_index = t - self.model.lm.config.max_delay  # the audio time of the step's frame
        if not self.stepper.ready or frame_index < self._first_audio:
            return TtsStep([None] * len(self.schedules), self._commit(t, out))
        codes = out.frame[:, 1 : 1 + self.model.codebooks, None].astype(mx.uint32)
        mimi = self.model.mimi
        self._mimi_state = self._mimi_state or mimi.make_state()
        samples = mimi.decode_step(codes, self._mimi_state)[:, 0]
        mx.eval(out.text, samples, self._mimi_state.state)  # the step's one wait
        tokens = self._commit(t, out)
        pcm = np.array(samples, np.float32)
        played = frame_index - self._first_audio - SKIPPED_FRAMES
        frames: list[np.ndarray | None] = []
        for row, schedule in enumerate(self.schedules):
            ended = schedule.end_step is not None and played >= schedule.end_step
            before = played < self.prefixes.length(row)  # the prefix's own audio: not played
            frames.append(None if before or ended else np.clip(pcm[row], -1, 1))
        return TtsStep(frames, tokens)

    def words(self, row: int) -> list[tuple[str, float]]:
        """Request `row`'s words with the time (s) each starts in its audio (`spoken_words`)."""
        return spoken_words(self.schedules[row], self.prefixes.length(row))


class TtsStream:
    """Words in as they come, audio out as it is made (`TtsModel.stream`).

    `push(text)` adds words (a fragment may end mid-sentence; words are split on spaces as
    they arrive, the last one held until a space or `close` ends it), `close()` says the text
    is complete, and `frames()` steps the model, yielding 80 ms of audio per step once speech
    has started (None while the model waits for text it has not got), and ends after the
    text's last word has been spoken.
    """

    def __init__(self, model: TtsModel, run: TtsRun):
        self.model = model
        self.run = run
        self._schedule = run.schedules[0]
        self._feed = TextFeed(self._schedule, model.entries, model.token_ids.main)

    def push(self, text: str) -> None:
        """Add text; complete words enter the schedule at once."""
        self._feed.push(text)

    def close(self) -> None:
        """The text is complete."""
        self._feed.close()

    @property
    def words(self) -> list[tuple[str, float]]:
        """The words spoken so far, with the time (s) each starts."""
        return self.run.words(0)

    def frames(self) -> Iterator[np.ndarray | None]:
        """Step until the text is closed and spoken: 80 ms of audio per step once it plays,
        None while waiting."""
        for step in self.steps():
            frame = step.pcm[0]
            if frame is not None or self.waiting:
                yield frame

    @property
    def waiting(self) -> bool:
        """Whether the last step asked for a word not pushed yet."""
        return self._schedule.waiting

    def steps(self) -> Iterator[TtsStep]:
        """`frames`, as every step's `TtsStep` (with its tokens), those that play nothing
        included."""
        while not self.run.finished:
            yield self.run.step()
