"""The embedding API: load Moshi once, then hold conversations 80 ms at a time.

    from moshi_mlx.chat.model import MoshiModel
    from moshi_mlx.runtime.sampling import SamplingConfig

    model = MoshiModel.load()  # kyutai/moshiko-mlx-q4, or local files
    with model.conversation(sampling=SamplingConfig(), seed=42) as conv:
        for mic_frame in frames:  # float32 (1920,) at 24 kHz
            reply = conv.step(mic_frame)  # reply.pcm (1920,), reply.text

There is no global state: a model holds the LM weights and codec instances, a conversation
holds its own streaming state (LM caches, codec state, random key, text decoder).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import mlx.core as mx
import numpy as np

from moshi_mlx.chat.generate import LmGen, LmGenStep
from moshi_mlx.chat.persona.prompts import Prompts
from moshi_mlx.checkpoints.hub import WeightFiles, resolve_weights
from moshi_mlx.checkpoints.io import read_safetensors_header
from moshi_mlx.checkpoints.lm import load_lm
from moshi_mlx.checkpoints.spec import lm_config_of
from moshi_mlx.errors import AudioError, ConfigError, MoshiError, WeightsMismatchError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.models.mimi import MimiConfig
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.codec import FRAME_SIZE, SAMPLE_RATE, Codec, load_codec
from moshi_mlx.runtime.memory_plan import MemoryPlan, check_fits, codec_bytes, plan_memory
from moshi_mlx.runtime.sampling import SamplingConfig
from moshi_mlx.runtime.tokenizer import TextDecoder, load_tokenizer

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
    `end_of_text`: the model sampled its text's end (Hibiki: the translation is over)."""

    pcm: np.ndarray
    text: str
    heard: np.ndarray | None = None
    end_of_text: bool = False


