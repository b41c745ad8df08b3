"""Kyutai PyTorch LM naming -> MLX naming (moshi_mlx.checkpoints.conversion), on the 7B layouts and data."""

import csv
import subprocess
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import MANIFESTS, REFERENCE_PYTHON, needs_reference

from moshi_mlx.checkpoints.conversion import (
    convert_shapes,
    detect_format,
    plan_conversion,
    to_mlx_naming,
    to_pytorch_naming,
)
from moshi_mlx.errors import WeightsError

LM_FIXTURES = Path(__file__).parents[1] / "fixtures" / "lm"
REPO = Path(__file__).parents[2]


def read_manifest(name: str) -> dict[str, tuple[int, ...]]:
    """Names and shapes of a published checkpoint (every dtype there is bfloat16 or uint32)."""
    path = MANIFESTS / f"{name}.tsv"
    with path.open() as file:
        rows = list(csv.DictReader(file, delimiter="\t"))
    return {row["name"]: tuple(int(d) for d in row["shape"].split(",")) for row in rows}


@pytest.fixture(scope="module")
def pytorch_7b():
    return read_manifest("moshiko_pytorch_bf16")


@pytest.fixture(scope="module")
def mlx_7b():
    return read_manifest("moshiko_mlx_bf16")


@pytest.fixture(scope="module")
def fixture_weights():
    """The tiny reference model's weights in MLX naming (depformer norms shared, as in PyTorch)."""
    return mx.load(str(LM_FIXTURES / "weights.safetensors"))


def test_7b_pytorch_layout_converts_to_the_mlx_manifest(pytorch_7b, mlx_7b):
    fmt, recipes = plan_conversion(pytorch_7b)
    assert fmt == "pytorch"
    assert len(pytorch_7b) == 355 and len(recipes) == 523
    assert {r.target: r.shape for r in recipes} == mlx_7b
    by_target = {r.target: r for r in recipes}
    # Slice k of a packed depformer projection is its k-th block of rows.
    in_proj = by_target["depformer.slices.5.transformer.layers.2.self_attn.in_proj.weight"]
    assert in_proj.source == "depformer.layers.2.self_attn.in_proj_weight"
    assert in_proj.rows == (5 * 3072, 6 * 3072)
    out_proj = by_target["depformer.slices.7.transformer.layers.0.self_attn.out_proj.weight"]
    assert out_proj.rows == (7 * 1024, 8 * 1024)
    assert by_target["depformer.slices.3.emb.weight"].source == "depformer_emb.2.weight"
    assert by_target["depformer.slices.0.emb.weight"].source == "depformer_text_emb.weight"
    shared = [r.target for r in recipes if r.source == "depformer.layers.4.norm2.alpha"]
    assert len(shared) == 8 and by_target[shared[0]].shape == (1024,)


def test_7b_newer_pytorch_spelling_gives_the_same_layout(pytorch_7b, mlx_7b):
    newer = {}
    for name, shape in pytorch_7b.items():
        if name.startswith("transformer.") and name.endswith("in_proj_weight"):
            newer[name.replace("in_proj_weight", "in_projs.0.weight")] = shape
        elif name.startswith("transformer.") and name.endswith("out_proj.weight"):
            newer[name.replace("out_proj.weight", "out_projs.0.weight")] = shape
        elif name.startswith("depformer.layers.") and "_proj" in name:
            base = name.removesuffix("_weight").removesuffix(".weight").replace("_proj", "_projs")
            for k in range(8):
                newer[f"{base}.{k}.weight"] = (shape[0] // 8, shape[1])
        else:
            newer[name] = shape
    assert len(newer) == 355 + 6 * 2 * 7
    assert convert_shapes(newer) == mlx_7b


def test_7b_mlx_layout_is_kept_and_packs_back_to_the_pytorch_manifest(pytorch_7b, mlx_7b):
    assert detect_format(mlx_7b) == "mlx"
    assert convert_shapes(mlx_7b) == mlx_7b
    lazy = {name: mx.zeros(shape, mx.bfloat16) for name, shape in mlx_7b.items()}  # never filled
    packed = to_pytorch_naming(lazy)
    assert {name: tuple(a.shape) for name, a in packed.items()} == pytorch_7b


def test_data_round_trips_through_the_pytorch_naming(fixture_weights):
    packed = to_pytorch_naming(fixture_weights)
    in_proj = np.array(packed["depformer.layers.1.self_attn.in_proj_weight"].astype(mx.float32))
    rows = 3 * 64  # q, k, v of one slice of the tiny depformer
    assert in_proj.shape == (8 * rows, 64)
    slice_3 = fixture_weights["depformer.slices.3.transformer.layers.1.self_attn.in_proj.weight"]
    np.testing.assert_array_equal(
        in_proj[3 * rows : 4 * rows], np.array(slice_3.astype(mx.float32))
    )
    assert packed["out_norm.alpha"].shape == (1, 1, 64)
    back = to_mlx_naming(packed)
    assert set(back) == set(fixture_weights)
    for name, array in fixture_weights.items():
        assert back[name].shape == array.shape
        assert mx.array_equal(back[name], array).item(), name


def test_unknown_or_incomplete_checkpoints_are_clear_errors(pytorch_7b):
    with pytest.raises(WeightsError, match=r"out_norm\.alpha.*out_norm\.weight"):
        plan_conversion({"encoder.conv.weight": (4, 4)}, "mimi.safetensors")
    with pytest.raises(WeightsError, match="already quantized"):
        plan_conversion({"out_norm.weight": (64,), "text_emb.scales": (101, 2)})
    with pytest.raises(WeightsError, match=r"lora_A\.weight"):
        plan_conversion(pytorch_7b | {"transformer.layers.0.self_attn.lora_A.weight": (8, 4096)})
    without_layer = {n: s for n, s in pytorch_7b.items() if not n.startswith("linears.7.")}
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) depformer\.slices\.7\.linear_out"):
        plan_conversion(without_layer)
    gap = {n: s for n, s in pytorch_7b.items() if not n.startswith("transformer.layers.5.")}
    with pytest.raises(WeightsError, match=r"layer indices .* are not 0\.\.N-1"):
        plan_conversion(gap)
    bad_rows = pytorch_7b | {"depformer.layers.0.self_attn.in_proj_weight": (3001, 1024)}
    with pytest.raises(WeightsError, match="not a multiple of the 8 depformer weight sets"):
        plan_conversion(bad_rows)
    both = pytorch_7b | {"transformer.layers.0.self_attn.in_projs.0.weight": (12288, 4096)}
    with pytest.raises(WeightsError, match="several tensors give"):
        plan_conversion(both)


