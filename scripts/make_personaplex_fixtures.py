"""Golden outputs of NVIDIA's PersonaPlex PyTorch reference, for our PersonaPlex parity tests.

Run with the PersonaPlex reference environment (torch + NVIDIA's `moshi` fork), from the
repository root:

    /opt/venvs/personaplex/bin/python scripts/make_personaplex_fixtures.py

It builds a tiny random LM in PersonaPlex's layout (16 depformer steps: 8 for Moshi's codebooks,
8 for the user's; float32, weights rounded to bfloat16 values so the bf16 files are exact), the
tiny Mimi of tests/fixtures/mimi, a tiny tokenizer and a synthetic voice, then runs NVIDIA's
`LMGen` the way its offline.py does (voice prompt, silence, role prompt, silence, then greedy
conversation steps over fixed user codes). It writes to tests/fixtures/personaplex/:
- config.json: the LM config in Kyutai's config.json keys, plus ours ("user_codebooks": 8,
  "generator": "personaplex"),
- weights16.safetensors: the LM (bf16) under NVIDIA's PyTorch names, all 16 depformer steps,
- (not kept: the tests cut weights8.safetensors from weights16 by the same rule) the same LM
  cut to 8 depformer steps, as NVIDIA's 8-step checkpoints are (self_attn rows of steps 0-7; no gating/linears/depformer_in 8-15, depformer_emb 8-14);
  NVIDIA's loader repairs steps 8-15 from 0-7, so golden8's audio logits of steps 8-15 differ
  from golden16's (its tokens and text logits do not: those steps predict the user's codebooks,
  which the user's codes always override),
- tokenizer.model: a tiny SentencePiece (BPE, 100 pieces, <pad> = 3),
- voice.wav: 1.3 s of synthetic vowels, 24 kHz mono PCM16,
- voice.pt: what `LMGen(save_voice_prompt_embeddings=True)` writes for voice.wav (weights16),
- golden16.npz, golden8.npz (one per weights file), with keys:
  - voice_codes (frames, 8): the Mimi codes of the voice prompt frames,
  - role_tokens (n,): `tokenizer.encode(wrap_with_system_tags(ROLE))`,
  - user_codes (STEPS, 8): the user's Mimi codes, one frame per conversation step (STEPS 100),
  - tokens (STEPS, 17): what `LMGen.step(user frame)` returns (text + 16 audio, delays undone;
    it lags: row 0 is the prompt's last frame),
  - text_logits (STEPS, text_card): the text logits of each step,
  - audio_logits (LOGIT_STEPS, 16, C): the depformer logits at audio_logit_columns only
    (LOGIT_STEPS 40, C 64: full rows would be 2048 wide), audio_logit_columns (C,) and
    audio_logsumexp (LOGIT_STEPS, 16) over all 2048 logits,
  - num_voice_frames, prompt_calls (LMGen steps of the whole prompt), offset_after_prompt,
    cache_after_prompt (1, 17, 4) and provided_after_prompt (1, 17, 4): LMGen's delayed tokens
    (the prompt's last step provided Moshi's delayed codebooks for the first conversation
    step, so that step's depformer is forced to the silence tokens there),
  - golden16.npz also pt_tokens, pt_text_logits, pt_audio_logits, pt_audio_logsumexp: the same
    conversation started from voice.pt instead of voice.wav.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import tempfile
import wave
from pathlib import Path

import numpy as np
import sentencepiece
import torch
from fixture_tokenizer import train_bpe_tokenizer
from fixture_weights import round_to_bf16
from moshi.models import loaders
from moshi.models.compression import MimiModel
from moshi.models.lm import SILENCE_TOKENS, SINE_TOKENS, LMGen, LMModel
from moshi.modules import SEANetDecoder, SEANetEncoder, transformer
from moshi.offline import wrap_with_system_tags
from moshi.quantization import SplitResidualVectorQuantizer
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "personaplex"
MIMI_DIR = ROOT / "tests" / "fixtures" / "mimi"

# scripts/make_lm_fixtures.py's tiny config in PersonaPlex's shape: 2048 audio tokens (the fixed
# silence and sine frames use tokens up to 2008), 16 depformer steps, a context that holds the
# whole prompt. The width is 16, not 64: with 2048 tokens the 47 token tables and output
# linears hold 2049 * dim values each, which at width 64 would make the two weight files 21 MB.
TINY_CONFIG = {
    "dim": 16,
    "num_heads": 4,
    "num_layers": 2,
    "hidden_scale": 3.0,
    "context": 64,
    "max_period": 10000.0,
    "positional_embedding": "rope",
    "norm": "rms_norm_f32",
    "gating": "silu",
    "causal": True,
    "layer_scale": None,
    "depformer_dim": 16,
    "depformer_num_heads": 4,
    "depformer_num_layers": 2,
    "depformer_dim_feedforward": 24,
    "depformer_context": 16,
    "depformer_max_period": 10000.0,
    "depformer_pos_emb": "none",
    "depformer_gating": "silu",
    "depformer_layer_scale": None,
    "depformer_multi_linear": True,
    "depformer_weights_per_step": True,
    "card": 2048,
    "text_card": 100,  # the tokenizer's vocabulary, checked after training it
    "n_q": 16,
    "dep_q": 16,
    "delays": [0, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1],
    "existing_text_padding_id": 3,
}
OUR_KEYS = {"user_codebooks": 8, "generator": "personaplex"}
OLD_STEPS = 8  # depformer steps of NVIDIA's 8-step checkpoints
# A per-step module's name: NVIDIA's loader copies steps 8-15 of these from 0-7.
STEP_NAME = re.compile(r"\b(linears|depformer_in|depformer_emb|gating)\.(\d+)\.")

SENTENCES = [
    "hello there how are you today",
    "i am moshi a speech model running on your computer",
    "the quick brown fox jumps over the lazy dog",
    "what a nice day to talk about the weather",
    "<system> you are moshi a speech model and you like the weather <system>",
    "<system> you like to talk and you are a nice model <system>",
]
ROLE = "you are moshi a speech model and you like the weather"

SAMPLE_RATE = 24000
FRAME_RATE = 12.5
VOICE_SECONDS = 1.3
STEPS = 100  # conversation steps after the prompt
LOGIT_STEPS = 40  # steps whose audio logits are saved
RANDOM_COLUMNS = 31  # audio logit columns saved besides 0-15, the silence/sine tokens and 2047


def train_tokenizer() -> bytes:
    return train_bpe_tokenizer(
        SENTENCES, TINY_CONFIG["text_card"], TINY_CONFIG["existing_text_padding_id"]
    )


def lm_kwargs() -> dict:
    """NVIDIA's LM kwargs with the tiny sizes."""
    return {**loaders._lm_kwargs, **TINY_CONFIG}


