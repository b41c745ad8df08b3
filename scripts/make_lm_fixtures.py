"""Golden LM outputs from Kyutai's PyTorch reference, for tests/parity/test_lm_parity.py.

Run with the reference environment (torch + moshi), from the repository root:

    /opt/venvs/ref/bin/python scripts/make_lm_fixtures.py

It builds a tiny random `moshi.models.lm.LMModel` (float32, weights rounded to bfloat16 values
so the committed file can be bf16 and still exact), and writes to tests/fixtures/lm/:
- config.json: the model's config in Kyutai's format (equal to `LmConfig.tiny()`),
- weights.safetensors: its weights under the MLX names of Kyutai's published files,
- golden.npz: teacher-forced text and depformer logits, and a greedy `LMGen` stream.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import torch
from fixture_weights import round_to_bf16
from moshi.models.lm import LMGen, LMModel
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "lm"
TINY_CONFIG = {
    "dim": 64,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 3.0,
    "context": 16,
    "max_period": 10000.0,
    "positional_embedding": "rope",
    "norm": "rms_norm_f32",
    "gating": "silu",
    "causal": True,
    "layer_scale": None,
    "depformer_dim": 64,
    "depformer_num_heads": 4,
    "depformer_num_layers": 2,
    "depformer_dim_feedforward": 96,
    "depformer_context": 8,
    "depformer_max_period": 10000.0,
    "depformer_pos_emb": "none",
    "depformer_gating": "silu",
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_weights_per_step": True,
    "card": 64,
    "text_card": 100,
    "n_q": 16,
    "dep_q": 8,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
    "existing_text_padding_id": 3,
}
TEACHER_STEPS = 20
GREEDY_STEPS = 40

# PyTorch state_dict name -> MLX name; "{k}" is a depformer slice, norms shared by all slices.
_RULES = [
    (r"emb\.(\d+)\.weight", "audio_embs.{0}.weight"),
    (r"(transformer\.layers\.\d+\.self_attn)\.in_projs\.0\.weight", "{0}.in_proj.weight"),
    (r"(transformer\.layers\.\d+\.self_attn)\.out_projs\.0\.weight", "{0}.out_proj.weight"),
    (r"(transformer\.layers\.\d+\.norm\d|out_norm)\.alpha", "{0}.weight"),
    (r"depformer_in\.(\d+)\.weight", "depformer.slices.{0}.linear_in.weight"),
    (r"depformer_text_emb\.weight", "depformer.slices.0.emb.weight"),
    (r"linears\.(\d+)\.weight", "depformer.slices.{0}.linear_out.weight"),
    (
        r"depformer\.layers\.(\d+)\.self_attn\.(in|out)_projs\.(\d+)\.weight",
        "depformer.slices.{2}.transformer.layers.{0}.self_attn.{1}_proj.weight",
    ),
    (
        r"depformer\.layers\.(\d+)\.gating\.(\d+)\.(linear_in|linear_out)\.weight",
        "depformer.slices.{1}.transformer.layers.{0}.gating.{2}.weight",
    ),
    (r"(transformer\.layers\.\d+\.gating\.linear_(?:in|out)\.weight)", "{0}"),
    (r"(text_emb\.weight|text_linear\.weight)", "{0}"),
]


def to_mlx_names(state: dict[str, torch.Tensor], dep_q: int) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        shared = re.fullmatch(r"depformer\.layers\.(\d+)\.(norm\d)\.alpha", name)
        dep_emb = re.fullmatch(r"depformer_emb\.(\d+)\.weight", name)
        if shared:
            for k in range(dep_q):
                layer, norm = shared.groups()
                out[f"depformer.slices.{k}.transformer.layers.{layer}.{norm}.weight"] = (
                    tensor.reshape(-1)
                )
        elif dep_emb:
            out[f"depformer.slices.{int(dep_emb.group(1)) + 1}.emb.weight"] = tensor
        else:
            for pattern, target in _RULES:
                match = re.fullmatch(pattern, name)
                if match:
                    out[target.format(*match.groups())] = tensor.reshape(
                        -1 if name.endswith(".alpha") else tensor.shape
                    )
                    break
            else:
                raise KeyError(f"no MLX name for {name}")
    return out


def build_model() -> LMModel:
    torch.manual_seed(1234)
    return round_to_bf16(LMModel(dtype=torch.float32, **TINY_CONFIG))


def teacher_forcing(model: LMModel, rng: np.random.Generator) -> dict[str, np.ndarray]:
    k, steps = model.num_codebooks, TEACHER_STEPS
    tokens = np.concatenate(
        [
            rng.integers(0, model.text_card, (1, 1, steps)),
            rng.integers(0, model.card, (1, k - 1, steps)),
        ],
        axis=1,
    )
    tokens[:, :, 0] = [model.text_card] + [model.card] * (k - 1)  # start tokens
    tokens[0, 3, 5] = tokens[0, 12, 7] = tokens[0, 0, 9] = -1  # "no input"
    dep_prev = np.concatenate(
        [
            rng.integers(0, model.text_card, (1, 1, steps)),
            rng.integers(0, model.card, (1, model.dep_q - 1, steps)),
        ],
        axis=1,
    )
    with torch.no_grad():
        out, text_logits = model.forward_text(torch.from_numpy(tokens))
        dep_seq = torch.zeros((1, k, steps), dtype=torch.long)
        dep_seq[:, : model.dep_q] = torch.from_numpy(dep_prev)
        dep_logits = model.forward_depformer_training(dep_seq, out)  # (1, dep_q, T, card)
    return {
        "tf_tokens": tokens[0].astype(np.int32),  # (K, T)
        "tf_dep_prev": dep_prev[0].astype(np.int32),  # (dep_q, T)
        "tf_text_logits": text_logits[0, 0].numpy(),  # (T, text_card)
        "tf_dep_logits": dep_logits[0].permute(1, 0, 2).numpy(),  # (T, dep_q, card)
    }


def greedy(model: LMModel, rng: np.random.Generator) -> dict[str, np.ndarray]:
    num_user = model.n_q - model.dep_q
    user = rng.integers(0, model.card, (GREEDY_STEPS, num_user))
    user[11, 2] = -1
    texts, audios, outs = [], [], []
    gen = LMGen(
        model,
        use_sampling=False,
        on_text_hook=lambda t: texts.append(int(t[0])),
        on_audio_hook=lambda a: audios.append(a[0].numpy().copy()),
    )
    with gen.streaming(1):
        for codes in user:
            out = gen.step(torch.from_numpy(codes)[None, :, None])
            outs.append(np.full(1 + model.dep_q, -2) if out is None else out[0, :, 0].numpy())
    return {
        "greedy_user": user.astype(np.int32),
        "greedy_text": np.array(texts, np.int32),  # sampled at each step
        "greedy_audio": np.stack(audios).astype(np.int32),  # depformer output at each step
        "greedy_out": np.stack(outs).astype(np.int32),  # LMGen.step output (aligned), -2 = none
    }


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    model = build_model()
    weights = to_mlx_names(model.state_dict(), model.dep_q)
    save_file(
        {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()},
        str(OUT / "weights.safetensors"),
    )
    (OUT / "config.json").write_text(json.dumps(TINY_CONFIG, indent=2))
    rng = np.random.default_rng(0)
    golden = teacher_forcing(model, rng) | greedy(model, rng)
    np.savez_compressed(OUT / "golden.npz", **golden)
    print("greedy text:", golden["greedy_text"].tolist())
    print("distinct audio codes:", len(np.unique(golden["greedy_audio"])))
    print("wrote", sorted(p.name for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
