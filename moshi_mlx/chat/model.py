"""The embedding API: load Moshi once, then hold conversations 80 ms at a time.

    from moshi_mlx.chat.model import MoshiModel
    from moshi_mlx.runtime.sampling import Sampling

    model = MoshiModel.load()  # kyutai/moshiko-mlx-q4, or local files
    with model.conversation(text_sampling=Sampling(0.7, 25), seed=42) as conv:
        for mic_frame in frames:  # float32 (1920,) at 24 kHz
            reply = conv.step(mic_frame)  # reply.pcm (1920,), reply.text

There is no global state: a model holds the LM weights and codec instances, a conversation
holds its own streaming state (LM caches, codec state, random key, text decoder).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np
import sentencepiece

from moshi_mlx.chat.generate import ChatStepFunction, ChatStepper
from moshi_mlx.chat.persona.prompts import Prompts
from moshi_mlx.checkpoints.hub import WeightFiles
from moshi_mlx.errors import AudioError, ConfigError, MoshiError
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE, Codec
from moshi_mlx.runtime.loading import (
    LoadedParts,
    LoadOptions,
    check_codec_fits,
    load_parts,
)
from moshi_mlx.runtime.memory_plan import MemoryPlan
from moshi_mlx.runtime.model_memo import ModelMemo
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.runtime.step_state import StepOutput
from moshi_mlx.runtime.tokenizer import TextDecoder

if TYPE_CHECKING:
    from typing_extensions import Self

    from moshi_mlx.audio.echo import EchoCanceller


# Frames of a warm-up: enough for the codebook delays to fill and Mimi to decode, so that
# every kernel of a step has run once.
WARMUP_STEPS = 4


@dataclass(frozen=True)
class StepResult:
    """One 80 ms step of a conversation: Moshi's audio (1920,) float32 and its new text;
    with an echo canceller, also the user's audio as Moshi heard it (after cancellation).
    `end_of_text`: the model sampled its text's end (Hibiki: the translation is over).

    The step's tokens (None only in results made by hand): `text_token`, the text token
    Moshi wrote (ids 0 and 3: padding); `moshi_codes` (moshi_codebooks,) int32, the codes of
    Moshi's audio frame, None until the delays are filled; `input_tokens` (num_codebooks,)
    int32, what the step fed the LM (text, Moshi's codebooks, the user's; delays applied)."""

    pcm: np.ndarray
    text: str
    heard: np.ndarray | None = None
    end_of_text: bool = False
    text_token: int | None = None
    moshi_codes: np.ndarray | None = None
    input_tokens: np.ndarray | None = None


class MoshiModel:
    """Loaded weights of Moshi: the LM, the Mimi codec and the text tokenizer."""

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(
        self,
        lm: Lm,
        codec: Codec,
        tokenizer: sentencepiece.SentencePieceProcessor,
        files: WeightFiles,
        codec_backend: str = "mlx",
        memory: MemoryPlan | None = None,
        kv_quantization: KVQuantization | None = None,
    ):
        """A chat model of built parts (it loads nothing: `load`, or `from_parts` of what
        `moshi_mlx.runtime.loading.load_parts` loaded)."""
        self.lm = lm
        # The compiled steps its conversations share, per sampling, KV layout and guidance.
        self.compiled_steps: ModelMemo[ChatStepFunction] = ModelMemo(lm)
        self.memory = memory  # the plan it was loaded under
        self.kv_quantization = kv_quantization  # how conversations store their KV cache
        self.files = files
        self.codec_backend = codec_backend
        check_codec_fits(lm.config)
        self._codec = codec
        self.tokenizer = tokenizer
        self.prompts = None  # PersonaPlex: its voice and role prompts (`persona.prompts`)
        if lm.config.prompted:
            self.prompts = Prompts(lm, self._codec, self.tokenizer, files, kv_quantization)

    @classmethod
    def load(cls, hf_repo: str | None = None, **options: object) -> MoshiModel:
        """Load a chat model (Moshi, PersonaPlex, Hibiki).

        Args:
            hf_repo: a hub repo id or a local folder laid out like one (default
                kyutai/moshiko-mlx-q4); None with the files given in `options`.
            **options: the fields of `moshi_mlx.runtime.loading.LoadOptions`, by name.

        Returns:
            The loaded `MoshiModel`. Unless `check_memory` is False, a model that would not
            fit in the device's memory raises `ConfigError` saying what would, before any
            weight is read.
        """
        chosen = LoadOptions.named(**options)
        return cls.from_parts(load_parts(hf_repo, chosen, "chat"), chosen.codec_backend)

    @classmethod
    def from_parts(cls, parts: LoadedParts, codec_backend: str = "mlx") -> MoshiModel:
        """The model of what `moshi_mlx.runtime.loading.load_parts` loaded."""
        return cls(
            parts.lm,
            parts.codec,
            parts.tokenizer,
            parts.files,
            codec_backend,
            parts.memory,
            parts.kv_quantization,
        )

    def conversation(
        self,
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        seed: int | None = None,
        echo_canceller: EchoCanceller | None = None,
        voice: str | Path | None = None,
        role: str | None = None,
        cfg_coef: float | None = None,
    ) -> Conversation:
        """Start a conversation; several may be open at once (each has its own streams over
        the shared weights).

        Args:
            text_sampling: how the text is drawn (default Kyutai's,
                `moshi_mlx.chat.generate.TEXT_SAMPLING`).
            audio_sampling: how Moshi's audio is drawn (default `AUDIO_SAMPLING`).
            seed: the conversation's random stream (None: drawn at random).
            echo_canceller: with one (`moshi_mlx.audio.echo`), `step` takes the far end too
                and removes its echo from the user's audio.
            voice: PersonaPlex only: a published voice's name (`NATF2`, the default), a
                recording (up to 30 s) or NVIDIA's `.pt`.
            role: PersonaPlex only: who Moshi is, as text (default "You enjoy having a good
                conversation."; `@file` reads a file). The persona's prompt is computed on
                first use and cached (`moshi_mlx.chat.persona`).
            cfg_coef: Hibiki only: its classifier-free guidance (None: the model's config).

        Returns:
            A `Conversation`, to `step` one 80 ms frame at a time and `close`.
        """
        self.check_prompt_choice(voice, role)
        start = self.prompts.state(voice, role) if self.prompts is not None else None
        generator = ChatStepper(
            self.lm,
            text_sampling,
            audio_sampling,
            seed,
            self.kv_quantization,
            start,
            cfg_coef,
            compiled_steps=self.compiled_steps,
        )
        return Conversation(self, self._codec.fresh(), generator, echo_canceller)

    def check_prompt_choice(self, voice: str | Path | None, role: str | None) -> None:
        """`ConfigError` for a voice or role given to a model without prompts."""
        if self.prompts is None and (voice is not None or role is not None):
            raise ConfigError(
                "voice and role choose PersonaPlex's persona; this model is Moshi, whose "
                "voice and character are in its weights (load nvidia/personaplex-7b-v1)"
            )

    def warm_up(
        self,
        text_sampling: Sampling | None = None,
        audio_sampling: Sampling | None = None,
        cfg_coef: float | None = None,
    ) -> None:
        """Run a throwaway conversation of this sampling for `WARMUP_STEPS` frames of silence, so
        that the first frames of a real one do not pay for compiling the step (whose traces
        are shared by every conversation of this sampling) or for first-use costs. Call it
        on the thread that will run the conversations (MLX keeps compiled code per thread)."""
        silence = np.zeros(self.frame_size, np.float32)
        generator = ChatStepper(
            self.lm,
            text_sampling,
            audio_sampling,
            0,
            self.kv_quantization,
            cfg_coef=cfg_coef,
            compiled_steps=self.compiled_steps,
        )
        with Conversation(self, self._codec.fresh(), generator) as conversation:
            for _ in range(WARMUP_STEPS):
                conversation.step(silence)


def step_frame(
    generator: ChatStepper, codec: Codec, pcm: np.ndarray | None, codes: mx.array | None = None
) -> tuple[StepOutput, mx.array | None]:
    """One frame with one evaluation: the user's pcm (1920,) encoded (pcm None: the user's
    `codes` (num_user_codebooks,) as given, nothing encoded), the LM step, and Moshi's codes
    decoded (None until the delays are filled) are one lazy graph, evaluated with the codec's
    state (the step's inputs too); returns the step and Moshi's pcm."""
    if pcm is not None:
        codes = codec.encode_step(pcm)
    out = generator.step(codes)
    reply = None if out.frame is None else codec.decode_step(out.frame)
    mx.eval(out.text, out.frame, out.inputs, reply, codec.state)
    return out, reply


class Conversation:
    """A full-duplex stream: 80 ms of the user's audio in, 80 ms of Moshi's audio out.

    Until the LM's delays fill (the first steps), Moshi's audio is silence of full length, so
    a live stream keeps its cadence. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        model: MoshiModel,
        codec: Codec,
        generator: ChatStepper,
        echo_canceller: EchoCanceller | None = None,
    ):
        self._model = model
        self.echo_canceller = echo_canceller
        self._codec = codec
        self._generator = generator
        self._text = TextDecoder(model.tokenizer)
        self._silence = np.zeros(model.frame_size, dtype=np.float32)
        self._closed = False

    @property
    def seed(self) -> int:
        """The seed of this conversation's random stream (drawn at random if none was given)."""
        return self._generator.seed

    def step(self, pcm: np.ndarray, far: np.ndarray | None = None) -> StepResult:
        """Feed one frame of the user's audio; get Moshi's frame.

        Args:
            pcm: the user's audio, (1920,) float32 at 24 kHz.
            far: with an echo canceller, what the speaker played while `pcm` was recorded
                (1920 samples; None: silence). It may lead its echo in `pcm` by up to a few
                hundred ms, never trail it: pass the audio that was sounding, not what you
                queue next.

        Returns:
            A `StepResult`: Moshi's audio (silence until the delays fill) and new text.
        """
        if self._closed:
            raise MoshiError("this conversation is closed; start a new one")
        pcm = np.asarray(pcm, dtype=np.float32)
        if pcm.shape != (self._model.frame_size,):
            raise AudioError(
                f"Conversation.step takes {self._model.frame_size} samples (80 ms at "
                f"{self._model.sample_rate} Hz), got an array of shape {pcm.shape}"
            )
        heard = None
        if self.echo_canceller is not None:
            far = self._silence if far is None else np.asarray(far, dtype=np.float32)
            if far.shape != pcm.shape:
                raise AudioError(
                    f"Conversation.step takes a far end of {pcm.shape[0]} samples, like the "
                    f"user's audio; got an array of shape {far.shape}"
                )
            pcm = heard = self.echo_canceller.process(pcm, far)
        return self._result(pcm, heard)

    def end_of_input(self) -> StepResult:
        """Hibiki: tell the model the source speech is over (its end-of-input frame); feed
        silence afterwards until `StepResult.end_of_text`."""
        return self._user_codes(self._model.lm.config.card)

    def step_without_input(self) -> StepResult:
        """Hibiki: a step in which the model hears nothing (user codes -1: no input) and no
        audio is encoded: a translation's first step, whose input the model never reads (the
        delays' initial tokens stand in), without spending a frame of the source on it."""
        return self._user_codes(-1)

    def _user_codes(self, code: int) -> StepResult:
        if self._closed:
            raise MoshiError("this conversation is closed; start a new one")
        codes = mx.full((self._model.lm.config.num_user_codebooks,), code, mx.int32)
        return self._result(None, None, codes)

    def _result(
        self, pcm: np.ndarray | None, heard: np.ndarray | None, codes: mx.array | None = None
    ) -> StepResult:
        out, reply = step_frame(self._generator, self._codec, pcm, codes)
        token = out.text.item()
        text = self._text.decode(token)
        pcm_out = self._silence.copy() if reply is None else np.array(reply)
        return StepResult(
            pcm_out,
            text,
            heard,
            token == self._model.tokenizer.eos_id(),
            token,
            None if out.frame is None else np.array(out.frame, dtype=np.int32),
            np.array(out.inputs, dtype=np.int32),
        )

    def reset(self) -> None:
        """Start over: empty LM caches, codec state and text; the seed's random stream restarts."""
        self._generator.reset()
        self._codec.reset()
        self._text.reset()
        if self.echo_canceller is not None:
            self.echo_canceller.reset()

    def close(self) -> None:
        """End the conversation: its streams are dropped and it cannot be used afterwards."""
        self._closed = True

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