def build_lm() -> LMModel:
    torch.manual_seed(1234)
    return round_to_bf16(LMModel(device="cpu", dtype=torch.float32, **lm_kwargs()))


def eight_step_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` as NVIDIA's 8-step checkpoints store it."""
    dim = TINY_CONFIG["depformer_dim"]
    out = {}
    for name, tensor in state.items():
        step = STEP_NAME.search(name)
        if step and int(step[2]) >= OLD_STEPS:
            continue
        if name.startswith("depformer.") and ".self_attn." in name:  # rows packed step by step
            tensor = tensor[: (3 if name.endswith("in_proj_weight") else 1) * dim * OLD_STEPS]
        out[name] = tensor
    return out


def repaired_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What NVIDIA's loader makes of `eight_step_state(state)`: steps 8-15 copied from 0-7."""
    old = eight_step_state(state)
    out = {}
    for name, tensor in state.items():
        if name not in old:
            out[name] = old[STEP_NAME.sub(lambda m: f"{m[1]}.{int(m[2]) - OLD_STEPS}.", name)]
        elif old[name].shape != tensor.shape:
            out[name] = torch.cat([old[name], old[name]])
        else:
            out[name] = old[name]
    return out


def load_lm(path: Path) -> tuple[LMModel, list[str]]:
    """The LM NVIDIA's loader builds from `path`, and the notices it prints."""
    kwargs, printed = loaders._lm_kwargs, io.StringIO()
    loaders._lm_kwargs = lm_kwargs()
    try:
        with contextlib.redirect_stdout(printed):
            model = loaders.get_moshi_lm(path, device="cpu", dtype=torch.float32)
    finally:
        loaders._lm_kwargs = kwargs
    return model.eval(), printed.getvalue().splitlines()


def load_mimi() -> MimiModel:
    """NVIDIA's MimiModel with the tiny config and weights of tests/fixtures/mimi."""
    config = json.loads((MIMI_DIR / "config.json").read_text())
    encoder = SEANetEncoder(**config["seanet"])
    model = MimiModel(
        encoder,
        SEANetDecoder(**config["seanet"]),
        SplitResidualVectorQuantizer(**config["quantizer"]),
        channels=config["channels"],
        sample_rate=config["sample_rate"],
        frame_rate=config["frame_rate"],
        encoder_frame_rate=config["sample_rate"] / encoder.hop_length,
        causal=True,
        resample_method="conv",
        encoder_transformer=transformer.ProjectedTransformer(**config["transformer"]),
        decoder_transformer=transformer.ProjectedTransformer(**config["transformer"]),
    )
    model.load_state_dict(load_file(str(MIMI_DIR / "weights.safetensors")))
    model.set_num_codebooks(8)
    model.eval()
    golden = np.load(MIMI_DIR / "golden.npz")
    codes = model.encode(torch.from_numpy(golden["pcm"])).numpy()
    assert np.array_equal(codes, golden["codes"]), "the tiny Mimi does not match its fixture"
    return model


def write_voice(path: Path) -> None:
    """A few sung vowels: a gliding pitch, formant-shaped harmonics, syllable envelopes."""
    t = np.arange(int(VOICE_SECONDS * SAMPLE_RATE)) / SAMPLE_RATE
    pitch = 130 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / SAMPLE_RATE
    syllable = np.minimum((t / 0.4).astype(int), 2)
    formants = np.array([[700, 1220, 2600], [300, 2300, 3000], [500, 900, 2400]])[syllable]
    pcm = np.zeros_like(t)
    for harmonic in range(1, 30):
        freq = harmonic * pitch
        gain = sum(1 / (1 + ((freq - formants[:, i]) / 120) ** 2) for i in range(3))
        pcm += gain * np.sin(harmonic * phase) / harmonic**0.5
    local = t - 0.4 * syllable
    envelope = np.sin(np.pi * np.clip(local / np.where(syllable == 2, 0.5, 0.4), 0, 1)) ** 0.5
    pcm *= envelope
    pcm = 0.5 * pcm / np.abs(pcm).max()
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(SAMPLE_RATE)
        out.writeframes(np.round(pcm * 32767).astype("<i2").tobytes())


def make_lm_gen(lm: LMModel, **kwargs) -> LMGen:
    """LMGen as NVIDIA's offline.py builds it, greedy, in streaming mode."""
    lm_gen = LMGen(
        lm,
        audio_silence_frame_cnt=int(0.5 * FRAME_RATE),
        sample_rate=SAMPLE_RATE,
        device="cpu",
        frame_rate=FRAME_RATE,
        use_sampling=False,
        **kwargs,
    )
    lm_gen.streaming_forever(1)
    return lm_gen


def run_prompt(lm_gen: LMGen, mimi: MimiModel, voice: Path, role_tokens: list[int]) -> list:
    """offline.py's prompt phase; returns the voice frames' Mimi codes."""
    voice_codes = []
    encode = lm_gen._encode_voice_prompt_frames

    def recorded(mimi):
        for codes in encode(mimi):
            voice_codes.append(codes[0, :, 0].numpy().copy())
            yield codes

    lm_gen._encode_voice_prompt_frames = recorded
    if voice.suffix == ".pt":
        lm_gen.load_voice_prompt_embeddings(str(voice))
    else:
        lm_gen.load_voice_prompt(str(voice))
    lm_gen.text_prompt_tokens = role_tokens
    mimi.reset_streaming()
    lm_gen.reset_streaming()
    lm_gen.step_system_prompts(mimi)
    mimi.reset_streaming()
    return voice_codes


def converse(
    lm: LMModel, mimi: MimiModel, voice: Path, role_tokens: list[int], user_codes: np.ndarray
) -> dict[str, np.ndarray]:
    lm_gen = make_lm_gen(lm, return_logits=True)
    with contextlib.redirect_stdout(io.StringIO()):  # "Done loading ..." notices
        voice_codes = run_prompt(lm_gen, mimi, voice, role_tokens)
    state = lm_gen._streaming_state
    prompt = {
        "voice_codes": np.array(voice_codes, np.int32).reshape(-1, 8),
        "offset_after_prompt": np.array(state.offset),
        "cache_after_prompt": state.cache.numpy().astype(np.int32),
        "provided_after_prompt": state.provided.numpy().copy(),
    }
    tokens, text_logits, audio_logits = [], [], []
    for codes in user_codes:
        out = lm_gen.step(torch.from_numpy(codes)[None, :, None])
        assert out is not None and out[0] is not None, "the prompt fills the delays"
        step_tokens, (step_text_logits, step_audio_logits) = out
        tokens.append(step_tokens[0, :, 0].numpy())
        text_logits.append(step_text_logits[0, 0, 0].numpy())
        audio_logits.append(step_audio_logits[0].numpy())
    audio = np.stack(audio_logits[:LOGIT_STEPS])  # (LOGIT_STEPS, 16, card)
    columns = audio_logit_columns()
    return prompt | {
        "tokens": np.stack(tokens).astype(np.int32),
        "text_logits": np.stack(text_logits).astype(np.float32),
        "audio_logits": audio[:, :, columns].astype(np.float32),
        "audio_logit_columns": columns.astype(np.int32),
        "audio_logsumexp": torch.from_numpy(audio).logsumexp(-1).numpy().astype(np.float32),
    }


def audio_logit_columns() -> np.ndarray:
    card = TINY_CONFIG["card"]
    fixed = set(range(16)) | set(SILENCE_TOKENS) | set(SINE_TOKENS) | {card - 1}
    rest = np.setdiff1d(np.arange(card), sorted(fixed))
    chosen = np.random.default_rng(7).choice(rest, RANDOM_COLUMNS, replace=False)
    return np.array(sorted(fixed | set(chosen.tolist())))


def save_voice_embeddings(lm: LMModel, mimi: MimiModel, role_tokens: list[int]) -> bytes:
    """The .pt that NVIDIA's LMGen writes beside the voice wav after the voice phase."""
    with tempfile.TemporaryDirectory() as tmp:
        voice = Path(tmp) / "voice.wav"
        shutil.copy(OUT / "voice.wav", voice)
        # return_logits=False: with it, the voice phase's first step returns (None, None) and
        # the embeddings list gets a None that torch.stack refuses.
        lm_gen = make_lm_gen(lm, save_voice_prompt_embeddings=True)
        with contextlib.redirect_stdout(io.StringIO()):
            run_prompt(lm_gen, mimi, voice, role_tokens)
        return voice.with_suffix(".pt").read_bytes()


@torch.no_grad()
def main() -> None:
    torch.set_num_threads(1)
    OUT.mkdir(parents=True, exist_ok=True)

    tokenizer_model = train_tokenizer()
    (OUT / "tokenizer.model").write_bytes(tokenizer_model)
    tokenizer = sentencepiece.SentencePieceProcessor(model_proto=tokenizer_model)
    assert tokenizer.vocab_size() == TINY_CONFIG["text_card"], tokenizer.vocab_size()
    role_tokens = tokenizer.encode(wrap_with_system_tags(ROLE))

    model = build_lm()
    state = {name: tensor.to(torch.bfloat16) for name, tensor in model.state_dict().items()}
    save_file(state, str(OUT / "weights16.safetensors"))
    scratch = Path(tempfile.mkdtemp())
    save_file(eight_step_state(state), str(scratch / "weights8.safetensors"))
    (OUT / "config.json").write_text(json.dumps(TINY_CONFIG | OUR_KEYS, indent=2) + "\n")
    write_voice(OUT / "voice.wav")
    mimi = load_mimi()
    mimi.streaming_forever(1)
    user_codes = np.random.default_rng(0).integers(0, 64, (STEPS, 8))

    for steps in (16, 8):
        lm, notices = load_lm((OUT if steps == 16 else scratch) / f"weights{steps}.safetensors")
        loaded, built = lm.state_dict(), model.state_dict()
        expected = built if steps == 16 else repaired_state(built)
        for name, tensor in expected.items():
            assert torch.equal(loaded[name], tensor), name
        print(f"weights{steps}: {len(notices)} loader notices", notices[:2])
        golden = converse(lm, mimi, OUT / "voice.wav", role_tokens, user_codes)
        if steps == 16:
            (OUT / "voice.pt").write_bytes(save_voice_embeddings(lm, mimi, role_tokens))
            from_pt = converse(lm, mimi, OUT / "voice.pt", role_tokens, user_codes)
            for key in ("tokens", "text_logits", "audio_logits", "audio_logsumexp"):
                golden[f"pt_{key}"] = from_pt[key]
                print(
                    f"  voice.pt vs voice.wav {key}: max |diff|",
                    np.abs(from_pt[key] - golden[key]).max(),
                )
        num_voice_frames = len(golden["voice_codes"])
        prompt_calls = num_voice_frames + 2 * int(0.5 * FRAME_RATE) + len(role_tokens)
        assert int(golden["offset_after_prompt"]) == prompt_calls
        golden |= {
            "role_tokens": np.array(role_tokens, np.int32),
            "user_codes": user_codes.astype(np.int32),
            "num_voice_frames": np.array(num_voice_frames),
            "prompt_calls": np.array(prompt_calls),
        }
        np.savez_compressed(OUT / f"golden{steps}.npz", **golden)
        print(f"  text tokens: {golden['tokens'][:20, 0].tolist()}")
    for path in sorted(OUT.iterdir()):
        print(f"{path.name}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
