"""Golden outputs of Kyutai's PyTorch text-to-speech (TTS, `moshi.models.tts`) reference.

Run with the reference environment (torch + Kyutai's `moshi` 0.2.13), from the repository
root:

    /opt/venvs/ref/bin/python scripts/make_tts_fixtures.py

It builds a tiny random `LMModel` in the layout of the published `kyutai/tts-1.6b-en_fr`
config.json (as `loaders.get_moshi_lm` does: the `conditioners` become a ConditionProvider,
`fuser` a ConditionFuser, `demux_second_stream` the `demux_second_text_stream` argument; the
keys LMModel does not take are dropped as `CheckpointInfo.from_hf_repo` does), float32, seeded,
with every weight rounded to a bfloat16 value so the committed bf16 file is exact. Besides
`round_to_bf16`'s layer-scale alphas near 1, the cross-attention norms `norm_cross.{weight,
bias}` (LayerNorm: 1 and 0 at construction) are drawn at random; the conditioners'
`learnt_padding` (0.2 * randn) and the embeddings' `low_rank` / `out1` / `out2` linears
(PyTorch's default init) are random as constructed. Two changes make the greedy TTS runs take
varied decisions: the `control` and `config` conditioners' output_proj are scaled by 1/8 (at full
scale the constant summed condition swamps the token embeddings and the random model predicts
the same text token at every step), and the text_linear rows of the only tokens the TTS state
machine tells apart, pad (3) and word (0), become 4 * pad and 4 * pad + 3 * word, so that
these two dominate and which one wins varies from step to step. Then it runs
`LMModel.forward` teacher-forced and `TTSModel.generate` greedily, and asks
scripts/list_kyutai_mlx_names.py (run with /opt/venvs/kyutai, Kyutai's moshi_mlx 0.3.0) for the
MLX parameter names of the config.

tests/fixtures/tts/ (dim 64, 2 layers, context 16 so the attention window slides; n_q = dep_q
= 8, delays [0, 0, 2 x 7]; text card 100, input vocab 101 whose id 100 is the start token;
depformer dim 32 with 6 weight sets over the 8 codebooks; audio delay 0.32 s = 4 steps):
- config.json: the published TTS config.json's keys, in its order (conditioners `speaker_wavs`
  (tensor, dim 16, cross-attended), `config` and `control` (LUTs summed into the input), fuser,
  tts_config, model_id {"sig": "0badf00d", "epoch": 7}, model_type "tts", lm_gen_config),
- weights.safetensors: the LM in bf16 under the names of the published
  `dsm_tts_1e68beda@240.safetensors`: every attention packed into `...self_attn.in_proj_weight`
  and `...self_attn.out_proj.weight` (the depformer's stacking its 6 weight sets along dim 0:
  (6 x 96, 32) and (6 x 32, 32)), `transformer.layers.{l}.cross_attention.{in_proj_weight,
  out_proj.weight}` and `norm_cross.{weight, bias}`, `depformer_in.{0..5}`,
  `depformer.layers.{l}.gating.{0..5}`, `depformer_text_emb.{weight, low_rank.weight,
  out1.weight, out2.weight}` (low_rank is stored but unused: PyTorch's demux path skips it),
  `depformer_emb.{k}.{weight, low_rank.weight}`, `text_emb.{weight, out1.weight,
  out2.weight}`, and `condition_provider.conditioners.*` in float32 as published; loaded back
  strictly by `loaders.get_moshi_lm` into a fresh LMModel, equal to the model of the goldens,
- tokenizer.model: a tiny SentencePiece (BPE, 100 pieces = text_card, <pad> = 3) trained on
  English sentences holding every character of the texts below (no <unk> in them),
- voices/alice.safetensors, voices/bob.safetensors: voice embeddings as `kyutai/tts-voices`
  publishes them: one float32 tensor `speaker_wavs` (1, 16, 10) (dim, time; published
  (1, 512, 125)) and the metadata {"sig": "0badf00d", "epoch": "7"}, random normal,
- golden_forced.npz: teacher-forced `LMModel.forward(codes, condition_tensors)` on a batch of
  2: row 0 voice alice with cfg "2.0", row 1 voice bob with cfg "1.5", conditions made by
  `TTSModel.make_condition_attributes` (5 speaker slots, the voice in the first, control "ok");
  keys:
  - codes (2, 9, 40) int64: the forward's input, T = 40 steps (undelayed): row 0 the text as
    multiplexed tokens (second + 1) * 101 + first, first in [0, 100], second in [-1, 100];
    rows 1..8 audio codes in [0, 63] with some -1 ("zero": embedded as 0),
  - input_sequence (2, 9, 40) int64: what the temporal transformer embeds at each position,
    recorded by wrapping `forward_text` (and checked against a recomputation): position 0 is
    the initial token of every stream (text 100, audio 64); then each stream k holds
    codes[k, t - 1 - delay_k] at position t, the initial token where t - 1 - delay_k < 0
    (positions 0..2 of audio codebooks 1..7); codes[:, :, 39] is never an input,
  - text_logits (2, 40, 100) float32: logits predicting codes[:, 0, t] at t (the forward
    realigns them; text delay 0 so no NaN),
  - audio_logits (2, 8, 40, 64) float32: the depformer's logits predicting codes[:, 1 + q, t],
    NaN where forward's `_undelay_sequence` masks them: t = 38, 39 of codebooks q = 1..7
    (their inputs would lie past the sequence),
  - text_mask (2, 40), audio_mask (2, 8, 40) bool: forward's masks (False at the NaN
    positions and where codes are -1; the logits there are still computed),
  - cross_src (2, 50, 64) float32: the cross-attention source after the fuser (5 slots x 10
    frames of `speaker_wavs` projected, `learnt_padding` in the empty slots, plus the fuser's
    sinusoidal position embedding),
  - sum_cond (2, 1, 64) float32: the summed `control` + `config` conditions added to the input,
- golden_generate.json: greedy runs of `TTSModel.generate` (TTSModel built directly: this LM, a
  tiny random MimiModel (only its frame_rate 12.5 is used), the tokenizer,
  StateMachine(TokenIds(101), second_stream_ahead=2, max_padding=8, initial_padding=2),
  delay_steps 4, temp 0 (LMGen's `sample_token` takes the argmax when temp is 0: checked
  against the recorded logits), cfg_coef 1.0, n_q 8, final_padding 4, max_gen_length 2000):
  - "settings": those settings,
  - "runs": "batch" (2 rows: the TEXTS with voices alice / bob and cfg 2.0 / 1.5) and
    "padding_bonus" (1 row: SHORT_TEXT, alice, cfg 2.0, padding_bonus 1.5) and "long" (1 row:
    LONG_TEXT, all the sentences, bob, cfg 2.0: dozens of contexts); each run has
    "padding_bonus", "steps" (the number of `LMGen.step` calls) and "rows", each row with
    "text", "voice", "cfg", "entries" (`prepare_script([text], padding_between=1)`: tokens,
    text, padding), "logged_text_tokens" ([predicted, fed] per step: the argmax text token and
    the token the state machine fed back, multiplexed (second + 1) * 101 + first),
    "frames" (what `LMGen.step` returned, [text, 8 audio] with the delays undone: None at
    steps 0 and 1, so steps - 2 frames; frame i holds the text token fed at step i
    (logged_text_tokens[i][1], multiplexed), codebook 0 sampled at step i and codebooks 1..7
    sampled at step i + 2; its audio is -1 in frames 0..3 only: TTSModel skips the depformer
    at steps < delay_steps (4) and its audio hook sets codebook q to -1 at steps
    < delay_q + 4, i.e. codebook 0 at steps 0..3 and codebooks 1..7 at steps 0..5),
    "end_step", "consumption_times" and "transcript" ([word, step]). The batch's rows share
    the step count: row 0 runs on after its end step until row 1's end step + 8.
    "n_q" is "batch" with `TTSModel(n_q=6)`: the LM's dep_q set to 6 (the depformer runs 6
    slices; codebooks 6 and 7 are fed as -1, an all-zero embedding, after their initial
    tokens), its "n_q" 6 and its frames [text, 6 audio].

Two runs write identical bytes (the voice files are written by hand: the safetensors package
writes metadata keys in hash order, which changes from run to run).

tests/manifests/tts_tiny_mlx_names.tsv: `name`, `shape` of every parameter of Kyutai's
moshi_mlx 0.3.0 `Lm(LmConfig.from_config_dict(config.json))`.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import numpy as np
import sentencepiece
import torch
from fixture_tokenizer import train_bpe_tokenizer
from fixture_weights import lm_kwargs, mlx_names, random_voice, round_to_bf16, write_voice
from moshi.models import loaders
from moshi.models.lm import LMModel
from moshi.models.tts import DEFAULT_DSM_TTS_VOICE_REPO, StateMachine, TokenIds, TTSModel
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tts"
MANIFEST = ROOT / "tests" / "manifests" / "tts_tiny_mlx_names.tsv"

# The published TTS structure (kyutai/tts-1.6b-en_fr) at tiny sizes, its keys in its order.
PUBLISHED_CONFIG = ROOT / "tests" / "fixtures" / "kyutai_configs" / "tts-1.6b-en_fr.json"
TINY_SIZES = {
    "dim": 64,
    "num_heads": 4,
    "num_layers": 2,
    "context": 16,
    "card": 64,
    "text_card": 100,
    "n_q": 8,
    "dep_q": 8,
    "delays": [0, 0] + [2] * 7,
    "depformer_dim": 32,
    "depformer_num_heads": 4,
    "depformer_num_layers": 2,
    "depformer_dim_feedforward": 96,
    "depformer_weights_per_step_schedule": [0, 1, 2, 3, 4, 4, 5, 5],
    "depformer_low_rank_embeddings": 8,
    "tts_config": {"audio_delay": 0.32, "second_stream_ahead": 2},
    "model_id": {"sig": "0badf00d", "epoch": 7},
    "moshi_name": "weights.safetensors",
    "tokenizer_name": "tokenizer.model",
}


def tiny_config() -> dict:
    """The published config.json at TINY_SIZES (the conditioners' widths too), no Mimi file."""
    config = json.loads(PUBLISHED_CONFIG.read_text()) | TINY_SIZES
    del config["mimi_name"]
    config["conditioners"]["speaker_wavs"]["tensor"]["dim"] = 16
    config["conditioners"]["control"]["lut"]["dim"] = TINY_SIZES["dim"]
    return config


TTS_CONFIG = tiny_config()

# A Mimi small enough to build in no time; TTSModel only reads its frame_rate (12.5).
TINY_MIMI_CONFIG = {
    "sample_rate": 24000,
    "channels": 1,
    "frame_rate": 12.5,
    "seanet": {**loaders._seanet_kwargs, "dimension": 16, "n_filters": 2},
    "quantizer": {
        **loaders._quantizer_kwargs,
        "dimension": 8,
        "n_q": 8,
        "bins": 64,
        "input_dimension": 16,
        "output_dimension": 16,
    },
    "transformer": {
        **loaders._transformer_kwargs,
        "d_model": 16,
        "num_heads": 2,
        "num_layers": 1,
        "dim_feedforward": 32,
        "input_dimension": 16,
        "output_dimensions": [16],
    },
}

TEXTS = [
    'Hello there, how are you today? <break time="0.5s"/> I hope the weather is nice.',
    (
        "The quick brown fox jumps over the lazy dog while we talk about the weather and the "
        "news of today."
    ),
]
SHORT_TEXT = "Good morning to you all."
# Long enough to slide the 16-step attention window dozens of times.
SENTENCES = [
    "Hello there, how are you today? I hope the weather is nice.",
    "The quick brown fox jumps over the lazy dog while we talk about the weather.",
    "And the news of today is good. Good morning to you all.",
    "What a nice day to talk about the weather and the news.",
    "Where are we going? We are going home now, thank you.",
    "I think the dog is happy today, and so is the fox.",
    "Would you like some coffee or some tea this morning?",
    "Every morning the quick fox jumps over the brown dog.",
]

SEED = 2047
SUMMED = ("control", "cfg")
SUMMED_SCALE = 0.125
WORD, PAD = 0, 3  # TokenIds.new_word and TokenIds.pad
PAD_BOOST = 4.0
WORD_SPREAD = 3.0
FORCED_STEPS = 40
VOICES = ("alice", "bob")
VOICE_SHAPE = (1, 16, 10)  # published (1, 512, 125)
CFGS = (2.0, 1.5)
DELAY_STEPS = int(TTS_CONFIG["tts_config"]["audio_delay"] * 12.5)  # 4
GENERATION = {
    "delay_steps": DELAY_STEPS,
    "second_stream_ahead": TTS_CONFIG["tts_config"]["second_stream_ahead"],
    "max_padding": 8,
    "initial_padding": 2,
    "temp": 0.0,
    "cfg_coef": 1.0,
    "n_q": 8,
    "final_padding": 4,
    "max_gen_length": 2000,
    "padding_between": 1,
}
N_Q_RUN = 6  # the "n_q" run generates the first 6 of the 8 codebooks


LONG_TEXT = " ".join(SENTENCES)


def build_lm() -> LMModel:
    """Kyutai's get_moshi_lm without weights, randomized, every value a bf16 value."""
    torch.manual_seed(SEED)
    model = loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs(TTS_CONFIG), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".norm_cross." in name:
                if name.endswith(".weight"):
                    param.copy_(1.0 + 0.2 * torch.randn_like(param))
                else:
                    param.copy_(0.1 * torch.randn_like(param))
        for name in SUMMED:
            model.condition_provider.conditioners[name].output_proj.weight *= SUMMED_SCALE
        rows = model.text_linear.weight
        rows[WORD] = PAD_BOOST * rows[PAD] + WORD_SPREAD * rows[WORD]
        rows[PAD] *= PAD_BOOST
    return round_to_bf16(model)


def published_state(model: LMModel) -> dict[str, torch.Tensor]:
    """The state_dict under the published names: each attention's per-weight-set projections
    `in_projs.{i}.weight` / `out_projs.{i}.weight` stacked along dim 0 as `in_proj_weight` /
    `out_proj.weight`; bf16 but condition_provider.* float32."""
    packed: dict[str, list[tuple[int, torch.Tensor]]] = {}
    state = {}
    for name, tensor in model.state_dict().items():
        match = re.fullmatch(r"(.*)\.(in|out)_projs\.(\d+)\.weight", name)
        if match:
            prefix, kind, index = match.groups()
            target = f"{prefix}.in_proj_weight" if kind == "in" else f"{prefix}.out_proj.weight"
            packed.setdefault(target, []).append((int(index), tensor))
        else:
            state[name] = tensor
    for target, parts in packed.items():
        assert [i for i, _ in sorted(parts)] == list(range(len(parts))), target
        state[target] = torch.cat([t for _, t in sorted(parts)], dim=0)
    return {
        name: (t if name.startswith("condition_provider.") else t.to(torch.bfloat16)).contiguous()
        for name, t in state.items()
    }


def save_weights(model: LMModel, path: Path, config: dict = TTS_CONFIG) -> None:
    """Write `model` in the published layout (bf16, conditioners' tables float32) and check
    that Kyutai's loader reads back the same tensors under `config`."""
    save_file(published_state(model), str(path))
    reloaded = loaders.get_moshi_lm(path, lm_kwargs=lm_kwargs(config), dtype=torch.float32)
    ours, theirs = model.state_dict(), reloaded.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    stored = load_file(str(path))
    for name, tensor in stored.items():
        expected = torch.float32 if name.startswith("condition_provider.") else torch.bfloat16
        assert tensor.dtype == expected, name


def save_voices(folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(21)
    metadata = {key: str(value) for key, value in TTS_CONFIG["model_id"].items()}
    paths = []
    for name in VOICES:
        emb = random_voice(rng, *VOICE_SHAPE[1:])
        path = write_voice(folder / f"{name}.safetensors", emb, metadata)
        with safe_open(str(path), "pt") as f:
            assert f.metadata() == metadata
            assert torch.equal(f.get_tensor("speaker_wavs"), torch.from_numpy(emb))
        paths.append(path)
    return paths


def build_tts(
    model: LMModel, tokenizer, padding_bonus: float = 0.0, n_q: int = GENERATION["n_q"]
) -> TTSModel:
    """TTSModel as from_checkpoint_info builds it, with a tiny random Mimi."""
    mimi = loaders.get_mimi(None, copy.deepcopy(TINY_MIMI_CONFIG), num_codebooks=8)
    assert mimi.frame_rate == 12.5
    model_id = TTS_CONFIG["model_id"]
    machine = StateMachine(
        token_ids=TokenIds(model.text_card + 1),
        second_stream_ahead=GENERATION["second_stream_ahead"],
        max_padding=GENERATION["max_padding"],
        initial_padding=GENERATION["initial_padding"],
    )
    return TTSModel(
        lm=model,
        mimi=mimi,
        tokenizer=tokenizer,
        voice_suffix=f".{model_id['sig']}@{model_id['epoch']}.safetensors",
        voice_repo=DEFAULT_DSM_TTS_VOICE_REPO,
        machine=machine,
        delay_steps=GENERATION["delay_steps"],
        temp=GENERATION["temp"],
        cfg_coef=GENERATION["cfg_coef"],
        final_padding=GENERATION["final_padding"],
        n_q=n_q,
        max_gen_length=GENERATION["max_gen_length"],
        padding_bonus=padding_bonus,
    )


def forced_codes() -> np.ndarray:
    rng = np.random.default_rng(31)
    text_card = TTS_CONFIG["text_card"]
    shape = (2, FORCED_STEPS)
    first = rng.integers(0, text_card + 1, shape)
    second = rng.integers(-1, text_card + 1, shape)
    second[rng.random(shape) < 0.4] = -1  # plenty of plain (non-multiplexed) tokens
    codes = np.empty((2, 1 + TTS_CONFIG["n_q"], FORCED_STEPS), np.int64)
    codes[:, 0] = (second + 1) * (text_card + 1) + first
    codes[:, 1:] = rng.integers(0, TTS_CONFIG["card"], (2, TTS_CONFIG["n_q"], FORCED_STEPS))
    codes[:, 1:][rng.random(codes[:, 1:].shape) < 0.1] = -1
    return codes


def expected_input(model: LMModel, codes: np.ndarray) -> np.ndarray:
    """The temporal transformer's input sequence, recomputed from the forward's rules."""
    T = codes.shape[-1]
    initial = [model.text_initial_token_id] + [model.initial_token_id] * model.n_q
    out = np.empty_like(codes)
    for k, delay in enumerate(model.delays):
        for t in range(T):
            source = t - 1 - delay
            out[:, k, t] = codes[:, k, source] if source >= 0 else initial[k]
    return out


def forced_golden(model: LMModel, tts: TTSModel, voices: list[Path]) -> dict[str, np.ndarray]:
    attributes = [
        tts.make_condition_attributes([voice], cfg_coef=config)
        for voice, config in zip(voices, CFGS)
    ]
    conditions = model.condition_provider.prepare_and_provide(attributes)
    codes = forced_codes()
    seen = {}
    forward_text = model.forward_text

    def recorded(sequence, sum_condition=None, cross_attention_src=None):
        seen["input_sequence"] = sequence.clone()
        seen["sum_cond"] = sum_condition.clone()
        seen["cross_src"] = cross_attention_src.clone()
        return forward_text(sequence, sum_condition, cross_attention_src)

    model.forward_text = recorded
    try:
        out = model(torch.from_numpy(codes), conditions)
    finally:
        del model.forward_text
    input_sequence = seen["input_sequence"].numpy()
    assert np.array_equal(input_sequence, expected_input(model, codes))
    sum_cond = seen["sum_cond"].numpy()
    cross_src = seen["cross_src"].numpy()
    assert np.array_equal(sum_cond, model.fuser.get_sum(conditions).numpy())
    assert np.array_equal(cross_src, model.fuser.get_cross(conditions).numpy())
    return {
        "codes": codes,
        "input_sequence": input_sequence,
        "text_logits": out.text_logits[:, 0].numpy().astype(np.float32),
        "audio_logits": out.logits.numpy().astype(np.float32),
        "text_mask": out.text_mask[:, 0].numpy(),
        "audio_mask": out.mask.numpy(),
        "cross_src": cross_src.astype(np.float32),
        "sum_cond": sum_cond.astype(np.float32),
    }


def run_generate(
    model: LMModel,
    tokenizer,
    texts: list[str],
    voices: list[Path],
    cfgs: list[float],
    padding_bonus: float,
    n_q: int = GENERATION["n_q"],
) -> dict:
    """One greedy TTSModel.generate run, with the text argmax checked against its logits.
    `n_q` < the LM's: `generate` sets the LM's dep_q to it (restored here afterwards)."""
    tts = build_tts(model, tokenizer, padding_bonus, n_q)
    all_entries = [
        tts.prepare_script([text], padding_between=GENERATION["padding_between"]) for text in texts
    ]
    for entries in all_entries:  # every character known: no <unk> (0, also the word token)
        assert all(tokenizer.unk_id() not in entry.tokens for entry in entries), entries
    attributes = [
        tts.make_condition_attributes([voice], cfg_coef=config)
        for voice, config in zip(voices, cfgs)
    ]
    step_logits, audio_margins = [], []
    forward_text, forward_depformer = model.forward_text, model.forward_depformer

    def recorded(*args, **kwargs):
        transformer_out, text_logits = forward_text(*args, **kwargs)
        step_logits.append(text_logits[:, 0, 0].clone())  # before the padding bonus hook
        return transformer_out, text_logits

    def depformer(*args, **kwargs):
        logits = forward_depformer(*args, **kwargs)  # (B, 1, 1, card)
        top = torch.topk(logits, 2, dim=-1).values
        audio_margins.append(float((top[..., 0] - top[..., 1]).min()))
        return logits

    model.forward_text, model.forward_depformer = recorded, depformer
    try:
        result = tts.generate(all_entries, attributes)
    finally:
        del model.forward_text, model.forward_depformer
        model.dep_q = TTS_CONFIG["dep_q"]
    steps = len(result.logged_text_tokens[0])
    assert len(step_logits) == steps and len(result.frames) == steps - 2
    pad = tts.machine.token_ids.pad
    margins = []
    for step, logits in enumerate(step_logits):
        logits = logits.clone()
        logits[:, pad] += padding_bonus
        top = torch.topk(logits, 2, dim=-1).values
        margins.append(float((top[:, 0] - top[:, 1]).min()))
        for b, logged in enumerate(result.logged_text_tokens):
            assert logged[step][0] == int(logits[b].argmax()), (step, b)
    frames = torch.stack(result.frames)[..., 0].numpy()  # (steps - 2, B, 9)
    rows = []
    for b, text in enumerate(texts):
        fed = [fed for _, fed in result.logged_text_tokens[b]]
        assert frames[:, b, 0].tolist() == fed[: steps - 2]
        rows.append(
            {
                "text": text,
                "voice": voices[b].stem,
                "cfg": cfgs[b],
                "entries": [
                    {"tokens": list(e.tokens), "text": e.text, "padding": e.padding}
                    for e in all_entries[b]
                ],
                "logged_text_tokens": [list(pair) for pair in result.logged_text_tokens[b]],
                "frames": frames[:, b].tolist(),
                "end_step": result.end_steps[b],
                "consumption_times": list(result.all_consumption_times[b]),
                "transcript": [list(pair) for pair in result.all_transcripts[b]],
            }
        )
    print(
        f"generate (bonus {padding_bonus}): {steps} steps, end steps {result.end_steps}, "
        f"smallest top-2 margins: text {min(margins):.4f}, audio {min(audio_margins):.4f}"
    )
    run = {"padding_bonus": padding_bonus, "steps": steps, "rows": rows}
    return run if n_q == GENERATION["n_q"] else {"n_q": n_q, **run}


def dump_json(data: dict) -> str:
    """Indented JSON with each innermost list of numbers or strings on one line."""
    text = json.dumps(data, indent=1)
    return (
        re.sub(
            r"\[\s*([^\[\]{}]*?)\s*\]",
            lambda m: "[" + re.sub(r",\s+", ", ", m.group(1)) + "]",
            text,
        )
        + "\n"
    )


def main() -> None:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "config.json").write_text(json.dumps(TTS_CONFIG, indent=2) + "\n")
    tokenizer_model = train_bpe_tokenizer(
        SENTENCES, TTS_CONFIG["text_card"], TTS_CONFIG["existing_text_padding_id"]
    )
    (OUT / "tokenizer.model").write_bytes(tokenizer_model)
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_model)
    assert tokenizer.vocab_size() == TTS_CONFIG["text_card"], tokenizer.vocab_size()
    assert tokenizer.pad_id() == TTS_CONFIG["existing_text_padding_id"]
    voices = save_voices(OUT / "voices")
    model = build_lm()
    save_weights(model, OUT / "weights.safetensors")
    with torch.no_grad():
        forced = forced_golden(model, build_tts(model, tokenizer), voices)
    np.savez_compressed(OUT / "golden_forced.npz", **forced)
    batch = run_generate(model, tokenizer, TEXTS, voices, list(CFGS), 0.0)
    bonus = run_generate(model, tokenizer, [SHORT_TEXT], voices[:1], list(CFGS[:1]), 1.5)
    long = run_generate(model, tokenizer, [LONG_TEXT], voices[1:], list(CFGS[:1]), 0.0)
    n_q = run_generate(model, tokenizer, TEXTS, voices, list(CFGS), 0.0, N_Q_RUN)
    runs = {"batch": batch, "padding_bonus": bonus, "long": long, "n_q": n_q}
    golden = {"settings": GENERATION, "runs": runs}
    (OUT / "golden_generate.json").write_text(dump_json(golden))
    for run in (batch, bonus, long, n_q):
        for row in run["rows"]:
            decisions = "".join(
                "w" if p == 0 else "p" if p == 3 else "." for p, _ in row["logged_text_tokens"]
            )
            print(f"  {row['voice']}: end {row['end_step']}, predicted {decisions}")
    mlx_names(OUT / "config.json", MANIFEST)
    for path in sorted(OUT.rglob("*")):
        if path.is_file():
            print(f"{path.relative_to(OUT)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    sys.exit(main())
