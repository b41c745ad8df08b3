"""Conditions summed into every step's input: Kyutai's lookup-table ("lut") conditioners.

Hibiki has one, "description", whose values ("very_bad" ... "very_good") say how good a
translation to produce: each value is a learned vector, projected to the model's width and
added to the input embedding of every step. Parameter names equal Kyutai's
(`condition_provider.conditioners.{name}.{embed, output_proj, learnt_padding}`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import mlx.core as mx
from mlx import nn

from moshi_mlx.errors import ConfigError
from moshi_mlx.models.config import LutConditioner

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
        self.output_proj = nn.Linear(spec.dim, out_dim, bias=False)
        # Stands in for an absent value in training; inference always gives one.
        self.learnt_padding = mx.zeros((1, 1, out_dim))

    def index(self, value: str) -> int:
        """The table row of `value`; `ConfigError` naming the allowed values if unknown."""
        if value not in self.spec.possible_values:
            allowed = ", ".join(self.spec.possible_values)
            raise ConfigError(
                f"condition {self.spec.name!r} cannot be {value!r}: use one of {allowed}"
            )
        return self.spec.possible_values.index(value)

    def __call__(self, indices: mx.array) -> mx.array:
        """indices (B,) -> condition vectors (B, out_dim)."""
        return self.output_proj(self.embed(indices))


class ConditionProvider(nn.Module):
    """The model's conditioners by name; `sum` gives the vector added to each step's input."""

    def __init__(self, specs: Sequence[LutConditioner], out_dim: int):
        super().__init__()
        self.conditioners = {spec.name: LutTable(spec, out_dim) for spec in specs}

    def sum(self, conditions: Sequence[Mapping[str, str]]) -> mx.array:
        """The summed condition vector of each batch row's values (name -> value): (B, dim).

        Every conditioner needs a value; `ConfigError` for a missing name, an unknown name or
        an unknown value.
        """
        names = sorted(self.conditioners)
        for values in conditions:
            if sorted(values) != names:
                raise ConfigError(
                    f"conditions {sorted(values)} do not match the model's conditioners {names}"
                )
        total = None
        for name, table in self.conditioners.items():
            indices = mx.array([table.index(values[name]) for values in conditions])
            vectors = table(indices)
            total = vectors if total is None else total + vectors
        return total
