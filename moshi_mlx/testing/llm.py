"""A tiny random chat LLM in mlx-lm's layout (llama architecture, byte-level BPE tokenizer, a
ChatML chat template), for tests and benches: `write_tiny_llm(folder)`.

The tokenizer is trained here on a few sentences, so it needs no download; being byte-level it
encodes any text. The weights are random: the model speaks nonsense, deterministically, in
printable ASCII (the output layer's rows of the other tokens are zero, so their logits sit far
below the best ones) and rarely ends its turn by itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", EOS_TOKEN)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_CORPUS = (
    "Hello! How are you today? I am fine, thank you. What would you like to talk about?",
    "The weather is nice and the sun is shining. Let us go for a walk in the park.",
    "Speech models listen and answer in real time; text models write one token at a time.",
    "One, two, three, four, five. Numbers 0123456789 and punctuation: ; , . ! ? - ' \"",
)


def write_tiny_llm(
    folder: Path,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    num_layers: int = 2,
    max_positions: int = 2048,
    seed: int = 0,
) -> Path:
    """Write a random llama-architecture model that `mlx_lm.load(folder)` loads offline:
    config.json, model.safetensors, tokenizer.json, tokenizer_config.json. Returns `folder`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _write_tokenizer(folder, vocab_size)
    vocab = tokenizer.get_vocab()
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": len(vocab),
        "max_position_embeddings": max_positions,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        "bos_token_id": None,
        "eos_token_id": vocab[EOS_TOKEN],
    }
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    printable = [_is_printable(tokenizer.decode([i])) for i in range(len(vocab))]
    _write_weights(folder / "model.safetensors", config, printable, seed)
    return folder


def _is_printable(text: str) -> bool:
    return bool(text) and all(" " <= char <= "~" for char in text)


def _write_tokenizer(folder: Path, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "model_max_length": 2048,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return tokenizer


def _write_weights(path: Path, config: dict, printable: list[bool], seed: int) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    dim = config["hidden_size"]
    head_dim = dim // config["num_attention_heads"]
    kv_dim = head_dim * config["num_key_value_heads"]
    hidden = config["intermediate_size"]

    def linear(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    weights = {
        "model.embed_tokens.weight": linear(config["vocab_size"], dim),
        "model.norm.weight": np.ones(dim, np.float32),
        "lm_head.weight": linear(config["vocab_size"], dim),
    }
    scale = np.where(printable, 4.0, 0.0).astype(np.float32)
    scale[config["eos_token_id"]] = 1.0
    weights["lm_head.weight"] *= scale[:, None]
    for i in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{i}"
        weights |= {
            f"{prefix}.self_attn.q_proj.weight": linear(dim, dim),
            f"{prefix}.self_attn.k_proj.weight": linear(kv_dim, dim),
            f"{prefix}.self_attn.v_proj.weight": linear(kv_dim, dim),
            f"{prefix}.self_attn.o_proj.weight": linear(dim, dim),
            f"{prefix}.mlp.gate_proj.weight": linear(hidden, dim),
            f"{prefix}.mlp.up_proj.weight": linear(hidden, dim),
            f"{prefix}.mlp.down_proj.weight": linear(dim, hidden),
            f"{prefix}.input_layernorm.weight": np.ones(dim, np.float32),
            f"{prefix}.post_attention_layernorm.weight": np.ones(dim, np.float32),
        }
    save_file(weights, str(path), metadata={"format": "mlx"})
