"""LmConfig, the 7B parameter layout against the published manifests, and the model's math."""

import mlx.core as mx
import numpy as np
import pytest
from conftest import MANIFESTS
from mlx.utils import tree_flatten

from moshi_mlx.chat.teacher_forcing import depformer_logits
from moshi_mlx.errors import ConfigError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.linear import transpose_weights
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.testing.checkpoints import lazy_lm, load_lm


def _manifest(name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    rows = (MANIFESTS / name).read_text().splitlines()[1:]
    out = {}
    for row in rows:
        tensor, shape, dtype = row.split("\t")
        out[tensor] = (tuple(int(s) for s in shape.split(",")), dtype)
    return out


@pytest.mark.parametrize(
    "manifest, bits, group_size",
    [
        ("moshiko_mlx_bf16.tsv", None, None),
        ("moshiko_mlx_q8.tsv", 8, 64),
        ("moshiko_mlx_q4.tsv", 4, 32),
    ],
)
def test_7b_parameters_equal_published_manifest(manifest, bits, group_size):
    before = mx.get_active_memory()  # what earlier tests of this process still hold
    model = lazy_lm(LmConfig.moshi_7b(), bits=bits, group_size=group_size)  # lazy: no eval
    ours = {
        name: (tuple(p.shape), str(p.dtype).removeprefix("mlx.core."))
        for name, p in tree_flatten(model.parameters())
    }
    expected = _manifest(manifest)
    assert sorted(set(ours) ^ set(expected)) == []
    assert {n: ours[n] for n in ours if ours[n] != expected[n]} == {}
    assert mx.get_active_memory() - before < 1e9  # nothing of the 7B was materialized


def test_7b_preset_numbers():
    config = LmConfig.moshi_7b()
    assert config.ffn_hidden == 11264
    assert config.depformer_ffn_hidden == 2816
    assert config.temporal_config().norm_eps == 1e-8
    assert (config.context, config.depformer_config().context, config.max_delay) == (3000, 8, 1)
    assert config.delays == (0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1)


def test_ffn_hidden_follows_reference_rule():
    base = LmConfig.tiny().to_dict()
    assert LmConfig.from_dict(base | {"hidden_scale": 4}).ffn_hidden == 21 * 64 // 8
    assert LmConfig.from_dict(base | {"hidden_scale": 4.5}).ffn_hidden == 2 * 288 // 3


@pytest.mark.parametrize("preset", [LmConfig.moshi_7b, LmConfig.tiny])
def test_config_round_trip(preset):
    config = preset()
    data = config.to_dict()
    assert data["delays"] == list(config.delays)
    assert data["depformer_weights_per_step"] is True
    assert LmConfig.from_dict(data) == config


def test_from_dict_kyutai_keys_and_defaults():
    data = {
        "dim": 4096,
        "text_card": 32000,
        "existing_text_padding_id": 3,
        "n_q": 16,
        "dep_q": 8,
        "card": 2048,
        "num_heads": 32,
        "num_layers": 32,
        "hidden_scale": 4.125,
        "causal": True,
        "layer_scale": None,
        "context": 3000,
        "max_period": 10000,
        "gating": "silu",
        "norm": "rms_norm_f32",
        "positional_embedding": "rope",
        "depformer_dim": 1024,
        "depformer_dim_feedforward": 4224,
        "depformer_num_heads": 16,
        "depformer_num_layers": 6,
        "depformer_layer_scale": None,
        "depformer_multi_linear": True,
        "depformer_context": 8,
        "depformer_max_period": 10000,
        "depformer_gating": "silu",
        "depformer_pos_emb": "none",
        "depformer_weights_per_step": True,
        "delays": [0, 0] + [1] * 7 + [0] + [1] * 7,
        "moshi_name": "model.q4.safetensors",
        "model_type": "moshi",
        "lm_gen_config": {},
        "conditioners": {},
    }
    config = LmConfig.from_dict(data)
    assert config.moshi_name == "model.q4.safetensors"
    assert config.to_dict() | {"moshi_name": "model.safetensors"} == LmConfig.moshi_7b().to_dict()


@pytest.mark.parametrize(
    "change, message",
    [
        ({"delays": [0] * 16}, "delays"),
        ({"dim": 66}, "heads"),
        ({"depformer_num_heads": 3}, "heads"),
        ({"norm": "layer_norm"}, "norm"),
        ({"gating": "gelu"}, "gating"),
        ({"positional_embedding": "sin"}, "positional_embedding"),
        ({"dep_q": 20}, "dep_q"),
        ({"num_layers": 0}, "num_layers"),
        ({"card": "2048"}, "card"),
        ({"depformer_weights_per_step": False}, "depformer_weights_per_step"),
        ({"layer_scale": 0.1}, "layer_scale"),
        ({"conditioners": {"a": {}}}, "conditioner 'a'"),
        ({"existing_text_padding_id": 100}, "padding"),
    ],
)
def test_invalid_configs_raise_config_error(change, message):
    with pytest.raises(ConfigError, match=message):
        LmConfig.from_dict(LmConfig.tiny().to_dict() | change)


def test_missing_key_is_named():
    data = LmConfig.tiny().to_dict()
    del data["card"]
    with pytest.raises(ConfigError, match="card"):
        LmConfig.from_dict(data)


def _random_tokens(config: LmConfig, steps: int, seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    text = rng.integers(0, config.text_card + 1, (1, 1, steps))
    audio = rng.integers(0, config.card + 1, (1, config.n_q, steps))
    return mx.array(np.concatenate([text, audio], axis=1).astype(np.int32))


def test_zero_token_embeds_to_zero():
    config = LmConfig.tiny()
    lm = Lm(config)
    tokens = mx.full((1, config.num_codebooks, 1), -1, mx.int32)
    assert mx.abs(lm.embed(tokens)).max().item() == 0.0
    one = tokens.at[:, 3].add(6)  # audio codebook 2, token 5
    expected = lm.audio_embs[2].weight[5]
    assert mx.allclose(lm.embed(one)[0, 0], expected).item()


@pytest.mark.parametrize("quant", ["bf16", "q4"])
def test_stacked_streams_embed_as_their_tables(tiny_lm_checkpoints, quant):
    """Once `transpose_weights` stacks the text and audio tables, the input embeddings of
    several positions and of one position (-1, "no input", included), with a batch axis or
    one row without it (its sum kept as (1, dim)), are the tables' own, bit for bit."""
    lm = load_lm(tiny_lm_checkpoints[quant])
    tokens = _random_tokens(lm.config, steps=5) - 1  # some -1
    before = lm.embed(tokens), lm.embed(tokens[:, :, 2]), lm.embed(tokens[0, :, 2])
    mx.eval(transpose_weights(lm))
    assert lm.stacked_tables.holds(lm.tables)
    after = lm.embed(tokens), lm.embed(tokens[:, :, 2]), lm.embed(tokens[0, :, 2])
    assert after[1].shape == after[2].shape == (1, lm.config.dim)
    assert all(mx.array_equal(a, b).item() for a, b in zip(after, before))
    assert mx.array_equal(after[2], before[1]).item()


def test_a_prefill_leaves_the_ring_as_steps_do():
    """Prefill (many tokens in one call) leaves the KV ring as stepping them does: the steps
    after it give the same outputs, past the context."""
    config = LmConfig.tiny()
    lm = Lm(config)
    tokens = _random_tokens(config, steps=40)
    prefix = config.context - 1  # the most one prefill takes
    prefilled = lm.prefill(lm.embed(tokens[:, :, :prefix]), lm.make_ring())
    stepped = lm.make_ring()
    for t in range(40):
        stepped = stepped.grown(t)
        logits = lm.step_text(tokens[:, :, t : t + 1], stepped)[1]
        stepped = stepped.advanced()
        if t >= prefix:
            prefilled = prefilled.grown(t)
            after_prefill = lm.step_text(tokens[:, :, t : t + 1], prefilled)[1]
            prefilled = prefilled.advanced()
            np.testing.assert_allclose(
                np.array(after_prefill), np.array(logits), rtol=1e-5, atol=1e-5
            )


def test_depformer_slices_attend_to_the_earlier_slices_of_their_step():
    config = LmConfig.tiny()
    lm = Lm(config)
    temporal = mx.random.normal((1, config.dim), key=mx.random.key(0))
    prev = mx.array([[5, 1, 2, 3, 4, 5, 6, 7]])
    logits = depformer_logits(lm.depformer, temporal, prev)
    assert logits.shape == (1, config.dep_q, config.card)
    # Slice 3 sees slices 0..2: changing slice 0's input changes slice 3's logits.
    other = depformer_logits(lm.depformer, temporal, prev.at[0, 0].add(1))
    assert not mx.allclose(logits[0, 3], other[0, 3]).item()
    # ... but never the later ones: slice 2's logits do not depend on token 3.
    later = depformer_logits(lm.depformer, temporal, prev.at[0, 3].add(1))
    assert mx.allclose(logits[0, 2], later[0, 2]).item()


@pytest.mark.parametrize("quant", ["bf16", "q4"])
def test_depformer_step_forms_give_the_same_logits(tiny_lm_checkpoints, quant):
    """`transpose_weights` stacks the slices' input projections (one product per step) and
    dequantizes the quantized audio tables once (slice 0's text table stays quantized): the
    slices' logits are the same, bit for bit; a replaced table is looked up quantized again,
    a replaced projection computed alone."""
    lm = load_lm(tiny_lm_checkpoints[quant])
    depformer = lm.depformer
    temporal = mx.random.normal((2, lm.config.dim), key=mx.random.key(0)).astype(mx.bfloat16)

    def logits() -> mx.array:
        captured = []

        def sample(slice_logits: mx.array, k: int) -> mx.array:
            captured.append(slice_logits)
            return GREEDY.sample_column(slice_logits, None)

        depformer.sample_step(temporal, mx.array([3, 7]), sample, text_sampled=True)
        return mx.stack(captured)

    before = logits()
    mx.eval(transpose_weights(lm))
    assert depformer.stacked_inputs.holds(depformer.input_linears())
    tables = [s.step_table for s in depformer.slices]
    assert tables[0] is None
    shape = (lm.config.card + 1, lm.config.depformer_dim)
    assert all((t.view.shape == shape) if quant == "q4" else t is None for t in tables[1:])
    assert mx.array_equal(logits(), before).item()
    depformer.slices[1].emb.weight = mx.array(depformer.slices[1].emb.weight)  # replaced
    depformer.slices[2].linear_in.weight = mx.array(depformer.slices[2].linear_in.weight)
    assert not depformer.stacked_inputs.holds(depformer.input_linears())
    assert mx.array_equal(logits(), before).item()
