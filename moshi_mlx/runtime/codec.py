"""One streaming codec interface over two Mimi backends: our MLX model and `rustymimi`.

Both take and return one 80 ms frame at a time:
`encode_step(pcm (1920,) float32) -> codes (num_codebooks,) int32` and back, as `mx.array`s
that may be lazy: the caller evaluates a step's outputs together with the codec's `state` (one
host synchronisation for the whole frame, see `Conversation.step`). `rustymimi`
(Kyutai's Rust Mimi, `pip install moshi_mlx[rustymimi]`) runs on the CPU and keeps the codec
off the GPU; it reads the same published checkpoint file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

import mlx.core as mx
import numpy as np

from moshi_mlx.audio import FRAME_SIZE, SAMPLE_RATE
from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.errors import AudioError, MoshiError, WeightsError
from moshi_mlx.models.mimi import Mimi, MimiState
from moshi_mlx.modules.streaming import state_arrays

BACKENDS = ("mlx", "rustymimi")


@runtime_checkable
class Codec(Protocol):
    """A streaming audio codec: one frame of PCM <-> one frame of codes."""

    sample_rate: int
    frame_size: int
    num_codebooks: int

    def encode_step(self, pcm: np.ndarray | mx.array) -> mx.array:
        """pcm (frame_size,) float32 -> codes (num_codebooks,) int32, possibly lazy."""
        ...

    def decode_step(self, codes: np.ndarray | mx.array) -> mx.array:
        """codes (num_codebooks,) integers -> pcm (frame_size,) float32, possibly lazy."""
        ...

    @property
    def state(self) -> list[mx.array]:
        """Streaming buffers to evaluate together with a step's outputs."""
        ...

    def reset(self) -> None:
        """Start a new stream in both directions."""
        ...

    def fresh(self) -> Codec:
        """Another codec over the same weights, with a stream of its own."""
        ...

    def batch_encoder(self, streams: int) -> BatchEncoder:
        """An encoder of `streams` new streams stepping together, over the same weights."""
        ...


@runtime_checkable
class BatchEncoder(Protocol):
    """Streaming encoding of B streams at once: one frame of each stream per step."""

    streams: int

    def encode_frames(self, pcm: np.ndarray | mx.array) -> mx.array:
        """pcm (streams, frame_size) float32 -> codes (streams, num_codebooks) int32, possibly
        lazy."""
        ...

    @property
    def state(self) -> list[mx.array]:
        """Streaming buffers to evaluate together with a step's outputs."""
        ...


def _check_pcm(pcm: np.ndarray | mx.array) -> None:
    if tuple(pcm.shape) != (FRAME_SIZE,):
        raise AudioError(
            f"expected one frame of pcm, shape ({FRAME_SIZE},), got {tuple(pcm.shape)}"
        )


def _check_frames(pcm: np.ndarray | mx.array, streams: int) -> None:
    if tuple(pcm.shape) != (streams, FRAME_SIZE):
        raise AudioError(
            f"expected one frame of pcm per stream, shape ({streams}, {FRAME_SIZE}), "
            f"got {tuple(pcm.shape)}"
        )


def _check_codes(codes: np.ndarray | mx.array, num_codebooks: int) -> None:
    if tuple(codes.shape) != (num_codebooks,):
        raise AudioError(f"expected codes of shape ({num_codebooks},), got {tuple(codes.shape)}")


class MlxCodec:
    """Our MLX Mimi behind the `Codec` interface; the stream's state (`stream`, a
    `StreamingState`) is the codec's own."""

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(self, model: Mimi):
        self.model = model
        self.num_codebooks = model.num_codebooks
        self.stream: MimiState = model.make_state()

    def encode_step(self, pcm: np.ndarray | mx.array) -> mx.array:
        _check_pcm(pcm)
        frame = mx.array(pcm, dtype=mx.float32)
        codes = self.model.encode_step(frame[None, None, :], self.stream)
        return codes[0, :, 0].astype(mx.int32)

    def decode_step(self, codes: np.ndarray | mx.array) -> mx.array:
        _check_codes(codes, self.num_codebooks)
        codes = mx.array(codes, dtype=mx.uint32)
        return self.model.decode_step(codes[None, :, None], self.stream)[0, 0]

    @property
    def state(self) -> list[mx.array]:
        return state_arrays(self.stream)

    def reset(self) -> None:
        self.stream.reset()

    def fresh(self) -> MlxCodec:
        return MlxCodec(self.model)

    def batch_encoder(self, streams: int) -> MlxBatchEncoder:
        return MlxBatchEncoder(self.model, streams)


