"""Convert a bf16 Moshi LM checkpoint (MLX or PyTorch naming) to Kyutai's MLX q4/q8/bf16 format.

The command is `python -m moshi_mlx quantize model.safetensors -q 4`. The output is one safetensors file
named, shaped and typed like Kyutai's published `model.q4.safetensors` / `model.q8.safetensors`
/ `model.safetensors`, with the quantization recorded in its metadata (`quantization_bits`,
`quantization_group_size`). Tensors are converted one at a time, in row blocks, and written at
their final offsets, so peak memory stays near the largest single tensor; the file appears under
its name only once complete.
"""

from __future__ import annotations

import math
import os
import re
import resource
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from moshi_mlx.checkpoints.conversion import TensorRecipe, plan_conversion
from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.checkpoints.io import SafetensorsWriter, read_safetensors
from moshi_mlx.checkpoints.names import CheckpointFormat, Shape
from moshi_mlx.checkpoints.spec import (
    DEFAULT_GROUP_SIZE,
    GROUP_SIZES,
    LM_FILES,
    config_metadata,
    is_quantized,
    output_layout,
    quantization_metadata,
)
from moshi_mlx.errors import MoshiError, Setting, WeightsError
from moshi_mlx.files import check_output, written_atomically
from moshi_mlx.models.lm import LmConfig

_CHUNK_ELEMENTS = 1 << 22  # rows are processed in blocks of about this many values
# MLX keeps freed buffers for reuse; a small cache avoids re-faulting fresh memory for every
# block (a third of the run time otherwise) while keeping the process small.
_CACHE_LIMIT_BYTES = 256 << 20


def _progress_bar(total_bytes: int, total_tensors: int, progress: bool | None) -> tqdm:
    """The conversion's bar on stderr: shown when stderr is a terminal, or as `progress` says."""
    return tqdm(
        total=total_bytes / 1e9,
        desc=f"0/{total_tensors} tensors",
        bar_format="{percentage:3.0f}%|{bar:30}| {desc}  {n:.2f}/{total:.2f} GB  "
        "{elapsed}<{remaining}",
        file=sys.stderr,
        disable=None if progress is None else not progress,
    )


@dataclass
class QuantizeResult:
    """What a conversion did, with figures for the report."""

    output: Path
    source_format: CheckpointFormat
    bits: int
    group_size: int | None
    num_tensors: int
    output_bytes: int
    seconds: float
    peak_mlx_bytes: int  # MLX memory the conversion itself held at its peak
    peak_rss_bytes: int
    relative_errors: dict[str, float] = field(default_factory=dict)  # layer -> relative RMS

    def error_report(self, worst: int = 5) -> str:
        """Relative RMS error of the dequantized weights per layer group, and the worst layers."""
        if not self.relative_errors:
            return "no quantized layers (bf16 output)"
        groups: dict[str, list[float]] = defaultdict(list)
        for name, error in self.relative_errors.items():
            groups[re.sub(r"\.\d+(?=\.|$)", ".*", name)].append(error)
        width = max(len(group) for group in groups)
        lines = [f"{'layer group':<{width}}  count  mean rel. RMS  max rel. RMS"]
        for group, errors in sorted(groups.items()):
            mean = sum(errors) / len(errors)
            lines.append(f"{group:<{width}}  {len(errors):5d}  {mean:13.5f}  {max(errors):12.5f}")
        ranked = sorted(self.relative_errors.items(), key=lambda item: -item[1])[:worst]
        lines.append("worst layers: " + ", ".join(f"{name} {err:.5f}" for name, err in ranked))
        return "\n".join(lines)

    def summary(self) -> str:
        kind = "bf16" if self.bits == 16 else f"{self.bits}-bit, group size {self.group_size}"
        return (
            f"wrote {self.output} ({kind}, {self.num_tensors} tensors, "
            f"{self.output_bytes / 1e9:.2f} GB) from {self.source_format}-named input in "
            f"{self.seconds:.1f} s; peak memory: MLX {self.peak_mlx_bytes / 1e9:.2f} GB, "
            f"peak process RSS {self.peak_rss_bytes / 1e9:.2f} GB"
        )


def _peak_rss_bytes() -> int:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB


def _row_blocks(shape: Shape) -> list[tuple[int, int]]:
    step = max(1, _CHUNK_ELEMENTS // math.prod(shape[1:]))
    return [(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def _convert_tensor(
    writer: SafetensorsWriter,
    recipe: TensorRecipe,
    source: mx.array,
    bits: int,
    group_size: int | None,
) -> float | None:
    """Write one MLX tensor; returns its relative RMS quantization error, or None if not quantized."""
    weight = recipe.apply(source)
    if not is_quantized(recipe.shape, group_size):
        for start, stop in _row_blocks(recipe.shape):
            block = weight[start:stop]
            mx.eval(block)
            writer.write_rows(recipe.target, start, block)
        return None
    prefix = recipe.target.removesuffix(".weight")
    error_sum = reference_sum = 0.0
    for start, stop in _row_blocks(recipe.shape):
        block = weight[start:stop]
        packed, scales, biases = mx.quantize(block, group_size=group_size, bits=bits)
        restored = mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits)
        block32 = block.astype(mx.float32)
        error = mx.sum(mx.square(restored.astype(mx.float32) - block32))
        reference = mx.sum(mx.square(block32))
        mx.eval(packed, scales, biases, error, reference)
        writer.write_rows(recipe.target, start, packed)
        writer.write_rows(prefix + ".scales", start, scales)
        writer.write_rows(prefix + ".biases", start, biases)
        error_sum, reference_sum = error_sum + error.item(), reference_sum + reference.item()
    return math.sqrt(error_sum / reference_sum) if reference_sum > 0 else 0.0


def default_output(input_path: Path, bits: int) -> Path:
    """Kyutai's file name for this precision, next to the input."""
    return input_path.parent / LM_FILES[bits][1]


def quantize_checkpoint(
    input_path: str | Path,
    output_path: str | Path | None = None,
    bits: int = 4,
    group_size: int | None = None,
    force: bool = False,
    progress: bool | None = None,
    config: LmConfig | None = None,
) -> QuantizeResult:
    """Convert a bf16 Moshi LM checkpoint to Kyutai's MLX format, quantized to `bits` (4, 8) or
    kept bf16 (16). `group_size` defaults to 32 for 4 bits and 64 for 8 bits. The output
    carries `config` (default: `hub.lm_config_of` the input) in its metadata, so it loads
    with no config file, and every depformer slice of it (a file stored for fewer steps is
    repaired as `plan_conversion` says). Raises `MoshiError` for user errors (bad input,
    existing output without `force`)."""
    input_path = Path(input_path)
    if bits not in LM_FILES:
        raise MoshiError(f"bits must be 4, 8 or 16, got {bits}")
    if bits == 16:
        group_size = None
    else:
        group_size = group_size or DEFAULT_GROUP_SIZE[bits]
        if group_size not in GROUP_SIZES:
            raise MoshiError(
                Setting("group_size"),
                f" must be one of {GROUP_SIZES}, got {group_size}",
                parameter="group_size",
            )
    output_path = Path(output_path) if output_path else default_output(input_path, bits)
    check_output(input_path, output_path, force, what="checkpoint")

    start = time.monotonic()
    mx.reset_peak_memory()
    held_before = mx.get_active_memory()  # the caller's arrays: not the conversion's
    if config is None:
        config = lm_config_of(input_path)
    tensors = read_safetensors(input_path).tensors
    source_format, recipes = plan_conversion(
        {name: a.shape for name, a in tensors.items()},
        str(input_path),
        config.dep_q,
        schedule=config.depformer_weights_per_step_schedule,
    )
    not_float = [n for n, a in tensors.items() if not mx.issubdtype(a.dtype, mx.floating)]
    if not_float:
        raise WeightsError(f"{input_path}: tensor {not_float[0]} is not floating point")
    layout = output_layout({r.target: r.shape for r in recipes}, bits, group_size)
    if group_size is not None and not any(name.endswith(".scales") for name in layout):
        raise MoshiError(  # its metadata would declare a quantization that no tensor has
            f"{input_path}: no layer's input width divides by the group size {group_size}, so "
            "nothing would be quantized; pick a smaller ",
            Setting("group_size"),
            ", or ",
            Setting("bits", 16),
            parameter="group_size",
        )
    metadata = quantization_metadata(bits, group_size) | config_metadata(config)
    by_source: dict[str, list[TensorRecipe]] = defaultdict(list)
    for recipe in recipes:
        by_source[recipe.source].append(recipe)

    errors: dict[str, float] = {}
    total_bytes = sum(a.nbytes for a in tensors.values())
    previous_cache_limit = mx.set_cache_limit(_CACHE_LIMIT_BYTES)
    bar = None
    try:
        with written_atomically(output_path) as partial, open(partial, "wb") as file:
            writer = SafetensorsWriter(file, layout, metadata)
            bar = _progress_bar(total_bytes, len(recipes), progress)
            done_tensors = 0
            for source_name, source_recipes in by_source.items():
                source = tensors.pop(source_name)  # drop the lazy handle once converted
                share = source.nbytes / len(source_recipes)
                source = source.astype(mx.bfloat16)
                mx.eval(source)
                for recipe in source_recipes:
                    error = _convert_tensor(writer, recipe, source, bits, group_size)
                    if error is not None:
                        errors[recipe.target.removesuffix(".weight")] = error
                    done_tensors += 1
                    bar.set_description_str(f"{done_tensors}/{len(recipes)} tensors", False)
                    bar.update(share / 1e9)
                del source
            writer.check_complete()
            file.flush()
            os.fsync(file.fileno())
            bar.close()  # the finished bar stays on screen
    except OSError as exc:  # disk full, no permission, ...
        raise MoshiError(f"cannot write {output_path}: {exc.strerror or exc}") from exc
    finally:
        if bar is not None and not bar.disable:  # not closed: an error ends the conversion
            bar.leave = False  # wiped, so that the error's one line stands alone
            bar.close()
        mx.set_cache_limit(previous_cache_limit)
        mx.clear_cache()
    return QuantizeResult(
        output=output_path,
        source_format=source_format,
        bits=bits,
        group_size=group_size,
        num_tensors=len(layout),
        output_bytes=writer.total_bytes,
        seconds=time.monotonic() - start,
        peak_mlx_bytes=mx.get_peak_memory() - held_before,
        peak_rss_bytes=_peak_rss_bytes(),
        relative_errors=errors,
    )
