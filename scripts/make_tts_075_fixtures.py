"""Golden outputs of Kyutai's PyTorch TTS in the layout of kyutai/tts-0.75b-en-public (voice
cloning from an audio prefix, classifier-free guidance by a null row), for
tests/parity/test_tts_075_parity.py.

Run with the reference environment (torch + Kyutai's `moshi` 0.2.13), from the repository
root, after scripts/make_tts_fixtures.py (whose tokenizer it copies):

    /opt/venvs/ref/bin/python scripts/make_tts_075_fixtures.py

The config is the reconstructed published one (tests/fixtures/kyutai_configs/
tts-0.75b-en-public.json) at make_tts_fixtures.py's tiny sizes: `conditioners {}` (no voices,
no distilled guidance), no fuser, `cross_attention` false, `text_card_out` 5 (the text head
predicts only the schedule's word 0, speaker 1 and 2, padding 3 and 4), n_q = dep_q = 8. The
LM is built as `loaders.get_moshi_lm` builds it, seeded, float32 with bf16 values, the
text head's word and padding rows boosted as in make_tts_fixtures.py (so that which one wins
varies), and saved in the published naming (bf16), loaded back strictly.

tests/fixtures/tts_075/: config.json, weights.safetensors, tokenizer.model (the 1.6B fixture's),
golden.json: "settings" (as make_tts_fixtures.py's GENERATION; `cfg_coef` per run) and "runs",
greedy `TTSModel.generate(entries, [], prefixes=...)` as `simple_generate` calls it for this
model (no condition attributes; `cfg_is_no_prefix` and `cfg_is_no_text` true: the null row's
inputs are "no input" until each row's prefix length + delay_steps plus the stream's delay,
and its text always, and the text is sampled from the conditioned rows alone):
- "clone": SHORT_TEXT after a 12-frame prefix, cfg_coef 2.0;
- "batch": TEXTS after prefixes of 10 and 6 frames, cfg_coef 2.0 (per-row masking);
- "no_prefix": SHORT_TEXT, no prefix, cfg_coef 2.0 (the null row differs by its text only);
- "unguided": SHORT_TEXT after the 12-frame prefix, cfg_coef 1.0 (one row).
Each run: "cfg_coef", "steps", "prefixes" (per row: (9, frames) ints, row 0 -1, or None) and
"rows" with "text", "logged_text_tokens" ([predicted, fed] per step), "frames" ([text, 8 audio]
per step from step 2), "end_step", "consumption_times", "transcript". The prefixes' codes are
fixed random codes (Mimi is left out, as in make_tts_clone_fixtures.py).
"""

from __future__ import annotations

import copy
import json
import shutil
import sys

import numpy as np
import sentencepiece
import torch
from fixture_weights import lm_kwargs, round_to_bf16
from make_tts_fixtures import (
    GENERATION,
    OUT,
    PAD,
    PAD_BOOST,
    ROOT,
    SHORT_TEXT,
    TEXTS,
    TINY_MIMI_CONFIG,
    TINY_SIZES,
    WORD,
    WORD_SPREAD,
    dump_json,
    save_weights,
)
from moshi.models import loaders
from moshi.models.lm import LMModel
from moshi.models.tts import StateMachine, TokenIds, TTSModel

PUBLISHED = ROOT / "tests" / "fixtures" / "kyutai_configs" / "tts-0.75b-en-public.json"
OUT_075 = OUT.parent / "tts_075"
SEED = 750
TEXT_CARD_OUT = 5


def tiny_config() -> dict:
    """The reconstructed published config.json at make_tts_fixtures.py's sizes, no Mimi file."""
    config = json.loads(PUBLISHED.read_text()) | TINY_SIZES
    config["model_id"] = {"sig": "0badcafe", "epoch": 75}
    del config["mimi_name"]
    assert config["text_card_out"] == TEXT_CARD_OUT and config["conditioners"] == {}
    return config


CONFIG = tiny_config()


