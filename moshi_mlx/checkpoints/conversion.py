"""Moshi LM checkpoint names: Kyutai's PyTorch naming to the MLX naming of our `Lm`.

Every tensor of the PyTorch release (`kyutai/moshiko-pytorch-bf16`) is mapped by one rule of
`NAME_RULES` (`names.py`); the same table gives the inverse mapping (`to_pytorch_naming`, used to build test
fixtures). Conversion is planned from names and shapes only (`plan_conversion`), so the 7B layout
can be checked without data, and applied tensor by tensor (`TensorRecipe.apply`) on lazy arrays.

A plan can ask for a number of depformer slices: slices a checkpoint lacks are repaired as
NVIDIA's PersonaPlex loader repairs a file stored for fewer steps:
step s repeats step s - stored (its attention rows, projections, feed-forward, embedding),
each kind of repair named in a one-line notice (logger `moshi_mlx.checkpoints`).

A depformer with a weights-per-step schedule (the TTS) stores its input projections,
attention and feed-forward once per weight set; a plan given the schedule gives each slice
the tensors of its set (`NameRule.per_set`).
"""

from __future__ import annotations

import itertools
import logging
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import mlx.core as mx

from moshi_mlx.checkpoints.io import name_list
from moshi_mlx.checkpoints.names import (
    FIELD_PATTERNS,
    NAME_RULES,
    CheckpointFormat,
    NameRule,
    Shape,
)
from moshi_mlx.errors import WeightsError

# Parts only some models have (the TTS's cross-attention and low-rank depformer embeddings,
# Hibiki-Zero's depformer output norms).
_OPTIONAL_PARTS = (".cross_attention.", ".norm_cross.", ".emb.low_rank.", ".norm.")
_SLICE_NAME = re.compile(r"depformer\.slices\.([0-9]+)\.")
log = logging.getLogger("moshi_mlx.checkpoints")
_MARKERS = {"pytorch": "out_norm.alpha", "mlx": "out_norm.weight"}


def _template_regex(template: str) -> re.Pattern[str]:
    parts = re.split(r"\{(\w+)\}", template)
    regex = "".join(
        re.escape(part) if i % 2 == 0 else f"(?P<{part}>{FIELD_PATTERNS.get(part, r'[0-9]+')})"
        for i, part in enumerate(parts)
    )
    return re.compile(regex)


def _match(template: str, name: str) -> dict[str, str] | None:
    found = _template_regex(template).fullmatch(name)
    return None if found is None else found.groupdict()


@dataclass(frozen=True)
class TensorRecipe:
    """How one MLX tensor is made: rows [start, stop) of `source` (all rows if None), reshaped."""

    target: str
    source: str
    shape: Shape
    rows: tuple[int, int] | None = None

    def apply(self, source: mx.array) -> mx.array:
        """The target tensor from the (lazy) source tensor."""
        if self.rows is not None:
            source = source[self.rows[0] : self.rows[1]]
        return source.reshape(self.shape)


def in_pytorch_naming(names: Iterable[str]) -> bool:
    """Whether a checkpoint's tensor names are Kyutai's PyTorch naming (a quick look)."""
    return _MARKERS["pytorch"] in set(names)


def detect_format(names: Iterable[str], source: str = "checkpoint") -> CheckpointFormat:
    """Tell Kyutai's MLX naming from its PyTorch naming; anything else is a `WeightsError`."""
    names = set(names)
    if any(name.endswith(".scales") for name in names):
        raise WeightsError(
            f"{source} is already quantized (it has '.scales' tensors); give a bf16 checkpoint"
        )
    found = [fmt for fmt, marker in _MARKERS.items() if marker in names]
    if len(found) != 1:
        raise WeightsError(
            f"{source} is not a Moshi LM checkpoint: expected either Kyutai's PyTorch naming "
            "(out_norm.alpha, emb.0.weight, depformer_in.0.weight, ...) or its MLX naming "
            "(out_norm.weight, audio_embs.0.weight, depformer.slices.0.linear_in.weight, ...)"
        )
    return found[0]


