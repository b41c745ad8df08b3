"""LmConfig reads Kyutai's config.json schema of every model of the family."""

import json
from pathlib import Path

import numpy as np
import pytest
from mlx.utils import tree_flatten

from moshi_mlx.errors import ConfigError
from moshi_mlx.models.config import LmConfig
from moshi_mlx.models.config_sections import GenDefaults, SttTiming
from moshi_mlx.models.lm import Lm

# Kyutai's kyutai/stt-2.6b-en, as its model card describes it (48 layers, dim 2048, context
# 375, no depformer, text 2.5 s behind the audio, 1 s of silence before a file).
STT_2B6 = {
    "moshi_name": "model.safetensors",
    "mimi_name": "mimi-pytorch-e351c8d8@125.safetensors",
    "tokenizer_name": "tokenizer_en_audio_4000.model",
    "model_type": "stt",
    "dim": 2048,
    "text_card": 4000,
    "existing_text_padding_id": 3,
    "n_q": 32,
    "dep_q": 0,
    "card": 2048,
    "num_heads": 32,
    "num_layers": 48,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 375,
    "max_period": 100000,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 1024,
    "depformer_num_heads": 16,
    "depformer_num_layers": 6,
    "depformer_dim_feedforward": 4224,
    "depformer_multi_linear": True,
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0] * 33,
    "extra_heads_num_heads": 0,
    "lm_gen_config": {"temp": 0.0, "temp_text": 0.0, "top_k": 250, "top_k_text": 50},
    "stt_config": {"audio_silence_prefix_seconds": 1.0, "audio_delay_seconds": 2.5},
}


