"""Golden outputs of Kyutai's PyTorch reference for speech-to-text (STT) and Hibiki.

Run with the reference environment (torch + Kyutai's `moshi` 0.2.13), from the repository
root:

    /opt/venvs/ref/bin/python scripts/make_stt_fixtures.py

It builds two tiny random `LMModel`s in the layouts of Kyutai's published config.json files
(tests/fixtures/kyutai_configs/), float32 with every weight rounded to a bfloat16 value so the
committed bf16 files are exact, and runs Kyutai's `LMGen` greedily over fixed random codes.
Then it asks scripts/list_kyutai_mlx_names.py (run with /opt/venvs/kyutai, Kyutai's moshi_mlx
0.3.0) for the MLX parameter names of the same configs.

tests/fixtures/stt/ (kyutai/stt-1b-en_fr-candle's layout: n_q 32, dep_q 0, 4 extra heads of
dim 6; dim 64, 2 layers, context 16 so the KV ring wraps):
- config.json: the keys of a published STT config.json (model_type "stt", stt_config,
  lm_gen_config, mimi_name, tokenizer_name, extra_heads_*), delays all 0 as published,
- config_delayed.json: the same with delays [0, 0] + [2] * 31 (every published STT delay is
  0; this variant makes `LMGen.step` return None for its first 2 calls),
- weights.safetensors: the LM (bf16) under Kyutai's PyTorch state_dict names (`emb.{k}`,
  `text_emb`, `text_linear`, `transformer.layers.{l}.self_attn.in_projs.0.weight`, ...,
  `out_norm.alpha`, `extra_heads.{h}.weight`); both configs use it,
- tokenizer.model: a tiny SentencePiece (BPE, 100 pieces, <pad> = 3),
- golden.npz (config.json) and golden_delayed.npz (config_delayed.json), with keys:
  - codes (STEPS, 32): the fixed random Mimi codes of the STEPS audio frames (STEPS 100),
  - call_codes (STEPS + 1, 32): what each `LMGen.step_with_extra_heads` call was given, in
    order: frame 0 twice (run_inference.py's first-frame double step), then frames 1..99,
  - text_logits (STEPS + 1, 100): the text logits of each call (`on_text_logits_hook`),
  - sampled_text (STEPS + 1,): the greedy text token of each call (`on_text_hook`),
  - text_tokens (STEPS + 1,): the text token each call returned (delays undone), -1 where it
    returned None,
  - extra_heads (STEPS + 1, 4, 6): the softmax of each extra head, NaN where it returned None.

tests/fixtures/hibiki/ (kyutai/hibiki-1b-pytorch-bf16's layout: n_q 16, dep_q 8, delays
[0, 0, 2 x 7, 0, 2 x 7], a "description" LUT conditioner summed into the input; dim 64,
2 layers, context 16, depformer dim 32):
- config.json: the keys of a published Hibiki config.json (model_type "hibiki",
  conditioners, fuser, ...),
- weights.safetensors: the LM (bf16) under Kyutai's PyTorch names, including
  `condition_provider.conditioners.description.{embed.weight, output_proj.weight,
  learnt_padding}` (float32: Kyutai's loader keeps condition_provider.* in float32); saved as
  a checkpoint is, before the loader's Hibiki rule (text_emb row 2 := row 3) that the goldens
  run with,
- tokenizer.model: the tiny SentencePiece of tests/fixtures/stt,
- golden_cfg3.npz (cfg_coef 3.0: batch 2, conditions "very_good" then "very_bad") and
  golden_cfg1.npz (cfg_coef 1.0: batch 1, "very_good"), with keys:
  - source_codes (STEPS, 8): the French side's codes, one frame per call (STEPS 60); frame
    EOS_STEP (50) is the end-of-input frame run_inference.py sends (every code = card, 64),
  - condition (B, 1, 64): the summed condition tensor LMGen adds to the input (B 2 or 1),
  - text_logits (STEPS, 100): the guided text logits of each call (`on_text_logits_hook`),
  - sampled_text (STEPS,): the greedy text token of each call (`on_text_hook`),
  - depformer_logits (STEPS, 8, 64): the guided logits of each depformer step,
    `null + (cond - null) * cfg_coef` of the halves of `forward_depformer`'s output (the
    logits themselves with cfg_coef 1.0),
  - depformer_raw (STEPS, 8, B, 64): `forward_depformer`'s logits for both halves,
  - sampled_audio (STEPS, 8): the greedy depformer tokens of each call (`on_audio_hook`),
  - tokens (STEPS, 9): what each `LMGen.step` returned (text + 8 audio, delays undone), -1
    where it returned None (the first 2 calls).

tests/manifests/stt_tiny_mlx_names.tsv, hibiki_tiny_mlx_names.tsv: `name`, `shape` of every
parameter of Kyutai's moshi_mlx 0.3.0 `Lm(LmConfig.from_config_dict(config.json))`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import sentencepiece
import torch
from fixture_tokenizer import train_bpe_tokenizer
from fixture_weights import lm_kwargs, mlx_names, print_sizes, round_to_bf16
from moshi.conditioners import ConditionAttributes
from moshi.models import loaders
from moshi.models.lm import LMGen, LMModel
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
MANIFESTS = ROOT / "tests" / "manifests"

# Published STT structure (kyutai/stt-1b-en_fr-candle) at tiny sizes.
STT_CONFIG = {
    "dim": 64,
    "text_card": 100,
    "existing_text_padding_id": 3,
    "n_q": 32,
    "dep_q": 0,
    "card": 64,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 16,
    "max_period": 100000.0,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 32,
    "depformer_dim_feedforward": None,
    "depformer_num_heads": 4,
    "depformer_num_layers": 2,
    "depformer_multi_linear": True,
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0] * 33,
    "extra_heads_num_heads": 4,
    "extra_heads_dim": 6,
    "fuser": None,
    "model_type": "stt",
    "lm_gen_config": {"temp": 0.0, "temp_text": 0.0, "top_k": 250, "top_k_text": 50},
    "stt_config": {"audio_delay_seconds": 0.5, "audio_silence_prefix_seconds": 0.0},
    "mimi_name": "mimi-pytorch-e351c8d8@125.safetensors",
    "tokenizer_name": "tokenizer.model",
}
STT_DELAYED = [0, 0] + [2] * 31

# Published Hibiki 1B structure (kyutai/hibiki-1b-pytorch-bf16) at tiny sizes.
HIBIKI_CONFIG = {
    "dim": 64,
    "text_card": 100,
    "existing_text_padding_id": 3,
    "n_q": 16,
    "dep_q": 8,
    "card": 64,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 4.125,
    "causal": True,
    "layer_scale": None,
    "context": 16,
    "max_period": 100000.0,
    "gating": "silu",
    "norm": "rms_norm_f32",
    "positional_embedding": "rope",
    "depformer_dim": 32,
    "depformer_dim_feedforward": 132,  # int(4.125 * 32): Kyutai's MLX config needs a number
    "depformer_num_heads": 4,
    "depformer_num_layers": 2,
    "depformer_causal": True,
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_context": 8,
    "depformer_max_period": 10000.0,
    "depformer_gating": "silu",
    "depformer_pos_emb": "none",
    "depformer_weights_per_step": True,
    "delays": [0, 0, 2, 2, 2, 2, 2, 2, 2, 0, 2, 2, 2, 2, 2, 2, 2],
    "conditioners": {
        "description": {
            "type": "lut",
            "lut": {
                "n_bins": 31,
                "dim": 16,
                "tokenizer": "noop",
                "possible_values": ["very_bad", "bad", "neutral", "good", "very_good"],
            },
        }
    },
    "fuser": {"sum": ["description"]},
    "cross_attention": False,
    "model_type": "hibiki",
    "mimi_name": "mimi-pytorch-e351c8d8@125.safetensors",
    "tokenizer_name": "tokenizer.model",
}

SENTENCES = [
    "hello there how are you today",
    "bonjour tout le monde comment allez vous",
    "the quick brown fox jumps over the lazy dog",
    "je voudrais une crepe au sucre s'il vous plait",
    "what a nice day to talk about the weather",
    "il fait beau aujourd'hui et nous parlons du temps",
]

STT_STEPS = 100
HIBIKI_STEPS = 60
BOOST = 4.0
EOS_STEP = 50  # the Hibiki call fed run_inference.py's end-of-input frame (every code = card)


def train_tokenizer() -> bytes:
    return train_bpe_tokenizer(
        SENTENCES, STT_CONFIG["text_card"], STT_CONFIG["existing_text_padding_id"]
    )


def build_lm(config: dict, seed: int, boosted: tuple[int, ...]) -> LMModel:
    """Kyutai's get_moshi_lm without weights, randomized, every value a bf16 value.

    The text_linear rows of the `boosted` tokens are scaled by 4 (exact in bf16) so that a
    random model samples these special tokens (padding, end of padding, EOS) now and then.
    """
    torch.manual_seed(seed)
    model = round_to_bf16(
        loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs(config), dtype=torch.float32)
    )
    with torch.no_grad():
        model.text_linear.weight[list(boosted)] *= BOOST
    return model


def save_weights(model: LMModel, path: Path) -> None:
    """The state_dict in bf16, as published, but condition_provider.* in float32."""
    state = {
        name: (tensor if name.startswith("condition_provider.") else tensor.to(torch.bfloat16))
        for name, tensor in model.state_dict().items()
    }
    save_file({name: t.contiguous() for name, t in state.items()}, str(path))


def recorded_calls(lm_gen: LMGen) -> SimpleNamespace:
    """Hooks on `lm_gen` that append what each call computed for batch row 0 to the lists
    returned: `text_logits` (text_card,), `sampled_text` (ints), `sampled_audio` (dep_q,)."""
    calls = SimpleNamespace(text_logits=[], sampled_text=[], sampled_audio=[])
    lm_gen.on_text_logits_hook = lambda logits: calls.text_logits.append(
        logits[0, 0, 0].numpy().copy()
    )
    lm_gen.on_text_hook = lambda token: calls.sampled_text.append(int(token[0]))
    lm_gen.on_audio_hook = lambda tokens: calls.sampled_audio.append(tokens[0].numpy().copy())
    return calls


def stt_golden(model: LMModel, codes: np.ndarray) -> dict[str, np.ndarray]:
    """run_inference.py's STT loop: frame 0 stepped twice, then one step per frame."""
    lm_gen = LMGen(model, temp=0.0, temp_text=0.0)
    calls = recorded_calls(lm_gen)
    call_codes = np.concatenate([codes[:1], codes])
    heads = model.extra_heads
    text_tokens = np.full(len(call_codes), -1, np.int32)
    extra = np.full((len(call_codes), len(heads), STT_CONFIG["extra_heads_dim"]), np.nan)
    with lm_gen.streaming(1):
        for index, frame in enumerate(call_codes):
            out = lm_gen.step_with_extra_heads(torch.from_numpy(frame)[None, :, None])
            if out is None:
                continue
            tokens, probs = out
            text_tokens[index] = int(tokens[0, 0, 0])
            extra[index] = np.stack([p[0, 0].numpy() for p in probs])
    return {
        "codes": codes.astype(np.int32),
        "call_codes": call_codes.astype(np.int32),
        "text_logits": np.stack(calls.text_logits).astype(np.float32),
        "sampled_text": np.array(calls.sampled_text, np.int32),
        "text_tokens": text_tokens,
        "extra_heads": extra.astype(np.float32),
    }


