"""Conditions: Kyutai's lookup-table ("lut") and tensor conditioners, and how they are fused.

Hibiki has one table, "description", whose values ("very_bad" ... "very_good") say how good a
translation to produce. The TTS has two tables summed into every step's input, "cfg" (the
guidance strength it was distilled for, "1.0" ... "4.0") and "control" ("ok"), and one tensor,
"speaker_wavs": up to 5 voices' embeddings, attended to by the temporal transformer's
cross-attention layers. A table maps a value to a learned vector, projected to the model's
width; a tensor's vectors are projected likewise. An absent value (None) or a masked-out
position takes the conditioner's learned padding vector. Parameter names equal Kyutai's
(`condition_provider.conditioners.{name}.{embed, output_proj, learnt_padding}`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
from mlx import nn

from moshi_mlx.errors import ConfigError
from moshi_mlx.models.condition_config import Fuser, LutConditioner, TensorConditioner
from moshi_mlx.modules.linear import Linear

# Hibiki's conditions under classifier-free guidance: the guided half, then the "null" half
# (Kyutai's PyTorch `run_inference.get_condition_tensors`).
GUIDED_CONDITION = {"description": "very_good"}
NULL_CONDITION = {"description": "very_bad"}


class LutTable(nn.Module):
    """One "lut" conditioner: a value -> its table row (spec.dim), projected to `out_dim`."""

    def __init__(self, spec: LutConditioner, out_dim: int):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.n_bins + 1, spec.dim)  # the last row: no value
        self.output_proj = Linear(spec.dim, out_dim, bias=False)
        self.learnt_padding = mx.zeros((1, 1, out_dim))

    def index(self, value: str) -> int:
        """The table row of `value`; `ConfigError` naming the allowed values if unknown."""
        if value not in self.spec.possible_values:
            allowed = ", ".join(self.spec.possible_values)
            raise ConfigError(
                f"condition {self.spec.name!r} cannot be {value!r}: use one of {allowed}"
            )
        return self.spec.possible_values.index(value)

    def vectors(self, values: Sequence[str | None]) -> mx.array:
        """Each row's value (None: absent, the learned padding) -> vectors (B, out_dim)."""
        indices = mx.array([0 if v is None else self.index(v) for v in values])
        given = mx.array([v is not None for v in values])[:, None]
        return mx.where(given, self.output_proj(self.embed(indices)), self.learnt_padding[0])


class TensorTable(nn.Module):
    """One "tensor" conditioner: vectors (B, T, spec.dim) -> (B, T, out_dim), masked
    positions replaced by the learned padding."""

    def __init__(self, spec: TensorConditioner, out_dim: int):
        super().__init__()
        self.spec = spec
        self.output_proj = Linear(spec.dim, out_dim, bias=False)
        self.learnt_padding = mx.zeros((1, 1, out_dim))

    def __call__(self, tensor: mx.array, mask: mx.array) -> mx.array:
        """tensor (B, T, dim), mask (B, T) bool -> (B, T, out_dim)."""
        # The compute dtype: a quantized projection's weight is packed uint32, so not its dtype.
        projected = self.output_proj(tensor.astype(self.learnt_padding.dtype))
        return mx.where(mask[..., None], projected, self.learnt_padding)


def sinusoids(length: int, dim: int, max_period: float = 10_000.0) -> mx.array:
    """Kyutai's sinusoidal position embedding of positions 0..length-1: (length, dim), the
    cosines of dim / 2 frequencies, then their sines."""
    half = dim // 2
    positions = mx.arange(length, dtype=mx.float32)[:, None]
    frequencies = mx.arange(half, dtype=mx.float32)[None] / (half - 1)
    phase = positions / mx.power(mx.array(max_period, mx.float32), frequencies)
    return mx.concatenate([mx.cos(phase), mx.sin(phase)], axis=-1)


class ConditionProvider(nn.Module):
    """The model's conditioners by name: `sum` gives the vector added to each step's input,
    `cross_source` the sequence the cross-attention layers attend to."""

    def __init__(
        self,
        specs: Sequence[LutConditioner | TensorConditioner],
        fuser: Fuser,
        out_dim: int,
    ):
        super().__init__()
        self.fuser = fuser
        self.conditioners = {
            spec.name: LutTable(spec, out_dim)
            if isinstance(spec, LutConditioner)
            else TensorTable(spec, out_dim)
            for spec in specs
        }

    def sum(self, conditions: Sequence[Mapping[str, str | None]]) -> mx.array:
        """The summed condition vector of each batch row's values (name -> value, None for
        absent): (B, dim). Every summed conditioner needs an entry; `ConfigError` for a
        missing name, an unknown name or an unknown value."""
        names = sorted(self.fuser.sum)
        for values in conditions:
            if sorted(values) != names:
                raise ConfigError(
                    f"conditions {sorted(values)} do not match the model's conditioners {names}"
                )
        total = None
        for name in self.fuser.sum:
            vectors = self.conditioners[name].vectors([values[name] for values in conditions])
            total = vectors if total is None else total + vectors
        return total

    def cross_source(self, tensors: Mapping[str, tuple[mx.array, mx.array]]) -> mx.array:
        """The cross-attended sequence (B, T, dim) of each cross conditioner's (tensor, mask)
        ((B, T_c, spec.dim), (B, T_c) bool), concatenated in the fuser's order."""
        if sorted(tensors) != sorted(self.fuser.cross):
            raise ConfigError(
                f"tensor conditions {sorted(tensors)} do not match the model's {list(self.fuser.cross)}"
            )
        parts = [self.conditioners[name](*tensors[name]) for name in self.fuser.cross]
        source = mx.concatenate(parts, axis=1)
        if self.fuser.cross_pos_emb:
            positions = sinusoids(source.shape[1], source.shape[2]).astype(source.dtype)
            source = source + self.fuser.cross_pos_emb_scale * positions
        return source