def build_lm() -> LMModel:
    torch.manual_seed(SEED)
    model = loaders.get_moshi_lm(None, lm_kwargs=lm_kwargs(CONFIG), dtype=torch.float32)
    assert model.text_linear.weight.shape[0] == TEXT_CARD_OUT
    with torch.no_grad():
        rows = model.text_linear.weight
        rows[WORD] = PAD_BOOST * rows[PAD] + WORD_SPREAD * rows[WORD]
        rows[PAD] *= PAD_BOOST
    return round_to_bf16(model)


def build_tts(model: LMModel, tokenizer, cfg_coef: float) -> TTSModel:
    """TTSModel as from_checkpoint_info builds it for this config, with a tiny random Mimi."""
    mimi = loaders.get_mimi(None, copy.deepcopy(TINY_MIMI_CONFIG), num_codebooks=8)
    machine = StateMachine(
        token_ids=TokenIds(model.text_card + 1),
        second_stream_ahead=CONFIG["tts_config"]["second_stream_ahead"],
        max_padding=GENERATION["max_padding"],
        initial_padding=GENERATION["initial_padding"],
    )
    tts = TTSModel(
        lm=model,
        mimi=mimi,
        tokenizer=tokenizer,
        voice_suffix="",
        voice_repo="",
        machine=machine,
        delay_steps=GENERATION["delay_steps"],
        temp=GENERATION["temp"],
        cfg_coef=cfg_coef,
        final_padding=GENERATION["final_padding"],
        n_q=GENERATION["n_q"],
        max_gen_length=GENERATION["max_gen_length"],
    )
    assert not tts.multi_speaker and not tts.valid_cfg_conditionings
    return tts


def prefix_codes(frames: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, CONFIG["card"], (CONFIG["n_q"], frames))
    return np.concatenate([np.full((1, frames), -1), codes]).astype(np.int64)


def run_generate(model, tokenizer, texts, prefixes, cfg_coef: float) -> dict:
    tts = build_tts(model, tokenizer, cfg_coef)
    entries = [
        tts.prepare_script([text], padding_between=GENERATION["padding_between"]) for text in texts
    ]
    torch_prefixes = None if prefixes is None else [torch.from_numpy(p) for p in prefixes]
    with torch.no_grad():
        result = tts.generate(entries, [], prefixes=torch_prefixes)
    steps = len(result.logged_text_tokens[0])
    frames = torch.stack(result.frames)[..., 0].numpy()  # (steps - 2, B, 9)
    rows = [
        {
            "text": text,
            "logged_text_tokens": [list(pair) for pair in result.logged_text_tokens[b]],
            "frames": frames[:, b].tolist(),
            "end_step": result.end_steps[b],
            "consumption_times": list(result.all_consumption_times[b]),
            "transcript": [list(pair) for pair in result.all_transcripts[b]],
        }
        for b, text in enumerate(texts)
    ]
    decisions = [
        "".join("w" if p == WORD else "." for p, _ in r["logged_text_tokens"]) for r in rows
    ]
    print(f"cfg {cfg_coef}: {steps} steps, end steps {result.end_steps}, {decisions}")
    listed = None if prefixes is None else [p.tolist() for p in prefixes]
    return {"cfg_coef": cfg_coef, "steps": steps, "prefixes": listed, "rows": rows}


def main() -> None:
    torch.set_num_threads(1)
    OUT_075.mkdir(parents=True, exist_ok=True)
    (OUT_075 / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    shutil.copyfile(OUT / "tokenizer.model", OUT_075 / CONFIG["tokenizer_name"])
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(OUT / "tokenizer.model"))
    model = build_lm()
    save_weights(model, OUT_075 / CONFIG["moshi_name"], CONFIG)
    clone = prefix_codes(12, 41)
    runs = {
        "clone": run_generate(model, tokenizer, [SHORT_TEXT], [clone], 2.0),
        "batch": run_generate(
            model, tokenizer, TEXTS, [prefix_codes(10, 42), prefix_codes(6, 43)], 2.0
        ),
        "no_prefix": run_generate(model, tokenizer, [SHORT_TEXT], None, 2.0),
        "unguided": run_generate(model, tokenizer, [SHORT_TEXT], [clone], 1.0),
    }
    golden = {"settings": GENERATION, "runs": runs}
    (OUT_075 / "golden.json").write_text(dump_json(golden))


if __name__ == "__main__":
    sys.exit(main())