def _plan_pytorch(
    shapes: Mapping[str, Shape], source: str, schedule: Sequence[int] | None = None
) -> list[TensorRecipe]:
    # Slices are counted from their input and output projections, one tensor each per slice.
    slices = [
        int(fields["slice"])
        for name in shapes
        for template in ("depformer_in.{slice}.weight", "linears.{slice}.weight")
        if (fields := _match(template, name)) is not None
    ]
    num_slices = max(slices) + 1 if slices else 0  # Kyutai's STT has no depformer
    if schedule is None:
        slices_of_set = {k: [k] for k in range(num_slices)}
    else:
        slices_of_set = {w: [k for k, s in enumerate(schedule) if s == w] for w in set(schedule)}
    recipes, unknown = [], []
    for name, shape in shapes.items():
        shape = tuple(shape)
        for rule, fields in _find_rule(name):
            recipes.extend(
                _pytorch_recipes(rule, fields, name, shape, num_slices, slices_of_set, source)
            )
            break
        else:
            unknown.append(name)
    if unknown:
        raise WeightsError(
            f"{source}: tensor(s) not part of a Moshi LM in Kyutai's PyTorch naming: "
            f"{name_list(unknown)}"
        )
    return recipes


def _find_rule(name: str) -> Iterable[tuple[NameRule, dict[str, str]]]:
    for rule in NAME_RULES:
        for spelling in (rule.pytorch, *rule.aliases):
            fields = _match(spelling, name)
            if fields is not None:
                yield rule, fields


def _pytorch_recipes(
    rule: NameRule,
    fields: dict[str, str],
    name: str,
    shape: Shape,
    num_slices: int,
    slices_of_set: dict[int, list[int]],
    source: str,
) -> list[TensorRecipe]:
    if "slice" in fields and rule.per_set:
        weight_set = int(fields.pop("slice"))
        if weight_set not in slices_of_set:
            raise WeightsError(f"{source}: tensor {name} is for no depformer slice")
        return [
            recipe
            for k in slices_of_set[weight_set]
            for recipe in _pytorch_recipes(
                replace(rule, per_set=False),
                {**fields, "slice": str(k)},
                name,
                shape,
                num_slices,
                slices_of_set,
                source,
            )
        ]
    if "slice" in fields:
        fields = {**fields, "slice": str(int(fields["slice"]) + rule.slice_offset)}
    if rule.layout == "same":
        return [TensorRecipe(rule.mlx.format(**fields), name, shape)]
    if rule.layout == "flatten":
        return [TensorRecipe(rule.mlx.format(**fields), name, (shape[-1],))]
    if rule.layout == "every_slice":
        return [
            TensorRecipe(rule.mlx.format(**fields, slice=k), name, (shape[-1],))
            for k in range(num_slices)
        ]
    rows, rest = shape[0], tuple(shape[1:])
    sets = len(slices_of_set)
    if rows % sets:
        raise WeightsError(
            f"{source}: tensor {name} has {rows} rows, not a multiple of the {sets} "
            "depformer weight sets"
        )
    step = rows // sets
    return [
        TensorRecipe(
            rule.mlx.format(**fields, slice=k), name, (step, *rest), (w * step, (w + 1) * step)
        )
        for w, ks in sorted(slices_of_set.items())
        for k in ks
    ]


def _plan_mlx(shapes: Mapping[str, Shape], source: str) -> list[TensorRecipe]:
    templates = {rule.mlx for rule in NAME_RULES}
    unknown = [n for n in shapes if not any(_match(t, n) is not None for t in templates)]
    if unknown:
        raise WeightsError(
            f"{source}: tensor(s) not part of a Moshi LM in Kyutai's MLX naming: "
            f"{name_list(unknown)}"
        )
    return [TensorRecipe(name, name, tuple(shape)) for name, shape in shapes.items()]


