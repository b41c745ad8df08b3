"""The Mimi checkpoint format: the published layout, strict loading, codebook precomputation."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from conftest import MIMI_MANIFEST
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from moshi_mlx.checkpoints.mimi import (
    CLUSTER_USAGE_EPS,
    load_mimi,
    mimi_tensor_table,
)
from moshi_mlx.errors import ConfigError, WeightsError
from moshi_mlx.models.mimi import Mimi, MimiConfig


def _manifest() -> dict[str, tuple[tuple[int, ...], str]]:
    rows = [line.split("\t") for line in MIMI_MANIFEST.read_text().splitlines()[1:]]
    return {name: (tuple(int(d) for d in shape.split(",")), dtype) for name, shape, dtype in rows}


def test_table_is_the_published_layout():
    table = {entry.name: entry.shape for entry in mimi_tensor_table(MimiConfig.moshi())}
    manifest = _manifest()
    assert len(manifest) == 318
    assert table == {name: shape for name, (shape, _) in manifest.items()}


def test_random_writer_matches_the_manifest(full_mimi_checkpoint):
    found = {}
    with safe_open(str(full_mimi_checkpoint), "np") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
            sliced = f.get_slice(name)
            found[name] = (tuple(sliced.get_shape()), sliced.get_dtype())
    dtype_names = {"F32": "float32"}
    found = {name: (shape, dtype_names[dtype]) for name, (shape, dtype) in found.items()}
    assert found == _manifest()


def test_full_model_loads_with_any_codebook_count(full_mimi_checkpoint):
    for num_codebooks in (1, 8, 32):
        mimi = load_mimi(full_mimi_checkpoint, num_codebooks=num_codebooks)
        assert mimi.num_codebooks == num_codebooks
    assert mimi.quantizer.acoustic.codebooks.shape == (31, 2048, 256)


def _tampered(tmp_path, source, edit) -> str:
    tensors = load_file(str(source))
    edit(tensors)
    path = tmp_path / "tampered.safetensors"
    save_file(tensors, str(path))
    return str(path)


def test_missing_tensor_is_named(tmp_path, tiny_mimi_checkpoint):
    source, config = tiny_mimi_checkpoint
    name = "decoder.model.0.conv.conv.bias"
    path = _tampered(tmp_path, source, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=f"{path}: missing tensor.*{name}"):
        load_mimi(path, config=config)


def test_unexpected_tensor_is_named(tmp_path, tiny_mimi_checkpoint):
    source, config = tiny_mimi_checkpoint
    path = _tampered(tmp_path, source, lambda t: t.update(extra=np.zeros(3, np.float32)))
    with pytest.raises(WeightsError, match="unexpected tensor.*extra"):
        load_mimi(path, config=config)


def test_wrong_shape_says_expected_and_found(tmp_path, tiny_mimi_checkpoint):
    source, config = tiny_mimi_checkpoint
    name = "encoder.model.3.conv.conv.weight"

    def edit(tensors):
        tensors[name] = np.zeros((8, 4, 7), np.float32)

    path = _tampered(tmp_path, source, edit)
    with pytest.raises(WeightsError, match=rf"{name} has shape \(8, 4, 7\), expected \(8, 4, 8\)"):
        load_mimi(path, config=config)


def test_published_config_rejects_a_small_file(tiny_mimi_checkpoint, tmp_path):
    """Given the published config, or taking it by default (a file whose metadata names no
    config), a small file is refused."""
    from safetensors.numpy import load_file, save_file

    source, _ = tiny_mimi_checkpoint
    with pytest.raises(WeightsError, match="tiny_mimi.safetensors: missing tensor"):
        load_mimi(source, config=MimiConfig.moshi())
    bare = tmp_path / "tiny_mimi.safetensors"
    save_file(load_file(str(source)), str(bare))  # without the config in its metadata
    with pytest.raises(WeightsError, match="tiny_mimi.safetensors: missing tensor"):
        load_mimi(bare)


def test_missing_file(tmp_path):
    with pytest.raises(WeightsError, match="not found"):
        load_mimi(tmp_path / "nope.safetensors")


def test_codebook_count_out_of_range():
    with pytest.raises(ConfigError, match="between 1 and 8, got 9"):
        Mimi(MimiConfig.tiny(), num_codebooks=9)


def test_codebooks_are_sums_over_clamped_usage(tmp_path, tiny_mimi_checkpoint):
    source, config = tiny_mimi_checkpoint
    usage_name = "quantizer.rvq_rest.vq.layers.2._codebook.cluster_usage"

    def edit(tensors):
        tensors[usage_name][:5] = 0.0  # never used: the reference clamps to epsilon

    path = _tampered(tmp_path, source, edit)
    tensors = load_file(path)
    mimi = load_mimi(path, num_codebooks=4, config=config)
    prefix = "quantizer.rvq_rest.vq.layers.2._codebook"
    usage = np.maximum(tensors[f"{prefix}.cluster_usage"], CLUSTER_USAGE_EPS)
    expected = tensors[f"{prefix}.embedding_sum"] / usage[:, None]
    np.testing.assert_allclose(np.array(mimi.quantizer.acoustic.codebooks[2]), expected, rtol=1e-6)
    assert mimi.quantizer.acoustic.codebooks.shape == (3, 64, 16)


def test_conv_layouts_are_converted_once(tiny_mimi_checkpoint):
    source, config = tiny_mimi_checkpoint
    tensors = load_file(str(source))
    mimi = load_mimi(source, config=config)
    conv = tensors["encoder.model.3.conv.conv.weight"]  # (out, in, k)
    np.testing.assert_array_equal(
        np.array(mimi.encoder.blocks[0].downsample.weight), conv.transpose(2, 1, 0)
    )
    convtr = tensors["decoder.model.2.convtr.convtr.weight"]  # (in, out, k)
    np.testing.assert_array_equal(
        np.array(mimi.decoder.blocks[0].upsample.weight), convtr.transpose(0, 2, 1)
    )
    linear = tensors["encoder_transformer.transformer.layers.1.linear1.weight"]
    np.testing.assert_array_equal(
        np.array(mimi.encoder_transformer.layers[1].linear1.weight), linear
    )
    assert mimi.encoder.init_conv.weight.dtype == mx.float32
