"""TTS streams that come and go, stepped together: one compiled step for up to `rows` streams.

    batch = TtsBatch(model, rows=8)          # from the model thread of a server
    row = batch.add(TtsRequest("", voices))  # a free row; its stream starts at the next step
    batch.push(row, "Hello there")           # words at any time; batch.close(row) at the end
    for out in batch.step():                 # one 80 ms frame per busy row
        out.pcm                              # float32 (1920,) or None (nothing to play yet)
        if out.finished: batch.remove(out.row)

Kyutai's server resets rows of one batch as requests come and go; so does this. The batch
runs at one global position (the temporal `KVRing`'s), and each row remembers where its
stream started (`KVRing.starts`): a row attends only to what it wrote since, its delayed tokens
row and Mimi state start empty, its voices and conditions are written into its row, and its
text schedule counts its own steps. RoPE being relative, a stream's tokens and audio are
those it gets alone, up to float rounding (greedy: the same tokens; tested).

A model guided by null rows (tts-0.75b-en-public, `LmConfig.direct_guidance`: voices cloned
from audio prefixes) runs 2 x `rows` rows: each stream's null row (`rows` + its row) starts
with it and is masked until its own prefix's end (`TtsStepper.masked_until`), so a stream
joining a batch in progress speaks as alone too (tests/unit/test_tts_075_rows.py). The
batch's guidance `cfg_coef` is one for all its streams.

Rows share the step's random key: with sampling (temp > 0) a stream's draws depend on its
row and on the other rows, not only on its seed. Each row's audio is decoded by its own
Mimi state (a batch of one), so joins and leaves never disturb another row's audio.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from moshi_mlx.errors import TtsError
from moshi_mlx.models.depformer import ZERO_TOKEN
from moshi_mlx.models.mimi import MimiState
from moshi_mlx.runtime.batch_rows import BatchRows
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.tts.conditions import condition_values, step_conditions
from moshi_mlx.tts.machine import TextSchedule
from moshi_mlx.tts.prefix import AudioPrefixes
from moshi_mlx.tts.stepper import NO_PREFIX, TtsStepper
from moshi_mlx.tts.synthesizer import (
    FINAL_PADDING,
    SKIPPED_FRAMES,
    TtsModel,
    TtsRequest,
    spoken_words,
)
from moshi_mlx.tts.text_feed import TextFeed


@dataclass(frozen=True)
class TtsRowOutput:
    """A busy row's step: `pcm` float32 (1920,) its next 80 ms (None: none to play yet, or
    its audio ended), the text token the model `predicted` and the one `fed` back, the
    `frame` (1 + n_q,) text then codebooks of its frame `max_delay` back (None for its first
    `max_delay` steps), `step` the stream's own step index, and `finished`: its text was
    spoken (remove the row)."""

    row: int
    step: int
    pcm: np.ndarray | None
    predicted: int
    fed: int
    frame: np.ndarray | None
    finished: bool


class _TtsRow:
    """A busy row: its text, its Mimi state, its audio prefix (a batch of one), the step its
    stream is at."""

    def __init__(self, feed: TextFeed, mimi_state: MimiState, prefix: AudioPrefixes):
        self.feed = feed
        self.mimi_state = mimi_state
        self.prefix = prefix
        self.step = 0

    @property
    def text_held(self) -> bool:
        """Whether the row feeds its prefix's "no input" text at its step."""
        return self.prefix.text_held(0, self.step)

    @property
    def schedule(self) -> TextSchedule:
        return self.feed.schedule