def check_complete(names: Iterable[str], source: str = "checkpoint") -> None:
    """Raise `WeightsError` unless MLX `names` form a whole model: every layer, slice, codebook.

    Each index (temporal layer, depformer layer, slice, codebook) must run from 0 without a gap,
    and every tensor pattern must exist for every value of the indices it uses.
    """
    names = set(names)
    templates = sorted({rule.mlx for rule in NAME_RULES})
    matches = {t: [f for n in names if (f := _match(t, n)) is not None] for t in templates}
    domains: dict[str, set[str]] = {}
    for found in matches.values():
        for fields in found:
            for field, value in fields.items():
                domains.setdefault(field, set()).add(value)
    for field, values in domains.items():
        if field not in FIELD_PATTERNS:
            indices = sorted(int(v) for v in values)
            if indices != list(range(len(indices))):
                raise WeightsError(f"{source}: {field} indices {indices} are not 0..N-1")
    if not any(name.startswith("depformer.") for name in names):  # Kyutai's STT has none
        templates = [t for t in templates if not t.startswith("depformer.")]
    for part in _OPTIONAL_PARTS:  # required only of a model that has them
        if not any(part in name for name in names):
            templates = [t for t in templates if part not in t]
    # A conditioner's parts depend on its kind (a table has `embed`): the strict load checks them.
    templates = [t for t in templates if not t.startswith("condition_provider.")]
    missing = []
    for template in templates:
        fields = re.findall(r"\{(\w+)\}", template)
        for values in itertools.product(*(sorted(domains.get(f, ())) for f in fields)):
            name = template.format(**dict(zip(fields, values)))
            if name not in names:
                missing.append(name)
    if missing:
        raise WeightsError(f"{source}: missing tensor(s) {name_list(missing)}")


def plan_conversion(
    shapes: Mapping[str, Sequence[int]],
    source: str = "checkpoint",
    num_slices: int | None = None,
    used_slices: int | None = None,
    schedule: Sequence[int] | None = None,
) -> tuple[CheckpointFormat, list[TensorRecipe]]:
    """Detect the naming of a bf16 Moshi LM checkpoint and plan its MLX tensors, with
    `num_slices` depformer slices if given (see the module docstring), else the file's; a
    repair is noticed only if the caller uses a repaired slice (`used_slices`, default all).
    A depformer's weights-per-step `schedule` says which weight set each slice uses.

    `shapes` maps tensor names to shapes (arrays are not needed). Raises `WeightsError` for
    unknown, duplicated or missing tensors.
    """
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    fmt = detect_format(shapes, source)
    if fmt == "pytorch":
        recipes = _plan_pytorch(shapes, source, schedule)
    else:
        recipes = _plan_mlx(shapes, source)
    targets = [r.target for r in recipes]
    duplicated = [name for name, count in Counter(targets).items() if count > 1]
    if duplicated:
        raise WeightsError(f"{source}: several tensors give {name_list(duplicated)}")
    if num_slices is not None:
        used = num_slices if used_slices is None else used_slices
        recipes = _with_slices(recipes, num_slices, fmt, source, used)
    check_complete([r.target for r in recipes], source)
    return fmt, recipes


def _slice_of(target: str) -> int | None:
    found = _SLICE_NAME.match(target)
    return None if found is None else int(found.group(1))