class MoshiModel:
    """Loaded weights of Moshi: the LM, the Mimi codec and the text tokenizer."""

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(
        self,
        lm: Lm,
        files: WeightFiles,
        codec_backend: str = "mlx",
        memory: MemoryPlan | None = None,
        kv_quantization: KVQuantization | None = None,
    ):
        self.lm = lm
        self.memory = memory  # the plan it was loaded under
        self.kv_quantization = kv_quantization  # how conversations store their KV cache
        self.files = files
        self.codec_backend = codec_backend
        _check_codec_fits(lm.cfg)
        self._codec = load_codec(files.mimi, codec_backend, num_codebooks=lm.cfg.moshi_codebooks)
        self.tokenizer = load_tokenizer(files.tokenizer)
        self.prompts = None  # PersonaPlex: its voice and role prompts (`persona.prompts`)
        if lm.cfg.prompted:
            self.prompts = Prompts(lm, self._codec, self.tokenizer, files, kv_quantization)

    @classmethod
    def load(
        cls,
        hf_repo: str | None = None,
        quantize: int | None = None,
        moshi_weight: str | Path | None = None,
        mimi_weight: str | Path | None = None,
        tokenizer: str | Path | None = None,
        lm_config: str | Path | LmConfig | None = None,
        codec_backend: str = "mlx",
        dtype: mx.Dtype | None = None,
        context: int | None = None,
        kv_bits: int | None = None,
        kv_group_size: int | None = None,
        check_memory: bool = True,
    ) -> MoshiModel:
        """Find the weights (local paths, the `weights/` folder, then the Hugging Face hub; see
        `moshi_mlx.checkpoints.hub`) and load them. `quantize` is 4, 8 or 16 (bf16);
        `lm_config` is a Kyutai `config.json` path or an `LmConfig` (default: the repo's
        config, else Moshi 7B). `dtype` is the LM's compute dtype (default: bf16 on a GPU,
        float32 on the CPU; see `moshi_mlx.checkpoints.lm.compute_dtype`). `context` shortens
        the attention window (at most the config's 3000 steps) and `kv_bits` (8 or 4, with
        `kv_group_size`) quantizes the KV cache, both to save memory. Unless
        `check_memory` is False, a model that would not fit in the device's memory raises
        `ConfigError` with what would, before any weight is read (see `memory_plan`).
        """
        files, config = find_model(
            hf_repo, quantize, moshi_weight, mimi_weight, tokenizer, lm_config, context
        )
        kv_quantization = KVQuantization.chosen(kv_bits, kv_group_size)
        plan = memory_plan(files, config, codec_backend, dtype, kv_quantization)
        if check_memory:
            check_fits(plan, config)
        try:
            lm = load_lm(files.moshi, config, dtype=plan.dtype)
        except WeightsMismatchError as exc:
            used = files.lm_config or "the one its file carries or its layout says"
            raise WeightsMismatchError(
                f"{exc}; these LM weights do not fit the LM config ({used}): "
                "pass the config.json that belongs to them as lm_config"
            ) from None
        return cls(lm, files, codec_backend, plan, kv_quantization)

    def conversation(
        self,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
        echo_canceller: EchoCanceller | None = None,
        voice: str | Path | None = None,
        role: str | None = None,
        cfg_coef: float | None = None,
    ) -> Conversation:
        """Start a conversation; several may be open at once (each has its own streams over
        the shared weights). With an `echo_canceller` (`moshi_mlx.audio.echo`), `step` takes
        the far end too and removes its echo from the user's audio.

        PersonaPlex models take who Moshi is: `voice`, a published voice's name (`NATF2`,
        the default), a recording (up to 30 s) or NVIDIA's `.pt`, and `role`, a text
        (default "You enjoy having a good conversation."; `@file` reads a file). The prompt is
        computed on first use and cached (see `moshi_mlx.chat.persona`). Moshi's own models
        take neither. Hibiki takes `cfg_coef`, its guidance (`LmGen`)."""
        self.check_prompt_choice(voice, role)
        start = self.prompts.state(voice, role) if self.prompts is not None else None
        generator = LmGen(self.lm, sampling, seed, self.kv_quantization, start, cfg_coef)
        return Conversation(self, self._codec.fresh(), generator, echo_canceller)

    def check_prompt_choice(self, voice: str | Path | None, role: str | None) -> None:
        """`ConfigError` for a voice or role given to a model without prompts."""
        if self.prompts is None and (voice is not None or role is not None):
            raise ConfigError(
                "voice and role choose PersonaPlex's persona; this model is Moshi, whose "
                "voice and character are in its weights (load nvidia/personaplex-7b-v1)"
            )

    def warm_up(
        self, sampling: SamplingConfig | None = None, cfg_coef: float | None = None
    ) -> None:
        """Run a throwaway conversation of `sampling` for `WARMUP_STEPS` frames of silence, so
        that the first frames of a real one do not pay for compiling the step (whose traces
        are shared by every conversation of this sampling) or for first-use costs. Call it
        on the thread that will run the conversations (MLX keeps compiled code per thread)."""
        silence = np.zeros(self.frame_size, np.float32)
        generator = LmGen(self.lm, sampling, 0, self.kv_quantization, cfg_coef=cfg_coef)
        with Conversation(self, self._codec.fresh(), generator) as conversation:
            for _ in range(WARMUP_STEPS):
                conversation.step(silence)


def find_model(
    hf_repo: str | None = None,
    quantize: int | None = None,
    moshi_weight: str | Path | None = None,
    mimi_weight: str | Path | None = None,
    tokenizer: str | Path | None = None,
    lm_config: str | Path | LmConfig | None = None,
    context: int | None = None,
) -> tuple[WeightFiles, LmConfig]:
    """The files of a model and its LM config, as `MoshiModel.load` finds them."""
    config_path = None if isinstance(lm_config, LmConfig) else lm_config
    files = resolve_weights(hf_repo, quantize, moshi_weight, mimi_weight, tokenizer, config_path)
    config = (
        lm_config if isinstance(lm_config, LmConfig) else lm_config_of(files.moshi, files.lm_config)
    )
    if context is not None:
        if not 1 <= context <= config.context:
            raise ConfigError(
                f"context={context} is out of range: it must be between 1 and {config.context} "
                "steps (the model's attention window)"
            )
        config = replace(config, context=context)
    _check_codec_fits(config)  # before reading gigabytes of weights
    return files, config


