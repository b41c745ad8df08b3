"""Golden outputs of Kyutai's PyTorch reference for Hibiki-Zero, as the `hibiki-zero` package
drives it.

Run with the reference environment (torch + Kyutai's `moshi` 0.2.13 + `hibiki-zero` 0.0.4,
scripts/make_reference_envs.sh ref), from the repository root:

    /opt/venvs/ref/bin/python scripts/make_hibiki_zero_fixtures.py

It builds a tiny random `LMModel` in the layout of kyutai/hibiki-zero-3b-pytorch-bf16's
config.json (tests/fixtures/kyutai_configs/hibiki-zero-3b-pytorch-bf16.json): 32 audio streams
(16 generated, 16 of the source speech), grouped-query attention (`kv_repeat` 2), split-halves
RoPE (`rope_concat`) with `max_period` 20000, a LayerNorm on each depformer slice's output
(`depformer_norm`), 16 depformer slices over 9 weight sets
(`depformer_weights_per_step_schedule`), no conditioner; float32 with every weight a bfloat16
value, so the committed bf16 file is exact. Its `LMGen` comes from `hibiki_zero.inference.get_lmgen`
(the package's conditioning: none for a model without conditioners, cfg_coef 1), greedy.

tests/fixtures/hibiki_zero/ (dim 64, 4 heads over 2 key/value heads, 2 layers, context 16, so
the 60 steps run well past the attention window; depformer dim 32):
- config.json: the keys of the published config.json at tiny sizes,
- weights.safetensors: the LM (bf16) under Kyutai's PyTorch state_dict names, including
  `depformer_norms.{k}.{weight,bias}`; saved as a checkpoint is, before the loader's
  `model_type` "hibiki" rule (text_emb row 2 := row 3) that the goldens run with,
- tokenizer.model: the tiny SentencePiece of tests/fixtures/stt,
- golden.npz, with keys:
  - source_codes (STEPS, 16): the source speech's codes, one frame per call (STEPS 60); frame
    EOS_STEP (50) is the end-of-input frame of `hibiki_zero.inference.add_input_eos` (every
    code = card, 64),
  - input_tokens (STEPS, 33): what each call fed the temporal transformer (delays applied),
  - text_logits (STEPS, 100): the text logits of each call (`on_text_logits_hook`),
  - depformer_prev (STEPS, 16): the token each depformer slice was fed (text, then codebooks),
  - depformer_logits (STEPS, 16, 64): the logits of each depformer slice,
  - sampled_text (STEPS,), sampled_audio (STEPS, 16): the greedy tokens of each call,
  - tokens (STEPS, 17): what each `LMGen.step` returned (text + 16 audio, delays undone), -1
    where it returned None (the first 2 calls).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from fixture_weights import print_sizes
from hibiki_zero.inference import get_lmgen
from make_stt_fixtures import build_lm, recorded_calls, save_weights, train_tokenizer, write_config
from moshi.models.lm import LMModel

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"

# kyutai/hibiki-zero-3b-pytorch-bf16's structure at tiny sizes.
HIBIKI_ZERO_CONFIG = {
    "dim": 64,
    "text_card": 100,
    "existing_text_padding_id": 3,
    "n_q": 32,
    "dep_q": 16,
    "card": 64,
    "num_heads": 4,
    "kv_repeat": 2,
    "num_layers": 2,
    "hidden_scale": 6,
    "causal": True,
    "layer_scale": None,
    "context": 16,
    "max_period": 20000.0,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope_concat",
    "depformer_dim": 32,
    "depformer_num_heads": 4,
    "depformer_num_layers": 2,
    "depformer_dim_feedforward": None,
    "depformer_multi_linear": True,
    "depformer_weights_per_step": True,
    "depformer_norm": "layer_norm",
    "depformer_pos_emb": "none",
    "depformer_kv_repeat": 1,
    "depformer_weights_per_step_schedule": [0, 1, 2, 3, 4, 5, 6, 7] + [8] * 8,
    "demux_second_stream": False,
    "text_card_out": None,
    "delays": [0] + ([0] + [2] * 15) * 2,
    "conditioners": {},
    "cross_attention": False,
    "model_type": "hibiki",
    "mimi_name": "mimi-pytorch-e351c8d8@125.safetensors",
    "tokenizer_name": "tokenizer.model",
}
STEPS = 60
EOS_STEP = 50


def golden(model: LMModel, codes: np.ndarray) -> dict[str, np.ndarray]:
    """`LMGen.step` over the source frames, with what each call computed."""
    inputs, dep_prev, dep_logits = [], [], []
    checkpoint_info = SimpleNamespace(
        model_type=HIBIKI_ZERO_CONFIG["model_type"], lm_gen_config={"temp": 0.0, "temp_text": 0.0}
    )
    lm_gen = get_lmgen(model, checkpoint_info, batch_size=1)
    calls = recorded_calls(lm_gen)
    forward_text, forward_depformer = model.forward_text, model.forward_depformer

    def recorded_text(sequence, *args, **kwargs):
        inputs.append(sequence[0, :, 0].numpy().copy())
        return forward_text(sequence, *args, **kwargs)

    def recorded_depformer(cb_index, sequence, transformer_out):
        dep_prev.append(int(sequence[0, 0, 0]))
        logits = forward_depformer(cb_index, sequence, transformer_out)  # (B, 1, 1, card)
        dep_logits.append(logits[0, 0, 0].numpy().copy())
        return logits

    model.forward_text, model.forward_depformer = recorded_text, recorded_depformer
    tokens = np.full((len(codes), 1 + model.dep_q), -1, np.int32)
    try:
        with lm_gen.streaming(1):
            for index, frame in enumerate(codes):
                out = lm_gen.step(torch.from_numpy(frame)[None, :, None])
                if out is not None:
                    tokens[index] = out[0, :, 0].numpy()
    finally:
        del model.forward_text, model.forward_depformer
    dep_q = model.dep_q
    return {
        "source_codes": codes.astype(np.int32),
        "input_tokens": np.stack(inputs).astype(np.int32),
        "text_logits": np.stack(calls.text_logits).astype(np.float32),
        "depformer_prev": np.array(dep_prev, np.int32).reshape(len(codes), dep_q),
        "depformer_logits": np.stack(dep_logits).reshape(len(codes), dep_q, -1),
        "sampled_text": np.array(calls.sampled_text, np.int32),
        "sampled_audio": np.stack(calls.sampled_audio).astype(np.int32),
        "tokens": tokens,
    }


def main() -> None:
    torch.set_num_threads(1)
    out = FIXTURES / "hibiki_zero"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(train_tokenizer())
    write_config(HIBIKI_ZERO_CONFIG, out / "config.json")
    model = build_lm(HIBIKI_ZERO_CONFIG, seed=2040, boosted=(2, 3))
    with torch.no_grad():  # LayerNorm gains and biases away from their 1 and 0
        for norm in model.depformer_norms:
            norm.weight.copy_((1 + 0.2 * torch.randn_like(norm.weight)).bfloat16().float())
            norm.bias.copy_((0.2 * torch.randn_like(norm.bias)).bfloat16().float())
    save_weights(model, out / "weights.safetensors")
    # What CheckpointInfo.get_moshi does after loading a model_type "hibiki" checkpoint.
    with torch.no_grad():
        model.text_emb.weight.data[2] = model.text_emb.weight.data[3]
    source = HIBIKI_ZERO_CONFIG["n_q"] - HIBIKI_ZERO_CONFIG["dep_q"]
    card = HIBIKI_ZERO_CONFIG["card"]
    codes = np.random.default_rng(13).integers(0, card, (STEPS, source))
    codes[EOS_STEP] = card
    with torch.no_grad():
        result = golden(model, codes)
    np.savez_compressed(out / "golden.npz", **result)
    print(f"hibiki-zero: text {result['tokens'][:40, 0].tolist()}")
    print(f"  distinct audio tokens: {len(np.unique(result['sampled_audio']))}")
    print_sizes(out)


if __name__ == "__main__":
    sys.exit(main())