def _with_slices(
    recipes: list[TensorRecipe], num_slices: int, fmt: CheckpointFormat, source: str, used: int
) -> list[TensorRecipe]:
    """The recipes, with those of depformer slices up to num_slices - 1 that a file stored
    for fewer steps lacks (repeated from earlier steps); slices past it are left to the
    strict load to refuse."""
    # Counted by input projections: an 8-step PyTorch file also embeds step 8's input.
    projected = [r.target for r in recipes if r.target.endswith(".linear_in.weight")]
    stored = len({s for target in projected if (s := _slice_of(target)) is not None})
    if stored >= num_slices:
        return recipes
    if num_slices > 2 * stored:
        raise WeightsError(
            f"{source}: the depformer is stored for {stored} steps; {num_slices} are needed"
        )
    present = {r.target for r in recipes}
    copied, attention = [], False
    for recipe in recipes:
        slice_index = _slice_of(recipe.target)
        if slice_index is None:
            continue
        prefix = f"depformer.slices.{slice_index}."
        target = f"depformer.slices.{slice_index + stored}." + recipe.target[len(prefix) :]
        if slice_index + stored < num_slices and target not in present:
            copied.append(TensorRecipe(target, recipe.source, recipe.shape, recipe.rows))
            attention = attention or ".self_attn." in target
    steps = f"steps {stored}-{num_slices - 1}"
    if used <= stored:
        return recipes + copied
    if attention:
        log.warning(
            "%s: depformer attention weights are stored for %d steps; %s repeat steps 0-%d "
            "(as NVIDIA's loader extends them)",
            source,
            stored,
            steps,
            num_slices - stored - 1,
        )
    names = "gating, linears, depformer_in, depformer_emb" if fmt == "pytorch" else "slices"
    log.warning(
        "%s: depformer weights of %s (%s) are missing; copied from steps 0-%d (as NVIDIA's "
        "loader copies them)",
        source,
        steps,
        names,
        num_slices - stored - 1,
    )
    return recipes + copied


def convert_shapes(shapes: Mapping[str, Sequence[int]]) -> dict[str, Shape]:
    """MLX tensor names and shapes of a checkpoint given by its names and shapes."""
    return {r.target: r.shape for r in plan_conversion(shapes)[1]}


def to_mlx_naming(
    tensors: Mapping[str, mx.array],
    source: str = "checkpoint",
    num_slices: int | None = None,
    used_slices: int | None = None,
    schedule: Sequence[int] | None = None,
) -> dict[str, mx.array]:
    """Lazily convert a Moshi LM state dict in either naming to MLX naming (with
    `num_slices` depformer slices and a weights-per-step `schedule`, as `plan_conversion`)."""
    shapes = {name: a.shape for name, a in tensors.items()}
    _, recipes = plan_conversion(shapes, source, num_slices, used_slices, schedule)
    return {r.target: r.apply(tensors[r.source]) for r in recipes}


def to_pytorch_naming(tensors: Mapping[str, mx.array]) -> dict[str, mx.array]:
    """Pack an MLX-named Moshi LM state dict into Kyutai's published PyTorch naming.

    The inverse of `to_mlx_naming` (2024 spelling: packed `in_proj_weight` / `out_proj.weight`).
    The depformer norms must be equal in every slice, as in Kyutai's files (PyTorch shares them).
    """
    packed: dict[str, dict[int, mx.array]] = {}
    for name, array in tensors.items():
        for rule in NAME_RULES:
            fields = _match(rule.mlx, name) if rule.invertible else None
            if fields is None:
                continue
            slice_index = int(fields.pop("slice", 0))
            if "{slice}" in rule.pytorch:
                if slice_index < rule.slice_offset:
                    continue
                fields["slice"] = str(slice_index - rule.slice_offset)
            if rule.layout in ("flatten", "every_slice"):
                array = array.reshape(1, 1, -1)
            packed.setdefault(rule.pytorch.format(**fields), {})[slice_index] = array
            break
        else:
            raise WeightsError(f"tensor {name} is not part of a Moshi LM in MLX naming")
    result = {}
    for name, parts in packed.items():
        rule = next(rule for rule, _ in _find_rule(name))
        first = parts[min(parts)]
        if rule.layout == "split_slices":
            result[name] = mx.concatenate([parts[k] for k in sorted(parts)], axis=0)
        elif rule.layout == "every_slice" and not all(
            mx.array_equal(part, first).item() for part in parts.values()
        ):
            raise WeightsError(f"the depformer slices' copies of {name} differ; PyTorch shares one")
        else:
            result[name] = first
    return result