def memory_plan(
    files: WeightFiles,
    config: LmConfig,
    codec_backend: str = "mlx",
    dtype: mx.Dtype | None = None,
    kv_quantization: KVQuantization | None = None,
) -> MemoryPlan:
    """What the model of these files would take in memory, from their headers alone;
    `ConfigError` if the KV cache's quantization does not fit the LM's attention heads."""
    if kv_quantization is not None:
        kv_quantization.check_head_dim(config.temporal_config().head_dim)
    layout, metadata = read_safetensors_header(files.moshi)
    codec = codec_bytes(codec_backend, files.mimi, config.moshi_codebooks)
    return plan_memory(
        config, layout, codec, dtype, kv_quantization, lm_metadata=metadata, source=str(files.moshi)
    )


def step_frame(
    generator: LmGen, codec: Codec, pcm: np.ndarray | None
) -> tuple[LmGenStep, mx.array | None]:
    """One frame with one evaluation: the user's pcm (1920,) encoded, the LM step, and
    Moshi's codes decoded (None until the delays are filled) are one lazy graph, evaluated
    with the codec's state; returns the step and Moshi's pcm. pcm None: Hibiki's
    end-of-input frame (every code = card) in place of encoded audio."""
    cfg = generator.lm.cfg
    if pcm is None:
        codes = mx.full((cfg.num_user_codebooks,), cfg.card, mx.int32)
    else:
        codes = codec.encode_step(pcm)
    out = generator.step(codes)
    reply = None
    if out.moshi_codes_array is not None:
        reply = codec.decode_step(out.moshi_codes_array)
    mx.eval(out.text_token_array, out.moshi_codes_array, reply, codec.state)
    return out, reply


def _check_codec_fits(cfg: LmConfig) -> None:
    """Raise `ConfigError` unless the LM's audio streams match Mimi's codebooks."""
    if cfg.num_user_codebooks != cfg.moshi_codebooks:
        raise ConfigError(
            f"the LM config has {cfg.moshi_codebooks} Moshi and {cfg.num_user_codebooks} user "
            "codebooks; "
            "the codec needs the same number of both"
        )
    codec_card = MimiConfig.moshi().quantizer.bins
    if cfg.card != codec_card:
        raise ConfigError(
            f"the LM config has {cfg.card} audio tokens per codebook but Mimi has "
            f"{codec_card}: the LM weights or lm_config do not belong to Moshi"
        )


class Conversation:
    """A full-duplex stream: 80 ms of the user's audio in, 80 ms of Moshi's audio out.

    Until the LM's delays fill (the first steps), Moshi's audio is silence of full length, so
    a live stream keeps its cadence. Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        model: MoshiModel,
        codec: Codec,
        generator: LmGen,
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
        """Feed one frame of the user's audio (1920,) float32 at 24 kHz; get Moshi's frame.

        With an echo canceller, `far` is what the speaker played while `pcm` was recorded
        (1920 samples; None: silence). It may lead its echo in `pcm` by up to a few hundred
        ms, never trail it: pass the audio that was sounding, not what you queue next.
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
        if self._closed:
            raise MoshiError("this conversation is closed; start a new one")
        return self._result(None, None)

    def _result(self, pcm: np.ndarray | None, heard: np.ndarray | None) -> StepResult:
        out, reply = step_frame(self._generator, self._codec, pcm)
        token = out.text_token
        text = self._text.decode(token)
        pcm_out = self._silence.copy() if reply is None else np.array(reply)
        return StepResult(pcm_out, text, heard, token == self._model.tokenizer.eos_id())

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