def condition_tensors(model: LMModel, cfg_coef: float) -> dict:
    """run_inference.py's get_condition_tensors("hibiki", lm, batch_size=1, cfg_coef)."""
    conditions = [ConditionAttributes(text={"description": "very_good"}, tensor={})]
    if cfg_coef != 1.0:
        conditions += [ConditionAttributes(text={"description": "very_bad"}, tensor={})]
    return model.condition_provider.prepare_and_provide(conditions)


def hibiki_golden(model: LMModel, codes: np.ndarray, cfg_coef: float) -> dict[str, np.ndarray]:
    raw = []
    conditions = condition_tensors(model, cfg_coef)
    lm_gen = LMGen(model, temp=0.0, temp_text=0.0, cfg_coef=cfg_coef, condition_tensors=conditions)
    calls = recorded_calls(lm_gen)
    forward_depformer = model.forward_depformer

    def recorded(cb_index, sequence, transformer_out):
        logits = forward_depformer(cb_index, sequence, transformer_out)  # (B, 1, 1, card)
        raw.append(logits[:, 0, 0].clone())
        return logits

    model.forward_depformer = recorded
    tokens = np.full((len(codes), 1 + model.dep_q), -1, np.int32)
    try:
        with lm_gen.streaming(1):
            condition = lm_gen._streaming_state.condition_sum.numpy().copy()
            for index, frame in enumerate(codes):
                out = lm_gen.step(torch.from_numpy(frame)[None, :, None])
                if out is not None:
                    tokens[index] = out[0, :, 0].numpy()
    finally:
        del model.forward_depformer
    raw_logits = torch.stack(raw).reshape(len(codes), model.dep_q, *raw[0].shape)
    if cfg_coef != 1.0:
        cond, null = raw_logits[:, :, 0], raw_logits[:, :, 1]
        guided = null + (cond - null) * cfg_coef  # the expression of LMGen.depformer_step
    else:
        guided = raw_logits[:, :, 0]
    return {
        "source_codes": codes.astype(np.int32),
        "condition": condition.astype(np.float32),
        "text_logits": np.stack(calls.text_logits).astype(np.float32),
        "sampled_text": np.array(calls.sampled_text, np.int32),
        "depformer_logits": guided.numpy().astype(np.float32),
        "depformer_raw": raw_logits.numpy().astype(np.float32),
        "sampled_audio": np.stack(calls.sampled_audio).astype(np.int32),
        "tokens": tokens,
    }


