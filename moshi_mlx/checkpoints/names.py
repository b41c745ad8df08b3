"""The table of Moshi LM checkpoint names: each rule maps a PyTorch tensor name pattern to
the MLX name(s) of our `Lm` and says how the data moves (`conversion.py` plans with it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Layout = Literal["same", "flatten", "split_slices", "every_slice"]
Shape = tuple[int, ...]
CheckpointFormat = Literal["mlx", "pytorch"]

_DEP = "depformer.slices.{slice}.transformer.layers.{dep_layer}."
_CONDITIONER = "condition_provider.conditioners.{condition}."


@dataclass(frozen=True)
class NameRule:
    """One PyTorch tensor name pattern and the MLX name(s) it becomes.

    `layout` says how the data moves: "same" (renamed only), "flatten" (norm gains (1, 1, D) to
    (D,)), "split_slices" (the depformer's packed weights: dim 0 holds every slice's rows in slice
    order, split evenly), "every_slice" (a depformer norm shared by all slices, copied into each).
    """

    pytorch: str
    mlx: str
    layout: Layout = "same"
    aliases: tuple[str, ...] = ()  # other PyTorch spellings accepted on input
    slice_offset: int = 0  # `depformer_emb.{k}` feeds slice k + 1 (slice 0 embeds text)
    invertible: bool = True  # False for input-only spellings covered by another rule
    per_set: bool = False  # indexed by weight set, under a weights-per-step schedule


NAME_RULES: tuple[NameRule, ...] = (
    # Temporal transformer (Helium) and its embeddings.
    NameRule("text_emb.weight", "text_emb.weight"),
    NameRule("text_emb.out{stream}.weight", "text_emb.out{stream}.weight"),
    NameRule("emb.{codebook}.weight", "audio_embs.{codebook}.weight"),
    NameRule("text_linear.weight", "text_linear.weight"),
    NameRule("out_norm.alpha", "out_norm.weight", "flatten"),
    NameRule("extra_heads.{head}.weight", "extra_heads.{head}.weight"),
    # Hibiki's lookup-table conditioners, named alike in both namings.
    *(
        NameRule(f"{_CONDITIONER}{part}", f"{_CONDITIONER}{part}")
        for part in ("embed.weight", "output_proj.weight", "learnt_padding")
    ),
    # The TTS's cross-attention to its speaker embeddings.
    NameRule(
        "transformer.layers.{layer}.cross_attention.in_proj_weight",
        "transformer.layers.{layer}.cross_attention.in_proj.weight",
        aliases=(
            "transformer.layers.{layer}.cross_attention.in_proj.weight",
            "transformer.layers.{layer}.cross_attention.in_projs.0.weight",
        ),
    ),
    NameRule(
        "transformer.layers.{layer}.cross_attention.out_proj.weight",
        "transformer.layers.{layer}.cross_attention.out_proj.weight",
        aliases=("transformer.layers.{layer}.cross_attention.out_projs.0.weight",),
    ),
    NameRule(
        "transformer.layers.{layer}.norm_cross.{affine}",
        "transformer.layers.{layer}.norm_cross.{affine}",
    ),
    NameRule(
        "transformer.layers.{layer}.self_attn.in_proj_weight",
        "transformer.layers.{layer}.self_attn.in_proj.weight",
        aliases=(
            "transformer.layers.{layer}.self_attn.in_proj.weight",
            "transformer.layers.{layer}.self_attn.in_projs.0.weight",
        ),
    ),
    NameRule(
        "transformer.layers.{layer}.self_attn.out_proj.weight",
        "transformer.layers.{layer}.self_attn.out_proj.weight",
        aliases=("transformer.layers.{layer}.self_attn.out_projs.0.weight",),
    ),
    NameRule(
        "transformer.layers.{layer}.norm{norm}.alpha",
        "transformer.layers.{layer}.norm{norm}.weight",
        "flatten",
    ),
    NameRule(
        "transformer.layers.{layer}.gating.linear_{io}.weight",
        "transformer.layers.{layer}.gating.linear_{io}.weight",
    ),
    # Depformer: one set of weights per slice (= per generated codebook) in MLX.
    NameRule("depformer_text_emb.weight", "depformer.slices.0.emb.weight"),
    NameRule("depformer_text_emb.{widen}.weight", "depformer.slices.0.emb.{widen}.weight"),
    NameRule("depformer_emb.{slice}.weight", "depformer.slices.{slice}.emb.weight", slice_offset=1),
    NameRule(
        "depformer_emb.{slice}.low_rank.weight",
        "depformer.slices.{slice}.emb.low_rank.weight",
        slice_offset=1,
    ),
    NameRule(
        "depformer_in.{slice}.weight", "depformer.slices.{slice}.linear_in.weight", per_set=True
    ),
    NameRule("linears.{slice}.weight", "depformer.slices.{slice}.linear_out.weight"),
    # Hibiki-Zero's norm of each slice's output (`depformer_norm`).
    NameRule("depformer_norms.{slice}.{affine}", "depformer.slices.{slice}.norm.{affine}"),
    NameRule(
        "depformer.layers.{dep_layer}.self_attn.in_proj_weight",
        _DEP + "self_attn.in_proj.weight",
        "split_slices",
        aliases=("depformer.layers.{dep_layer}.self_attn.in_proj.weight",),
        per_set=True,
    ),
    NameRule(
        "depformer.layers.{dep_layer}.self_attn.in_projs.{slice}.weight",
        _DEP + "self_attn.in_proj.weight",
        invertible=False,
        per_set=True,
    ),
    NameRule(
        "depformer.layers.{dep_layer}.self_attn.out_proj.weight",
        _DEP + "self_attn.out_proj.weight",
        "split_slices",
        per_set=True,
    ),
    NameRule(
        "depformer.layers.{dep_layer}.self_attn.out_projs.{slice}.weight",
        _DEP + "self_attn.out_proj.weight",
        invertible=False,
        per_set=True,
    ),
    NameRule(
        "depformer.layers.{dep_layer}.gating.{slice}.linear_{io}.weight",
        _DEP + "gating.linear_{io}.weight",
        per_set=True,
    ),
    NameRule(
        "depformer.layers.{dep_layer}.norm{norm}.alpha", _DEP + "norm{norm}.weight", "every_slice"
    ),
)

FIELD_PATTERNS = {
    "io": "in|out",
    "norm": "1|2",
    "condition": r"[A-Za-z_]\w*",
    "stream": "1|2",
    "affine": "weight|bias",
    "widen": "low_rank|out1|out2",
}
