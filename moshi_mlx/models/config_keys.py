"""The keys of Kyutai's `config.json` that `LmConfig` checks rather than reads: those whose
value is fixed by what this model implements, those every config must have, and the checks
on their values."""

from __future__ import annotations

from typing import Any

from moshi_mlx.errors import ConfigError

# Keys of Kyutai's config.json that change the architecture in ways this model does not
# implement, with the only value accepted for each (None also accepts false, 0 and {}).
FIXED_KEYS: dict[str, Any] = {
    "causal": True,
    "depformer_causal": True,
    "layer_scale": None,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_weights_per_step": True,
    "norm_emb": False,
    "bias_proj": False,
    "bias_ff": False,
    "bias_attn": False,
    "depformer_kv_repeat": 1,
    "depformer_gating": "silu",
    "lora_name": None,
    "mimi_config_name": None,
}
# The fixed keys written out by `to_dict`, as the reference's defaults differ from Moshi's.
WRITTEN_FIXED_KEYS = (
    "causal",
    "layer_scale",
    "depformer_layer_scale",
    "depformer_multi_linear",
    "depformer_weights_per_step",
    "depformer_gating",
)
REQUIRED_KEYS = ("dim", "num_heads", "num_layers", "card", "text_card", "n_q", "dep_q", "delays")
DEPFORMER_KEYS = ("depformer_dim", "depformer_num_heads", "depformer_num_layers")


def is_personaplex_in_nvidia_terms(data: dict[str, Any]) -> bool:
    """Whether a config.json is PersonaPlex's as NVIDIA writes it: Kyutai's keys, a depformer
    over every audio stream (dep_q = n_q: Moshi's half, then the user's), and neither of our
    `user_codebooks` and `generator` keys that say so."""
    n_q, dep_q = data["n_q"], data["dep_q"]
    return (
        data.get("model_type", "moshi") == "moshi"
        and isinstance(n_q, int)
        and n_q > 0
        and n_q % 2 == 0
        and dep_q == n_q
        and "user_codebooks" not in data
        and "generator" not in data
        and not data.get("conditioners")
    )


def check_positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"LM config {name} must be a positive integer, got {value!r}")