def write_config(config: dict, path: Path) -> None:
    path.write_text(json.dumps(config, indent=2) + "\n")


def make_stt(tokenizer_model: bytes) -> None:
    out = FIXTURES / "stt"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(tokenizer_model)
    write_config(STT_CONFIG, out / "config.json")
    delayed = {**STT_CONFIG, "delays": STT_DELAYED}
    write_config(delayed, out / "config_delayed.json")
    model = build_lm(STT_CONFIG, seed=2025, boosted=(0, 3))
    save_weights(model, out / "weights.safetensors")
    codes = np.random.default_rng(11).integers(0, STT_CONFIG["card"], (STT_STEPS, 32))
    with torch.no_grad():
        golden = stt_golden(model, codes)
        np.savez_compressed(out / "golden.npz", **golden)
        model.delays = STT_DELAYED  # the only thing the delays change in an LMModel
        delayed_golden = stt_golden(model, codes)
        np.savez_compressed(out / "golden_delayed.npz", **delayed_golden)
    for name, result in (("golden", golden), ("golden_delayed", delayed_golden)):
        print(f"stt {name}: text {result['text_tokens'][:40].tolist()}")
        print(f"  distinct sampled text: {len(np.unique(result['sampled_text']))}")
    mlx_names(out / "config.json", MANIFESTS / "stt_tiny_mlx_names.tsv")


