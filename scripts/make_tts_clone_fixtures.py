"""Golden outputs of Kyutai's PyTorch TTS continuing an audio prefix (voice cloning), for
tests/parity/test_tts_clone_parity.py.

Run with the reference environment (torch + Kyutai's `moshi` 0.2.13), from the repository
root, after scripts/make_tts_fixtures.py (whose tiny checkpoint, tokenizer and voices it uses):

    /opt/venvs/ref/bin/python scripts/make_tts_clone_fixtures.py

`TTSModel.generate(..., prefixes=[prefix])` is how `moshi` 0.2.13 clones a voice: the prefix
is `TTSModel.get_prefix(wav)`, Mimi's codes of the wav (its last 2 frames dropped) under a text
row of "no input" (-1). The text fed is that row while the prefix lasts, and only then does the
text schedule start; each codebook k is forced to the prefix's codes `delays[k] + delay_steps`
steps late (after the depformer sampled it). Mimi is left out here: the prefix's codes are
fixed random codes, as the codes of some wav.

tests/fixtures/tts_clone/golden.json: "settings" (make_tts_fixtures.py's GENERATION), "prefix"
(9, PREFIX) ints (row 0: -1, then 8 codebooks), and one greedy run of SHORT_TEXT with voice
alice and cfg 2.0, its "steps" and "row" as in golden_generate.json ("logged_text_tokens",
"frames", "end_step", "consumption_times", "transcript").
"""

from __future__ import annotations

import sys

import numpy as np
import sentencepiece
import torch
from make_tts_fixtures import (
    GENERATION,
    OUT,
    SHORT_TEXT,
    build_lm,
    build_tts,
    dump_json,
    published_state,
)
from safetensors.torch import load_file

CLONE_OUT = OUT.parent / "tts_clone"
PREFIX = 12  # frames of the prefix (about 1 s)


def main() -> None:
    torch.set_num_threads(1)
    model = build_lm()
    stored = load_file(str(OUT / "weights.safetensors"))
    for name, tensor in published_state(model).items():  # the fixture's own weights
        assert torch.equal(tensor, stored[name]), name
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(OUT / "tokenizer.model"))
    tts = build_tts(model, tokenizer)
    rng = np.random.default_rng(41)
    codes = rng.integers(0, model.card, (model.n_q, PREFIX))
    prefix = np.concatenate([np.full((1, PREFIX), -1), codes]).astype(np.int64)
    entries = [tts.prepare_script([SHORT_TEXT], padding_between=GENERATION["padding_between"])]
    voice = OUT / "voices" / "alice.safetensors"
    attributes = [tts.make_condition_attributes([voice], cfg_coef=2.0)]
    with torch.no_grad():
        result = tts.generate(entries, attributes, prefixes=[torch.from_numpy(prefix)])
    steps = len(result.logged_text_tokens[0])
    frames = torch.stack(result.frames)[..., 0].numpy()  # (steps - 2, 1, 9)
    row = {
        "text": SHORT_TEXT,
        "voice": "alice",
        "cfg": 2.0,
        "logged_text_tokens": [list(pair) for pair in result.logged_text_tokens[0]],
        "frames": frames[:, 0].tolist(),
        "end_step": result.end_steps[0],
        "consumption_times": list(result.all_consumption_times[0]),
        "transcript": [list(pair) for pair in result.all_transcripts[0]],
    }
    golden = {"settings": GENERATION, "prefix": prefix.tolist(), "steps": steps, "row": row}
    CLONE_OUT.mkdir(parents=True, exist_ok=True)
    (CLONE_OUT / "golden.json").write_text(dump_json(golden))
    print(f"clone: {steps} steps, end step {result.end_steps[0]}")
    print(f"  fed: {[fed for _, fed in result.logged_text_tokens[0]][:40]}")


if __name__ == "__main__":
    sys.exit(main())
