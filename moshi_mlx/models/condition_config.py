"""The conditions of a model, in Kyutai's `config.json` terms: `conditioners` and `fuser`.

Two kinds of conditioner: a lookup table ("lut": one of a few values -> a learned vector,
Hibiki's "description", the TTS's "cfg" and "control") and a tensor ("tensor": a sequence of
vectors given by the caller, the TTS's speaker embeddings "speaker_wavs"). The fuser says how
each enters the model: summed into every step's input ("sum") or attended to by the temporal
transformer's cross-attention layers ("cross"), optionally with sinusoidal positions added.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moshi_mlx.errors import ConfigError


def known_keys(what: str, data: Any, known: tuple[str, ...]) -> dict[str, Any]:
    """`data` if it is an object whose keys are all `known`, else a `ConfigError`."""
    if not isinstance(data, dict):
        raise ConfigError(f"LM config {what} must be an object, got {data!r}")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ConfigError(f"LM config {what} has unknown key(s): {', '.join(unknown)}")
    return data


@dataclass(frozen=True)
class LutConditioner:
    """A condition looked up in a table (Kyutai's "lut" conditioner): one of
    `possible_values` -> a learned vector of `dim`, projected to the model's width."""

    name: str
    possible_values: tuple[str, ...]
    dim: int
    n_bins: int
    tokenizer: str = "noop"

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> LutConditioner:
        lut = known_keys(
            f"conditioner {name!r}",
            data.get("lut", {}),
            ("n_bins", "dim", "tokenizer", "possible_values"),
        )
        try:
            conditioner = cls(
                name,
                tuple(str(v) for v in lut["possible_values"]),
                int(lut["dim"]),
                int(lut["n_bins"]),
                str(lut.get("tokenizer", "noop")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"LM config conditioner {name!r} is incomplete: {exc}") from None
        if conditioner.tokenizer != "noop":
            raise ConfigError(
                f"LM config conditioner {name!r}: tokenizer {conditioner.tokenizer!r} "
                "is not supported (only 'noop')"
            )
        return conditioner

    def to_dict(self) -> dict[str, Any]:
        lut = {
            "n_bins": self.n_bins,
            "dim": self.dim,
            "tokenizer": self.tokenizer,
            "possible_values": list(self.possible_values),
        }
        return {"type": "lut", "lut": lut}


@dataclass(frozen=True)
class TensorConditioner:
    """A condition given as vectors of `dim` (Kyutai's "tensor" conditioner), projected to
    the model's width; positions the caller marks absent take a learned padding vector."""

    name: str
    dim: int

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> TensorConditioner:
        tensor = known_keys(f"conditioner {name!r}", data.get("tensor", {}), ("dim",))
        try:
            return cls(name, int(tensor["dim"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"LM config conditioner {name!r} is incomplete: {exc}") from None

    def to_dict(self) -> dict[str, Any]:
        return {"type": "tensor", "tensor": {"dim": self.dim}}


Conditioner = LutConditioner | TensorConditioner
_KINDS = {"lut": LutConditioner, "tensor": TensorConditioner}


def conditioner_from_dict(name: str, data: Any) -> Conditioner:
    """One entry of `conditioners`; an unsupported type is a `ConfigError`."""
    kind = data.get("type") if isinstance(data, dict) else data
    if kind not in _KINDS:
        raise ConfigError(f"LM config conditioner {name!r} of type {kind!r} is not supported")
    return _KINDS[kind].from_dict(name, data)


@dataclass(frozen=True)
class Fuser:
    """How each condition enters the model: `sum` names the tables summed into every step's
    input, `cross` the tensors the cross-attention layers attend to (concatenated in this
    order, plus sinusoidal positions times `cross_pos_emb_scale` if `cross_pos_emb`)."""

    sum: tuple[str, ...] = ()
    cross: tuple[str, ...] = ()
    cross_pos_emb: bool = False
    cross_pos_emb_scale: float = 1.0

    @classmethod
    def from_dict(cls, data: Any, conditioners: tuple[Conditioner, ...]) -> Fuser:
        """Kyutai's `fuser`, checked against the conditioners: every table summed, every
        tensor attended to; prepended conditions are not supported."""
        if data is None:
            if conditioners:
                raise ConfigError("LM config has conditioners but no fuser saying how to use them")
            return cls()
        keys = (
            "sum",
            "cross",
            "prepend",
            "cross_attention_pos_emb",
            "cross_attention_pos_emb_scale",
        )
        data = known_keys("fuser", data, keys)
        if data.get("prepend"):
            raise ConfigError("LM config fuser 'prepend' conditions are not supported")
        fuser = cls(
            tuple(data.get("sum", ())),
            tuple(data.get("cross", ())),
            bool(data.get("cross_attention_pos_emb", False)),
            float(data.get("cross_attention_pos_emb_scale", 1.0)),
        )
        for how, kind in (("sum", LutConditioner), ("cross", TensorConditioner)):
            expected = sorted(c.name for c in conditioners if isinstance(c, kind))
            if sorted(getattr(fuser, how)) != expected:
                raise ConfigError(
                    f"LM config fuser {how!r} lists {list(getattr(fuser, how))}, expected the "
                    f"{kind.__name__.removesuffix('Conditioner').lower()} conditioners {expected}"
                )
        return fuser

    def to_dict(self) -> dict[str, Any]:
        return {
            "cross_attention_pos_emb": self.cross_pos_emb,
            "cross_attention_pos_emb_scale": self.cross_pos_emb_scale,
            "sum": list(self.sum),
            "prepend": [],
            "cross": list(self.cross),
        }