def make_hibiki(tokenizer_model: bytes) -> None:
    out = FIXTURES / "hibiki"
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.model").write_bytes(tokenizer_model)
    write_config(HIBIKI_CONFIG, out / "config.json")
    model = build_lm(HIBIKI_CONFIG, seed=2031, boosted=(2, 3))
    save_weights(model, out / "weights.safetensors")
    # What CheckpointInfo.get_moshi does after loading a model_type "hibiki" checkpoint.
    with torch.no_grad():
        model.text_emb.weight.data[2] = model.text_emb.weight.data[3]
    source = HIBIKI_CONFIG["n_q"] - HIBIKI_CONFIG["dep_q"]
    codes = np.random.default_rng(12).integers(0, HIBIKI_CONFIG["card"], (HIBIKI_STEPS, source))
    codes[EOS_STEP] = HIBIKI_CONFIG["card"]
    with torch.no_grad():
        for cfg_coef, name in ((3.0, "golden_cfg3"), (1.0, "golden_cfg1")):
            golden = hibiki_golden(model, codes, cfg_coef)
            np.savez_compressed(out / f"{name}.npz", **golden)
            print(f"hibiki {name}: text {golden['tokens'][:30, 0].tolist()}")
            print(f"  distinct audio tokens: {len(np.unique(golden['sampled_audio']))}")
    mlx_names(out / "config.json", MANIFESTS / "hibiki_tiny_mlx_names.tsv")


def main() -> None:
    torch.set_num_threads(1)
    tokenizer_model = train_tokenizer()
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_model)
    assert tokenizer.vocab_size() == STT_CONFIG["text_card"], tokenizer.vocab_size()
    make_stt(tokenizer_model)
    make_hibiki(tokenizer_model)
    print_sizes(FIXTURES / "stt")
    print_sizes(FIXTURES / "hibiki")


if __name__ == "__main__":
    sys.exit(main())