def test_packing_refuses_slices_with_different_norms(fixture_weights):
    weights = dict(fixture_weights)
    name = "depformer.slices.2.transformer.layers.0.norm1.weight"
    weights[name] = weights[name] * 2
    with pytest.raises(WeightsError, match="copies of depformer.layers.0.norm1.alpha differ"):
        to_pytorch_naming(weights)


_REFERENCE_SCRIPT = """
import sys
import numpy as np
import torch
from safetensors.torch import load_file, save_file
sys.path.insert(0, sys.argv[1])
from make_lm_fixtures import TINY_CONFIG, build_model
from moshi.models.lm import LMModel

golden = np.load(sys.argv[2])
model = LMModel(dtype=torch.float32, **TINY_CONFIG).eval()
model.load_state_dict(load_file(sys.argv[3]), strict=True)  # legacy packed names
with torch.no_grad():
    out, text = model.forward_text(torch.from_numpy(golden["tf_tokens"][None]).long())
    dep_seq = torch.zeros((1, model.num_codebooks, out.shape[1]), dtype=torch.long)
    dep_seq[:, : model.dep_q] = torch.from_numpy(golden["tf_dep_prev"]).long()
    dep = model.forward_depformer_training(dep_seq, out)[0].permute(1, 0, 2)
for ours, ref in ((text[0, 0].numpy(), golden["tf_text_logits"]),
                  (dep.numpy(), golden["tf_dep_logits"])):
    print(float(np.abs(ours - ref).max() / np.abs(ref).max()))
state = {k: v.to(torch.bfloat16).contiguous() for k, v in build_model().state_dict().items()}
save_file(state, sys.argv[4])  # the reference's own (newer) spelling: in_projs.{k}.weight
"""


@needs_reference
def test_packed_layout_is_what_the_pytorch_reference_loads(tmp_path, fixture_weights):
    """Our packed file loads into Kyutai's PyTorch LMModel and reproduces its golden logits; the
    reference's own state_dict converts to exactly our fixture weights."""
    packed = tmp_path / "packed.safetensors"
    mx.save_safetensors(str(packed), to_pytorch_naming(fixture_weights))
    newer = tmp_path / "newer.safetensors"
    run = subprocess.run(
        [
            str(REFERENCE_PYTHON),
            "-c",
            textwrap.dedent(_REFERENCE_SCRIPT),
            str(REPO / "scripts"),
            str(LM_FIXTURES / "golden.npz"),
            str(packed),
            str(newer),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    text_error, depformer_error = (float(x) for x in run.stdout.split())
    assert text_error < 1e-5 and depformer_error < 1e-5
    converted = to_mlx_naming(mx.load(str(newer)))
    assert set(converted) == set(fixture_weights)
    for name, array in fixture_weights.items():
        assert mx.array_equal(converted[name], array).item(), name
