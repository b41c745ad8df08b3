"""A step's graph in the form a GPU runs it, built on any backend (`--form`), to count its
operations here.

MLX builds `mx.fast`'s norms, RoPE and attention, and the (de)quantization of packed rows, as
one kernel each on a GPU, and as the operations it decomposes them into on its CPU backend
(MLX 0.32, `mlx/fast.cpp`, `mlx/ops.cpp`); our model picks its own attention form per backend
(`transformer.fused_attention`). While `kernel_form(form)` is active, a step traced anew
(a stepper made inside it, never stepped: its values are placeholders) is built as `form`'s
GPU builds it: each kernel one `Depends` node over the kernel's inputs and a tag array named
after the kernel, which `timing.ops_by_primitive` counts under that name.

- `cuda`: MLX's CUDA backend (what the H200 figures were counted on): attention with an array
  mask is decomposed (neither its cuDNN nor its vector kernel takes one), the rest fused.
- `metal`: Apple GPUs: every attention of a step is one kernel (the vector kernel takes
  boolean masks, at the head widths of the published models, 64 and 128).
- `cpu`: as this backend builds it, unpatched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from unittest import mock

import mlx.core as mx
import numpy as np

from moshi_mlx.modules import transformer

FORMS = ("cpu", "cuda", "metal")
# The kernels' names, as MLX's GPU primitives print them (`export_to_dot`).
KERNELS = ("RMSNorm", "LayerNorm", "RoPE", "ScaledDotProductAttention", "Quantize")

Graph = Callable[[], object]  # builds a step's lazy outputs


def _result_type(*arrays: mx.array | None) -> mx.Dtype:
    """The dtype MLX promotes these arrays' dtypes to."""
    dtype = None
    for array in arrays:
        if array is not None:
            dtype = (
                array.dtype
                if dtype is None
                else (mx.array(0, dtype) + mx.array(0, array.dtype)).dtype
            )
    return dtype


class _Kernels:
    """`mx.fast`'s functions and (de)quantization as one node each, counted by tags."""

    def __init__(self, form: str):
        self.form = form
        self.tags = {name: mx.array([index], mx.int32) for index, name in enumerate(KERNELS)}
        mx.eval(self.tags)
        self.fast = {
            name: getattr(mx.fast, name)
            for name in ("rms_norm", "layer_norm", "rope", "scaled_dot_product_attention")
        }

    def _node(self, kind: str, outputs: list[tuple], inputs: list) -> list[mx.array]:
        """One node of `kind` over `inputs` (arrays or None), with `outputs` (shape, dtype)."""
        placeholders = [
            mx.array(np.zeros(shape, np.float32), dtype=dtype) for shape, dtype in outputs
        ]
        arrays = [a for a in inputs if isinstance(a, mx.array)]
        return mx.depends(placeholders, [*arrays, self.tags[kind]])

    def rms_norm(self, x, weight, eps, *, stream=None):
        out_type = _result_type(x, weight)
        inputs = [x.astype(out_type), None if weight is None else weight.astype(out_type)]
        return self._node("RMSNorm", [(x.shape, out_type)], inputs)[0]

    def layer_norm(self, x, weight, bias, eps, *, stream=None):
        out_type = _result_type(x, weight, bias)
        parts = [x, weight, bias]
        inputs = [None if a is None else a.astype(out_type) for a in parts]
        return self._node("LayerNorm", [(x.shape, out_type)], inputs)[0]

    def rope(self, x, dims, *, traditional, base, scale, offset, freqs=None, stream=None):
        inputs = [x, offset, None if freqs is None else freqs.astype(mx.float32)]
        return self._node("RoPE", [(x.shape, x.dtype)], inputs)[0]

    def scaled_dot_product_attention(self, q, k, v, *, scale, mask=None, sinks=None, **kwargs):
        array_mask = isinstance(mask, mx.array)
        if (self.form == "cuda" and array_mask) or sinks is not None:
            return self.fast["scaled_dot_product_attention"](
                q, k, v, scale=scale, mask=mask, sinks=sinks, **kwargs
            )
        final = _result_type(q, k, v)
        inputs = [q.astype(final), k.astype(final), v.astype(final)]
        if array_mask:  # as MLX passes it: additive masks in the final type, broadcast
            mask = mask if mask.dtype == mx.bool_ else mask.astype(final)
            inputs.append(mx.broadcast_to(mask, (*q.shape[:-1], k.shape[-2])))
        shape = (*q.shape[:-1], v.shape[-1])
        return self._node("ScaledDotProductAttention", [(shape, final)], inputs)[0]

    def dequantize(self, w, scales, biases=None, group_size=64, bits=4, mode="affine", **kw):
        if mode != "affine":
            raise NotImplementedError(f"kernel_form: dequantize mode {mode!r}")
        out_type = kw.get("dtype") or scales.dtype
        shape = (*w.shape[:-1], w.shape[-1] * 32 // bits)
        out = self._node("Quantize", [(shape, scales.dtype)], [w, scales, biases])[0]
        return out.astype(out_type)

    def quantize(self, w, group_size=64, bits=4, mode="affine", **kw):
        if mode != "affine":
            raise NotImplementedError(f"kernel_form: quantize mode {mode!r}")
        groups = (*w.shape[:-1], w.shape[-1] // group_size)
        shapes = [((*w.shape[:-1], w.shape[-1] * bits // 32), mx.uint32)]
        shapes += [(groups, w.dtype), (groups, w.dtype)]
        return self._node("Quantize", shapes, [w])


@contextmanager
def kernel_form(form: str) -> Iterator[dict[str, mx.array]]:
    """While active, graphs are built as `form`'s GPU builds them (`FORMS`); yields the tag
    arrays to name when counting (`timing.ops_by_primitive(..., names=tags)`), none for
    `cpu`. Only for counting: a graph built inside computes placeholders, and a compiled
    function traced inside keeps that trace (trace a fresh stepper's, and drop it)."""
    if form not in FORMS:
        raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
    if form == "cpu":
        yield {}
        return
    kernels = _Kernels(form)
    fused = (lambda array_mask: True) if form == "metal" else (lambda array_mask: not array_mask)
    patches = [mock.patch.object(transformer, "fused_attention", fused)]
    patches += [mock.patch.object(mx.fast, name, getattr(kernels, name)) for name in kernels.fast]
    patches += [
        mock.patch.object(mx, name, getattr(kernels, name)) for name in ("dequantize", "quantize")
    ]
    for patch in patches:
        patch.start()
    try:
        yield kernels.tags
    finally:
        for patch in reversed(patches):
            patch.stop()
