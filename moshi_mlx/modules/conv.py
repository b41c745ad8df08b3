"""Causal 1-d convolutions and transposed convolutions that stream, channels-last.

Each layer is stateless; its streaming state is a `ConvState` / `ConvTransposeState` the caller
owns (a `StreamingState`). A batch call is a streaming call on a fresh state, so both give the same numbers.
"""

from __future__ import annotations

from typing import Literal

import mlx.core as mx
from mlx import nn

from moshi_mlx.modules.streaming import BaseState


class ConvState(BaseState):
    """The last `context` input steps of a causal conv (None before the first step)."""

    def __init__(self) -> None:
        self.previous: mx.array | None = None  # (B, context, C_in)

    def reset(self) -> None:
        self.previous = None

    @property
    def state(self) -> list[mx.array]:
        """The arrays a caller evaluates with a step's outputs."""
        return [] if self.previous is None else [self.previous]

    @state.setter
    def state(self, state: list[mx.array]) -> None:
        self.previous = state[0] if state else None


class ConvTransposeState(BaseState):
    """The overlapping tail a transposed conv has produced but not emitted yet."""

    def __init__(self) -> None:
        self.partial: mx.array | None = None  # (B, overlap_frames, stride, C_out), no bias

    def reset(self) -> None:
        self.partial = None

    @property
    def state(self) -> list[mx.array]:
        """The arrays a caller evaluates with a step's outputs."""
        return [] if self.partial is None else [self.partial]

    @state.setter
    def state(self, state: list[mx.array]) -> None:
        self.partial = state[0] if state else None


class Conv1d(nn.Module):
    """Causal conv: left-padded with its context (zeros, or the first sample repeated).

    weight: (kernel, C_in, C_out). Input (B, T, C_in) with T a multiple of the stride; output
    (B, T // stride, C_out). Computed as one matmul of the gathered input windows with the
    weight, stored input-major so the CPU matmul streams it contiguously (faster than
    `mx.conv1d` or an output-major weight on a CPU without a tuned BLAS; docs/performance.md).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        dilation: int = 1,
        bias: bool = True,
        pad_mode: Literal["constant", "replicate"] = "constant",
    ):
        super().__init__()
        scale = (in_channels * kernel_size) ** -0.5
        self.weight = mx.random.uniform(-scale, scale, (kernel_size, in_channels, out_channels))
        if bias:
            self.bias = mx.zeros((out_channels,))
        self.has_bias = bias
        self.kernel_size = kernel_size
        self.stride = stride
        self.dilation = dilation
        self.pad_mode = pad_mode
        self.context = (kernel_size - 1) * dilation + 1 - stride

    def _windows(self, x: mx.array) -> mx.array:
        """(B, context + T, C) -> (B, T // stride, kernel * C): each output's input window."""
        batch, length, channels = x.shape
        kernel, stride = self.kernel_size, self.stride
        if kernel == 2 * stride and self.dilation == 1:
            # Downsampling convs: windows are pairs of consecutive stride-long blocks.
            blocks = x.reshape(batch, length // stride, stride * channels)
            return mx.concatenate([blocks[:, :-1], blocks[:, 1:]], axis=-1)
        steps = (length - self.context - 1) // stride + 1
        span = (steps - 1) * stride + 1
        taps = [x[:, j * self.dilation : j * self.dilation + span : stride] for j in range(kernel)]
        return taps[0] if kernel == 1 else mx.concatenate(taps, axis=-1)

    def __call__(self, x: mx.array, state: ConvState) -> mx.array:
        if self.context > 0:
            previous = state.previous
            if previous is None:
                batch, _, channels = x.shape
                shape = (batch, self.context, channels)
                if self.pad_mode == "replicate":
                    previous = mx.broadcast_to(x[:, :1], shape)
                else:
                    previous = mx.zeros(shape, x.dtype)
            x = mx.concatenate([previous, x], axis=1)
            state.previous = x[:, -self.context :]
        y = self._windows(x) @ self.weight.reshape(-1, self.weight.shape[-1])
        return y + self.bias if self.has_bias else y


class ConvTranspose1d(nn.Module):
    """Causal transposed conv (kernel a multiple of the stride), as a matmul plus overlap-add.

    Each input step produces `kernel` output samples; those beyond the current `stride` overlap
    the next steps and are kept in the state. weight: (C_in, kernel, C_out), or (kernel, C) for
    a depthwise layer (groups == channels). Input (B, T, C_in), output (B, T * stride, C_out).
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int,
        groups: int = 1,
        bias: bool = True,
    ):
        super().__init__()
        if kernel_size % stride != 0:
            raise ValueError(f"kernel {kernel_size} is not a multiple of the stride {stride}")
        if groups not in (1, in_channels) or (groups > 1 and in_channels != out_channels):
            raise ValueError("only dense or depthwise transposed convs are supported")
        self.depthwise = groups > 1
        scale = (out_channels // groups * kernel_size) ** -0.5
        shape = (
            (kernel_size, out_channels)
            if self.depthwise
            else (in_channels, kernel_size, out_channels)
        )
        self.weight = mx.random.uniform(-scale, scale, shape)
        if bias:
            self.bias = mx.zeros((out_channels,))
        self.has_bias = bias
        self.stride = stride
        self.kernel_size = kernel_size
        self.out_channels = out_channels

    def __call__(self, x: mx.array, state: ConvTransposeState) -> mx.array:
        batch, steps, _ = x.shape
        chunks = self.kernel_size // self.stride
        if self.depthwise:
            y = x[:, :, None, :] * self.weight  # (B, T, kernel, C)
        else:
            y = x @ self.weight.reshape(self.weight.shape[0], -1)  # (B, T, kernel * C_out)
        y = y.reshape(batch, steps, chunks, self.stride, self.out_channels)
        # Chunk j of step t lands on output step t + j.
        frames = y[:, :, 0]
        if chunks > 1:
            frames = mx.pad(frames, [(0, 0), (0, chunks - 1), (0, 0), (0, 0)])
            for j in range(1, chunks):
                pad = [(0, 0), (j, chunks - 1 - j), (0, 0), (0, 0)]
                frames = frames + mx.pad(y[:, :, j], pad)
            if state.partial is not None:
                overlap = frames[:, : chunks - 1] + state.partial
                frames = mx.concatenate([overlap, frames[:, chunks - 1 :]], axis=1)
            state.partial = frames[:, steps:]
            frames = frames[:, :steps]
        out = frames.reshape(batch, steps * self.stride, self.out_channels)
        return out + self.bias if self.has_bias else out