class TtsBatch:
    """Up to `rows` TTS streams stepped together; `add` a request to a free row, `push` and
    `close` its text, `step` every busy row, `remove` a row when its stream is done (or
    given up). The sampling, `seed` and `padding_bonus` as `TtsRun`'s (see the module's note
    on sampling)."""

    def __init__(
        self,
        model: TtsModel,
        rows: int,
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        seed: int = 0,
        padding_bonus: float = 0.0,
    ):
        self._busy: BatchRows[_TtsRow] = BatchRows(rows, TtsError)
        self.model = model
        self.rows = rows
        self._sampling = (text_sampling, audio_sampling)
        self._padding_bonus = padding_bonus
        self._seed = seed
        # The rows' stepper, at position 0 when made by the first `add` of an idle batch (it
        # takes its conditions' and voices' shapes from that first row).
        self._stepper: TtsStepper | None = None

    @property
    def busy_rows(self) -> list[int]:
        """The rows that hold a stream, in order."""
        return sorted(self._busy)

    @property
    def free_rows(self) -> int:
        return self.rows - len(self._busy)

    def add(self, request: TtsRequest) -> int:
        """Start `request`'s stream in a free row at the next step; returns the row. Its
        text, if any, is pushed: a string as `push` takes it (`close` when no more comes), a
        list of speaker turns as a whole script (closed)."""
        if not self._busy:
            self._stepper = None  # an idle batch starts again at position 0
        row = self._busy.free_row()
        model, lm = self.model, self.model.lm
        prefix = AudioPrefixes.of([request.prefix], lm.config, model.delay_steps)
        if lm.config.direct_guidance:
            self._write_guided_row(row, request, prefix.length(0))
        else:
            cross = model.voice_keys_values([request.voices])
            condition = lm.condition([condition_values(lm.config, request.cfg_coef)])
            self._write_row(row, condition, cross)
        feed = TextFeed(model.schedule(), model.entries, model.token_ids.main)
        self._busy[row] = _TtsRow(feed, model.mimi.make_state(), prefix)
        if isinstance(request.text, str):
            feed.push(request.text)
        else:
            feed.schedule.push(model.entries(request.text))
            feed.schedule.close()
        return row

    def _write_row(self, row: int, condition: mx.array, cross: list) -> None:
        """The row's conditions and voices in, its stream started at the current position
        (`Stepper.start_row`)."""
        rows, model = self.rows, self.model
        if self._stepper is None:
            self._stepper = TtsStepper(
                model.lm,
                mx.broadcast_to(condition, (rows, *condition.shape[1:])),
                [
                    tuple(mx.broadcast_to(part, (rows, *part.shape[1:])) for part in layer)
                    for layer in cross
                ],
                model.delay_steps,
                *self._sampling,
                self._seed,
                compiled_steps=model.compiled_steps,
                n_q=model.n_q,
                padding_bonus=self._padding_bonus,
            )
        stepper = self._stepper
        if cross[0][0].shape[1:] != stepper.cross[0][0].shape[1:]:
            raise TtsError("every voice of a batch must have the same number of frames")
        selected = mx.arange(rows) == row

        def put(batch: mx.array, one: mx.array) -> mx.array:
            mask = selected.reshape(-1, *([1] * (batch.ndim - 1)))
            return mx.where(mask, one, batch)

        stepper.condition = put(stepper.condition, condition)
        stepper.cross = [(put(k, ck), put(v, cv)) for (k, v), (ck, cv) in zip(stepper.cross, cross)]
        mx.eval(stepper.condition, stepper.cross)
        stepper.start_row(row)

    def _write_guided_row(self, row: int, request: TtsRequest, prefix_frames: int) -> None:
        """With guidance by null rows (`LmConfig.direct_guidance`): the row's null row masked
        until its prefix's end (`step_conditions`), the row and its null row started at the
        current position. The batch's guidance is its first stream's `cfg_coef`; `TtsError`
        (parameter "cfg_coef") for a stream that asks another."""
        model, rows = self.model, self.rows
        conditions = step_conditions(
            model.lm,
            [request.voices],
            [request.cfg_coef],
            [prefix_frames],
            model.delay_steps,
            model.voice_keys_values,
        )
        if self._stepper is None:
            self._stepper = TtsStepper(
                model.lm,
                None,
                None,
                model.delay_steps,
                *self._sampling,
                self._seed,
                compiled_steps=model.compiled_steps,
                n_q=model.n_q,
                padding_bonus=self._padding_bonus,
                masked_until=[NO_PREFIX] * rows,
                cfg_coef=conditions.cfg_coef,
            )
        stepper = self._stepper
        if conditions.cfg_coef != stepper.function.cfg_coef:
            raise TtsError(
                f"the streams of one batch take one cfg_coef: {stepper.function.cfg_coef}, "
                f"not {conditions.cfg_coef}",
                parameter="cfg_coef",
            )
        if stepper.masked_until is not None:
            [until] = conditions.masked_until
            selected = mx.arange(rows) == row
            stepper.masked_until = mx.where(selected, until, stepper.masked_until)
            mx.eval(stepper.masked_until)
        stepper.start_row(row)

    def push(self, row: int, text: str) -> None:
        """More text for `row`'s stream."""
        self._busy.stream(row).feed.push(text)

    def close(self, row: int) -> None:
        """`row`'s text is complete."""
        self._busy.stream(row).feed.close()

    def remove(self, row: int) -> None:
        """Free `row` (its stream ended or was given up); it costs nothing to the others."""
        self._busy.release(row)

    def schedule(self, row: int) -> TextSchedule:
        """`row`'s text schedule (its words' times: `transcript`, `end_step`)."""
        return self._busy.stream(row).schedule

    def words(self, row: int) -> list[tuple[str, float]]:
        """`row`'s words with the time (s) each starts in its audio (`spoken_words`)."""
        busy = self._busy.stream(row)
        return spoken_words(busy.schedule, busy.prefix.length(0))

    def step(self) -> list[TtsRowOutput]:
        """One step of every busy row (nothing when none is busy)."""
        if not self._busy:
            return []
        pad = self.model.token_ids.pad
        if_word, otherwise = [pad] * self.rows, [pad] * self.rows  # idle rows: padding
        for row, busy in self._busy.items():
            if busy.text_held:
                if_word[row] = otherwise[row] = ZERO_TOKEN
            else:
                if_word[row], otherwise[row] = busy.schedule.speculate()
        audio = any(  # the depformer's samples are kept in some row
            busy.step >= self.model.delay_steps
            and not busy.prefix.replaced(busy.step, self.model.codebooks)
            for busy in self._busy.values()
        )
        out = self._stepper.step(if_word, otherwise, self._forced(), depformer=audio)
        decoded = self._queue_decodes(out.frame)
        states = [self._busy[row].mimi_state.state for row in decoded]
        pcm = [samples for samples, _ in decoded.values()]
        mx.eval(out.text, out.frame, pcm, states)  # the step's one wait
        predicted = np.array(out.text).tolist()
        frames = np.array(out.frame)
        return self._row_outputs(predicted, frames, decoded)

    def _forced(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The audio codes and mask (rows, dep_q) of the rows' prefixes at their steps, or
        None when no row forces a codebook now."""
        codes = np.zeros((self.rows, self.model.config.dep_q), np.int32)
        mask = np.zeros(codes.shape, bool)
        for row, busy in self._busy.items():
            if (forced := busy.prefix.forced(busy.step)) is not None:
                codes[row], mask[row] = forced[0][0], forced[1][0]
        return (codes, mask) if mask.any() else None

    def _queue_decodes(self, frame: mx.array) -> dict[int, tuple[mx.array, int]]:
        """Mimi's decoding (lazy) of each busy row's frame of the step just queued (frame
        (rows, 1 + dep_q)), for the rows whose audio has started: row -> (pcm, the frame's
        index in the row's audio)."""
        model, max_delay = self.model, self.model.lm.config.max_delay
        decoded = {}
        for row in self.busy_rows:
            busy = self._busy[row]
            frame_index = busy.step - max_delay  # the audio time of the step's frame
            if busy.step + 1 > max_delay and frame_index >= model.delay_steps:
                codes = frame[row, 1 : 1 + model.codebooks].reshape(1, -1, 1)
                pcm = model.mimi.decode_step(codes.astype(mx.uint32), busy.mimi_state)
                decoded[row] = (pcm, frame_index)
        return decoded

    def _row_outputs(
        self, predicted: list[int], frames: np.ndarray, decoded: dict[int, tuple[mx.array, int]]
    ) -> list[TtsRowOutput]:
        model, max_delay = self.model, self.model.lm.config.max_delay
        codebooks = model.codebooks
        results = []
        for row in self.busy_rows:
            busy = self._busy[row]
            schedule = busy.schedule
            t = busy.step
            fed = ZERO_TOKEN if busy.text_held else schedule.commit(t, predicted[row])
            busy.step += 1
            frame = frames[row, : 1 + codebooks] if busy.step > max_delay else None
            pcm = None
            if row in decoded:
                samples, frame_index = decoded[row]
                played = frame_index - model.delay_steps - SKIPPED_FRAMES
                ended = schedule.end_step is not None and played >= schedule.end_step
                if played >= busy.prefix.length(0) and not ended:  # not the prefix's audio
                    pcm = np.clip(np.array(samples[0, 0], np.float32), -1, 1)
            finished = schedule.done(busy.step, model.delay_steps, FINAL_PADDING)
            results.append(TtsRowOutput(row, t, pcm, predicted[row], fed, frame, finished))
        return results