class MlxBatchEncoder:
    """B streams through our MLX Mimi as one batch: one state with a row per stream, so each
    layer's weights are read once per step for all of them."""

    def __init__(self, model: Mimi, streams: int):
        self.model = model
        self.streams = streams
        self.stream: MimiState = model.make_state()  # a row per stream

    def encode_frames(self, pcm: np.ndarray | mx.array) -> mx.array:
        _check_frames(pcm, self.streams)
        frames = mx.array(pcm, dtype=mx.float32)
        return self.model.encode_step(frames[:, None, :], self.stream)[:, :, 0].astype(mx.int32)

    @property
    def state(self) -> list[mx.array]:
        return state_arrays(self.stream)


class RustyMimiCodec:
    """Kyutai's Rust Mimi (`rustymimi.Tokenizer`) behind the `Codec` interface."""

    sample_rate = SAMPLE_RATE
    frame_size = FRAME_SIZE

    def __init__(self, weight_path: str | Path, num_codebooks: int = 8, _tokenizer=None):
        try:
            import rustymimi
        except ImportError:
            raise MoshiError(
                "the rustymimi codec backend is not installed: "
                "pip install 'moshi_mlx[rustymimi]', or use backend='mlx'"
            ) from None
        self._rustymimi = rustymimi
        self.weight_path = str(weight_path)
        self.num_codebooks = num_codebooks
        self._tokenizer = _tokenizer or self._open()
        self._stepped = False  # a tokenizer that never ran can serve a fresh stream

    def _open(self):
        try:
            return self._rustymimi.Tokenizer(self.weight_path, num_codebooks=self.num_codebooks)
        except (ValueError, RuntimeError, OSError) as exc:  # what rustymimi raises
            reason = str(exc).splitlines()[0]  # drop the Rust backtrace
            raise WeightsError(f"rustymimi cannot load {self.weight_path}: {reason}") from None

    def _running(self):
        if self._tokenizer is None:  # handed to a fresh stream by `fresh`
            self._tokenizer = self._open()
        self._stepped = True
        return self._tokenizer

    # rustymimi computes on the host: its inputs are brought there (a synchronisation when
    # they are lazy) and its outputs are ready at once.
    def encode_step(self, pcm: np.ndarray | mx.array) -> mx.array:
        _check_pcm(pcm)
        frame = np.asarray(pcm, dtype=np.float32)
        codes = self._running().encode_step(frame[None, None, :])
        return mx.array(np.asarray(codes, dtype=np.int32).reshape(self.num_codebooks))

    def decode_step(self, codes: np.ndarray | mx.array) -> mx.array:
        _check_codes(codes, self.num_codebooks)
        codes = np.asarray(codes, dtype=np.uint32)
        pcm = self._running().decode_step(codes[None, :, None])
        return mx.array(np.asarray(pcm, dtype=np.float32).reshape(self.frame_size))

    @property
    def state(self) -> list[mx.array]:
        return []  # kept inside rustymimi

    def reset(self) -> None:
        # rustymimi 0.4's Tokenizer.reset() leaves part of the encoder's state (the first frame
        # after it encodes differently from a fresh stream), so open the file again (~1 s).
        if self._stepped:
            self._tokenizer, self._stepped = self._open(), False

    def fresh(self) -> RustyMimiCodec:
        """A new stream; it takes over this codec's tokenizer if that never ran (opening the
        file again takes about a second)."""
        unused = None
        if not self._stepped:
            unused, self._tokenizer = self._tokenizer, None
        return RustyMimiCodec(self.weight_path, self.num_codebooks, _tokenizer=unused)

    def batch_encoder(self, streams: int) -> StreamwiseEncoder:
        return StreamwiseEncoder([self.fresh() for _ in range(streams)])


class StreamwiseEncoder:
    """B streams encoded one after another by codecs of their own (rustymimi steps one
    stream per call)."""

    def __init__(self, codecs: list[Codec]):
        self.codecs = codecs
        self.streams = len(codecs)

    def encode_frames(self, pcm: np.ndarray | mx.array) -> mx.array:
        _check_frames(pcm, self.streams)
        return mx.stack([codec.encode_step(frame) for codec, frame in zip(self.codecs, pcm)])

    @property
    def state(self) -> list[mx.array]:
        return [array for codec in self.codecs for array in codec.state]


def load_codec(weight_path: str | Path, backend: str = "mlx", num_codebooks: int = 8) -> Codec:
    """Open the Mimi checkpoint at `weight_path` with the named backend ("mlx" or "rustymimi")."""
    if backend == "mlx":
        return MlxCodec(load_mimi(weight_path, num_codebooks=num_codebooks))
    if backend == "rustymimi":
        if not Path(weight_path).is_file():
            raise WeightsError(f"weights file not found: {weight_path}")
        return RustyMimiCodec(weight_path, num_codebooks)
    raise MoshiError(f"unknown codec backend {backend!r}; choose one of {', '.join(BACKENDS)}")