def test_the_stt_schema_is_read_whole():
    config = LmConfig.from_dict(STT_2B6)
    assert (config.model_type, config.dep_q, config.n_q, config.num_user_codebooks) == (
        "stt",
        0,
        32,
        32,
    )
    assert config.stt_config == SttTiming(2.5, 1.0)
    assert config.lm_gen_config == GenDefaults(temp=0.0, temp_text=0.0, top_k=250, top_k_text=50)
    assert (config.mimi_name, config.tokenizer_name) == (
        "mimi-pytorch-e351c8d8@125.safetensors",
        "tokenizer_en_audio_4000.model",
    )
    assert LmConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"new_key": 1}, "key(s) moshi_mlx does not know: new_key"),
        ({"stt_config": {"audio_delay": 1}}, "stt_config has unknown key(s): audio_delay"),
        ({"lm_gen_config": {"temp": "hot"}}, "lm_gen_config has a value that is not a number"),
        ({"cross_attention": True}, "cross_attention must be true exactly when the fuser"),
        ({"model_type": "tts"}, "needs tts_config exactly when model_type is 'tts'"),
        ({"model_type": "speech"}, "model_type 'speech' is not supported"),
        ({"tts_config": {"audio_delay": "late"}}, "tts_config needs a numeric audio_delay"),
        ({"dep_q": 8}, "an STT model must have dep_q = 0"),
        ({"conditioners": {"x": {"type": "image"}}}, "conditioner 'x' of type 'image'"),
        ({"conditioners": {"x": {"type": "tensor"}}}, "conditioner 'x' is incomplete"),
        ({"extra_heads_num_heads": -1}, "extra_heads_num_heads must be an integer >= 0"),
        ({"lora_name": "lora.safetensors"}, "'lora_name' = 'lora.safetensors' is not supported"),
    ],
)
def test_an_unknown_key_or_unsupported_value_is_a_one_line_error(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        LmConfig.from_dict(STT_2B6 | change)
    assert "\n" not in str(err.value)


def test_an_stt_model_has_no_depformer_and_its_heads_give_probabilities():
    import mlx.core as mx

    from moshi_mlx.modules.linear import transpose_weights

    small = STT_2B6 | {"dim": 32, "num_heads": 2, "num_layers": 1, "text_card": 50, "card": 16}
    lm = Lm(LmConfig.from_dict(small | {"extra_heads_num_heads": 4, "extra_heads_dim": 6}))
    assert not hasattr(lm, "depformer") and len(lm.extra_heads) == 4
    probabilities = lm.head_probabilities(mx.ones((3, 32)))
    assert probabilities.shape == (3, 4, 6)
    assert mx.allclose(probabilities.sum(axis=-1), mx.ones((3, 4))).item()
    # Stacked for the step (one product for one row; several rows: one each): the same bits.
    lm.set_dtype(mx.bfloat16)
    outputs = [mx.random.normal((rows, 32), key=mx.random.key(rows)) for rows in (1, 3)]
    before = [lm.head_probabilities(x.astype(mx.bfloat16)) for x in outputs]
    mx.eval(transpose_weights(lm))
    assert lm.stacked_heads.holds(lm.extra_heads)
    after = [lm.head_probabilities(x.astype(mx.bfloat16)) for x in outputs]
    assert all(mx.array_equal(a, b).item() for a, b in zip(after, before))


def test_lut_conditioners_are_built_and_checked():
    lut = {"type": "lut", "lut": {"n_bins": 4, "dim": 8, "possible_values": ["a", "b"]}}
    hibiki_like = LmConfig.tiny().to_dict() | {
        "conditioners": {"description": lut},
        "fuser": {"sum": ["description"]},
    }
    config = LmConfig.from_dict(hibiki_like)
    assert LmConfig.from_dict(config.to_dict()) == config
    condition = Lm(config).condition([{"description": "b"}, {"description": "a"}])
    assert condition.shape == (2, config.dim)
    with pytest.raises(ConfigError, match="cannot be 'c': use one of a, b"):
        Lm(config).condition([{"description": "c"}])
    with pytest.raises(ConfigError, match="fuser 'sum' lists"):
        LmConfig.from_dict(hibiki_like | {"fuser": {"sum": []}})


def _tiny_stt(heads: int = 0) -> LmConfig:
    small = {"dim": 32, "num_heads": 2, "num_layers": 2, "text_card": 50, "card": 16}
    return LmConfig.from_dict(STT_2B6 | small | {"extra_heads_num_heads": heads})


@pytest.mark.parametrize("naming", ["mlx", "pytorch"])
def test_an_stt_checkpoint_loads_in_either_naming_with_the_heads_it_holds(tmp_path, naming):
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from safetensors.numpy import save_file

    from moshi_mlx.checkpoints.conversion import to_pytorch_naming
    from moshi_mlx.testing.checkpoints import load_lm, write_random_lm_checkpoint

    path = write_random_lm_checkpoint(tmp_path / "mlx", _tiny_stt(heads=4))
    written = load_lm(path, _tiny_stt(heads=4), dtype=mx.float32)
    if naming == "pytorch":
        tensors = dict(tree_flatten(written.parameters()))
        path = tmp_path / "model.safetensors"
        pytorch = to_pytorch_naming(tensors)
        save_file({k: np.ascontiguousarray(v) for k, v in pytorch.items()}, str(path))
    # The config says no heads (as Kyutai's STT configs do), the file holds 4: they load.
    lm = load_lm(path, _tiny_stt(heads=0), dtype=mx.float32)
    assert lm.config.extra_heads_num_heads == 4 and not hasattr(lm, "depformer")
    for (name, ours), (_, theirs) in zip(
        tree_flatten(lm.parameters()), tree_flatten(written.parameters()), strict=True
    ):
        assert mx.array_equal(ours, theirs).item(), name


def test_each_model_is_called_by_its_name():
    assert LmConfig.moshi_7b().model_name == "Moshi"
    assert LmConfig.personaplex_7b().model_name == "PersonaPlex"
    assert LmConfig.from_dict(STT_2B6).model_name == "Kyutai STT"
    hibiki = LmConfig.moshi_7b().to_dict() | {"model_type": "hibiki"}
    assert LmConfig.from_dict(hibiki).model_name == "Hibiki"


def test_personaplex_config_in_nvidias_terms_is_recognised():
    """NVIDIA's config.json has Kyutai's keys only: dep_q 16 = n_q (a depformer over Moshi's
    and the user's codebooks), none of our `user_codebooks` / `generator`."""
    ours = json.loads((Path(__file__).parents[1] / "fixtures/personaplex/config.json").read_text())
    nvidia = {k: v for k, v in ours.items() if k not in ("user_codebooks", "generator")}
    config = LmConfig.from_dict(nvidia)
    assert config == LmConfig.from_dict(ours)
    assert (config.moshi_codebooks, config.num_user_codebooks, config.prompted) == (8, 8, True)
    assert LmConfig.from_dict(LmConfig.personaplex_7b().to_dict()) == LmConfig.personaplex_7b()
    moshi = LmConfig.moshi_7b().to_dict()  # dep_q 8 of n_q 16: Moshi's, unchanged
    assert LmConfig.from_dict(moshi) == LmConfig.moshi_7b()


def test_hibiki_zero_published_config_is_read_whole():
    """kyutai/hibiki-zero-3b-pytorch-bf16 (reconstructed: tests/fixtures/kyutai_configs)."""
    path = Path(__file__).parents[1] / "fixtures/kyutai_configs/hibiki-zero-3b-pytorch-bf16.json"
    config = LmConfig.from_dict(json.loads(path.read_text()))
    assert config.model_name == "Hibiki-Zero"
    assert (config.num_layers, config.kv_repeat, config.kv_dim, config.max_period) == (
        28,
        2,
        1024,
        20000,
    )
    assert (config.positional_embedding, config.depformer_norm, config.text_card) == (
        "rope_concat",
        "layer_norm",
        48000,
    )
    assert (config.num_user_codebooks, config.moshi_codebooks, config.ffn_hidden) == (16, 16, 8192)
    assert LmConfig.from_dict(config.to_dict()) == config
    lm = Lm(config)  # lazily made: shapes only
    unique = {id(v): v.size for _, v in tree_flatten(lm.parameters())}  # shared once
    assert 3.0e9 < sum(unique.values()) < 3.2e9  # the model card's 3B
    assert lm.transformer.layers[0].self_attn.in_proj.weight.shape == (4096, 2048)
    for change, message in (
        ({"kv_repeat": 3}, "kv_repeat = 3 must divide num_heads = 16"),
        ({"depformer_norm": "rms_norm"}, "depformer_norm 'rms_norm' is not supported"),
        ({"depformer_kv_repeat": 2}, "'depformer_kv_repeat' = 2 is not supported"),
        ({"positional_embedding": "sin"}, "positional_embedding must be one of"),
    ):
        with pytest.raises(ConfigError, match=message):
            LmConfig.from_dict(config.to_dict() | change)


def test_tts_public_config_is_read_whole():
    """kyutai/tts-0.75b-en-public (reconstructed: tests/fixtures/kyutai_configs): its own text
    head, no conditions, 16 codebooks, guided by a null row."""
    path = Path(__file__).parents[1] / "fixtures/kyutai_configs/tts-0.75b-en-public.json"
    config = LmConfig.from_dict(json.loads(path.read_text()))
    assert (config.model_name, config.n_q, config.dep_q, config.text_vocab_out) == (
        "Kyutai TTS",
        16,
        16,
        5,
    )
    assert (config.conditioners, config.cross_attention, config.direct_guidance) == (
        (),
        False,
        True,
    )
    assert LmConfig.from_dict(config.to_dict()) == config
    assert LmConfig.from_dict(config.to_dict() | {"fuser": {"sum": [], "cross": []}}) == config
    lm = Lm(config)  # lazily made: shapes only
    assert lm.text_linear.weight.shape == (5, 1024)
    unique = {id(v): v.size for _, v in tree_flatten(lm.parameters())}  # shared once
    assert 0.7e9 < sum(unique.values()) < 0.85e9  # the model card's 0.75B
    with pytest.raises(ConfigError, match="text_card_out must be a positive integer"):
        LmConfig.from_dict(config.to_dict() | {"text_card_out": 0})
    with pytest.raises(ConfigError, match="does not know: voices"):
        LmConfig.from_dict(config.to_dict() | {"voices": 1})
