"""Tiny random LM checkpoints in the published formats: writing, strict loading, detection."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors import safe_open

from moshi_mlx.checkpoints.header import compute_dtype, detect_quantization, parameter_count
from moshi_mlx.checkpoints.io import layout_of
from moshi_mlx.errors import ConfigError, WeightsError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.testing.checkpoints import load_lm, write_random_lm_checkpoint


def _forward(lm, steps: int = 6) -> np.ndarray:
    config = lm.config
    rng = np.random.default_rng(3)
    tokens = np.concatenate(
        [
            rng.integers(0, config.text_card, (1, 1, steps)),
            rng.integers(0, config.card, (1, 16, steps)),
        ],
        axis=1,
    )
    ring, logits = lm.make_ring(), []
    for t in range(steps):
        ring = ring.grown(t)
        logits.append(lm.step_text(mx.array(tokens[:, :, t : t + 1].astype(np.int32)), ring)[1])
        ring = ring.advanced()
    return np.array(mx.stack(logits, axis=1).astype(mx.float32))


def test_a_folder_with_several_lm_files_loads_the_most_precise(tiny_lm_checkpoints, tmp_path):
    """As after `python -m moshi_mlx quantize` wrote a q4 file beside the bf16 one."""
    for variant in ("q4", "bf16"):
        source = tiny_lm_checkpoints[variant]
        (tmp_path / source.name).symlink_to(source)
    (tmp_path / "config.json").symlink_to(tiny_lm_checkpoints["bf16"].parent / "config.json")
    lm = load_lm(tmp_path)
    assert lm.text_linear.weight.dtype != mx.uint32  # the bf16 file's, not q4's packed one


@pytest.mark.parametrize(
    "variant, bits, group_size", [("bf16", None, None), ("q8", 8, 64), ("q4", 4, 32)]
)
def test_random_checkpoints_load_strictly(tiny_lm_checkpoints, variant, bits, group_size):
    path = tiny_lm_checkpoints[variant]
    assert path.name == ("model.safetensors" if bits is None else f"model.q{bits}.safetensors")
    tensors, metadata = mx.load(str(path), return_metadata=True)
    config = LmConfig.tiny()
    assert detect_quantization(layout_of(tensors), metadata, Lm(config), str(path)) == (
        None if bits is None else (bits, group_size)
    )
    lm = load_lm(path.parent)  # directory + config.json beside the file
    assert lm.config == config
    params = dict(tree_flatten(lm.parameters()))
    assert params.keys() == tensors.keys()
    expected = compute_dtype(parameter_count(Lm(config)), quantized=bits is not None)
    if bits is None:
        assert all(p.dtype == expected for p in params.values())
    else:
        assert params["text_linear.weight"].dtype == mx.uint32
        assert params["depformer.slices.3.emb.scales"].shape == (config.card + 1, 64 // group_size)
        assert params["out_norm.weight"].dtype == expected
    assert load_lm(path.parent, dtype=mx.bfloat16).out_norm.weight.dtype == mx.bfloat16


def test_compute_dtype_policy():
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    tiny, big = parameter_count(Lm(LmConfig.tiny())), parameter_count(Lm(LmConfig.moshi_7b()))
    # On the CPU: float32 for quantized files and whatever fits; 7B bf16 (30 GB in float32)
    # stays bf16 on a machine with less than 60 GB. On a GPU: bf16 always.
    assert compute_dtype(tiny, quantized=True) == (mx.float32 if on_cpu else mx.bfloat16)
    assert compute_dtype(tiny, quantized=False) == (mx.float32 if on_cpu else mx.bfloat16)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if memory < 60e9:
        assert compute_dtype(big, quantized=False) == mx.bfloat16


def test_quantized_logits_track_bf16(tiny_lm_checkpoints):
    reference = _forward(load_lm(tiny_lm_checkpoints["bf16"], dtype=mx.float32))
    scale = np.abs(reference).max()
    for variant, tolerance in (("q8", 0.05), ("q4", 0.5)):
        quantized = _forward(load_lm(tiny_lm_checkpoints[variant], dtype=mx.float32))
        error = np.abs(quantized - reference).max() / scale
        assert 0 < error < tolerance, (variant, error)


def test_quantization_metadata_is_honoured_and_checked(tiny_lm_checkpoints, tmp_path):
    tensors = mx.load(str(tiny_lm_checkpoints["q4"]))
    good = tmp_path / "good.safetensors"
    mx.save_safetensors(
        str(good), tensors, {"quantization_bits": "4", "quantization_group_size": "32"}
    )
    assert load_lm(good, LmConfig.tiny()).config == LmConfig.tiny()
    bad = tmp_path / "bad.safetensors"
    mx.save_safetensors(
        str(bad), tensors, {"quantization_bits": "8", "quantization_group_size": "64"}
    )
    with pytest.raises(WeightsError, match="bad.safetensors.*8-bit"):
        load_lm(bad, LmConfig.tiny())
    plain = tmp_path / "plain.safetensors"
    mx.save_safetensors(
        str(plain), mx.load(str(tiny_lm_checkpoints["bf16"])), {"quantization_bits": "4"}
    )
    with pytest.raises(WeightsError, match="plain.safetensors.*no tensor is"):
        load_lm(plain, LmConfig.tiny())


def _rewrite(source, tmp_path, edit):
    tensors = dict(mx.load(str(source)))
    edit(tensors)
    path = tmp_path / "edited.safetensors"
    mx.save_safetensors(str(path), tensors)
    return path


@pytest.mark.parametrize("variant", ["bf16", "q4"])
def test_strict_load_names_missing_tensor(tiny_lm_checkpoints, tmp_path, variant):
    name = "depformer.slices.5.transformer.layers.1.gating.linear_out.weight"
    path = _rewrite(tiny_lm_checkpoints[variant], tmp_path, lambda t: t.pop(name))
    with pytest.raises(WeightsError, match=rf"edited.safetensors: missing tensor\(s\) {name}"):
        load_lm(path, LmConfig.tiny())


@pytest.mark.parametrize(
    ("name", "match"),
    [
        (
            "depformer.slices.8.linear_in.weight",
            r"unexpected tensor\(s\) depformer.slices.8.linear_in",
        ),
        (
            "audio_embs.4.weight",
            r"audio_embs.4.weight has shape \(64, 64\), expected \(65, 64\)",
        ),
    ],
    ids=["unexpected", "mis-shaped"],
)
def test_strict_load_names_unexpected_or_mis_shaped_tensor(
    tiny_lm_checkpoints, tmp_path, name, match
):
    path = _rewrite(
        tiny_lm_checkpoints["bf16"], tmp_path, lambda t: t.update({name: mx.zeros((64, 64))})
    )
    with pytest.raises(WeightsError, match=match):
        load_lm(path, LmConfig.tiny())


def test_wrong_config_for_file(tiny_lm_checkpoints):
    other = LmConfig.from_dict(LmConfig.tiny().to_dict() | {"num_layers": 3})
    with pytest.raises(WeightsError, match=r"missing tensor\(s\) transformer.layers.2"):
        load_lm(tiny_lm_checkpoints["bf16"], other)


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(WeightsError, match="not found"):
        load_lm(tmp_path / "nope.safetensors", LmConfig.tiny())
    with pytest.raises(WeightsError, match="has no model.q4.safetensors"):
        load_lm(tmp_path, LmConfig.tiny())
    write_random_lm_checkpoint(tmp_path, LmConfig.tiny(), write_config=True)
    (tmp_path / "config.json").write_text(json.dumps({"dim": 64}))
    with pytest.raises(ConfigError, match="missing key"):
        load_lm(tmp_path)


def test_random_checkpoint_is_seeded(tmp_path):
    a = write_random_lm_checkpoint(tmp_path / "a.safetensors", LmConfig.tiny(), seed=1)
    b = write_random_lm_checkpoint(tmp_path / "b.safetensors", LmConfig.tiny(), seed=1)
    c = write_random_lm_checkpoint(tmp_path / "c.safetensors", LmConfig.tiny(), seed=2)
    ta, tb, tc = (mx.load(str(p)) for p in (a, b, c))
    assert mx.array_equal(ta["text_emb.weight"], tb["text_emb.weight"]).item()
    assert not mx.array_equal(ta["text_emb.weight"], tc["text_emb.weight"]).item()
    with safe_open(a, "numpy") as independent_reader:  # the file follows the format
        assert set(independent_reader.keys()) == set(ta)
