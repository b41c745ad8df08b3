"""PersonaPlex (moshi_mlx.chat.persona): prompt schedule, batched prefill, prompt cache, its
checkpoints (NVIDIA's repairs, quantized files that carry their config) and bad input."""

import json
import logging
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import soundfile
from mlx.utils import tree_flatten
from tiny_moshi import tiny_personaplex_config, write_eight_step_file, write_tiny_personaplex

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.chat.persona.cache import load_state, save_state
from moshi_mlx.chat.persona.prompt import VoicePrompt, prompt_state
from moshi_mlx.chat.persona.role import read_role, role_tokens, wrapped
from moshi_mlx.chat.persona.schedule import (
    SILENCE_FRAMES,
    SILENCE_TOKENS,
    plan_prompt,
    prompt_frames,
)
from moshi_mlx.chat.persona.voice import load_voice_audio
from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.checkpoints.quantize import quantize_checkpoint
from moshi_mlx.errors import AudioError, ConfigError, WeightsError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.delayed_tokens import delayed_tokens_width
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.testing.checkpoints import load_lm


def _lm(config: LmConfig, seed: int = 0, full_depformer: bool = False) -> Lm:
    lm = Lm(config, full_depformer)
    lm.set_dtype(mx.float32)
    rng = np.random.default_rng(seed)
    params = [
        (name, mx.array(rng.uniform(-0.3, 0.3, p.shape).astype(np.float32)))
        for name, p in tree_flatten(lm.parameters())
    ]
    lm.load_weights(params)
    return lm


@pytest.fixture(scope="module")
def persona_lm():
    return _lm(tiny_personaplex_config())


def _voice(frames: int = 9, seed: int = 1) -> VoicePrompt:
    return VoicePrompt(codes=np.random.default_rng(seed).integers(0, 64, (frames, 8)))


def test_schedule_feeds_voice_silence_role_silence_and_leaves_the_acoustic_silence_given():
    config = tiny_personaplex_config()
    voice = _voice(5).codes
    frames = prompt_frames(voice, [7, 8, 9])
    assert len(frames) == 5 + 2 * SILENCE_FRAMES + 3
    plan = plan_prompt(config, frames, delayed_tokens_width(config))
    assert plan.runs == len(frames) - 1 == len(plan.inputs)
    # Run r reads column r: the voice's semantic code of frame r (frame 0 is overwritten by
    # the initial tokens), text padding, the user's sine.
    assert plan.inputs[1, 1] == voice[1, 0] and plan.inputs[1, 0] == 3
    assert plan.inputs[1, 2] == config.card  # delayed codebooks start from their initial token
    assert plan.inputs[2, 2] == voice[1, 1]  # then run one frame behind
    role_run = 5 + SILENCE_FRAMES
    assert list(plan.inputs[role_run : role_run + 3, 0]) == [7, 8, 9]
    # The conversation's first target column: Moshi's acoustic codebooks given (silence).
    width = delayed_tokens_width(config)
    target = (plan.runs + 1) % width
    assert not plan.given[:2, target].any() and plan.given[2:, target].all()
    assert list(plan.columns[2:9, target]) == list(SILENCE_TOKENS[1:])


@pytest.mark.parametrize("bits", [None, 8])
def test_prefill_leaves_the_ring_as_step_by_step_replay(bits):
    config = replace(tiny_personaplex_config(), dim=128, num_heads=4)
    lm = _lm(config)
    quant = None if bits is None else KVQuantization.of(bits, 32)
    config = lm.config
    plan = plan_prompt(
        config, prompt_frames(_voice(12).codes, [5, 6]), delayed_tokens_width(config)
    )
    inputs = mx.array(plan.inputs, mx.int32)
    prefilled = lm.prefill(lm.embed(inputs.T[None]), lm.make_ring(quantization=quant))
    ring = lm.make_ring(quantization=quant)
    for t in range(plan.runs):
        ring = ring.grown(t)
        lm.step_text(inputs[t][None, :, None], ring)
        ring = ring.advanced()
    probe = inputs[-1][None, :, None]
    a = lm.step_text(probe, ring.grown(plan.runs))[1]
    b = lm.step_text(probe, prefilled.grown(plan.runs))[1]
    assert prefilled.position.item() == ring.position.item() == plan.runs
    tolerance = 1e-5 if bits is None else 2e-2  # 8 bits: the prefill attends unquantized
    assert float(mx.abs(a - b).max()) <= tolerance * float(mx.abs(a).max())


def _greedy(lm, start, steps=12, seed=0):
    gen = ChatStepper(lm, GREEDY, GREEDY, seed=0, start=start)
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        step = gen.step(rng.integers(0, 64, 8))
        out.append((step.text.item(), tuple(np.array(step.frame).tolist())))
    return out


def test_a_restored_prompt_cache_gives_the_same_tokens(persona_lm, tmp_path):
    state = prompt_state(persona_lm, _voice(), [11, 12, 13])
    mx.eval(state.ring.keys, state.ring.values, state.tokens, state.given)
    save_state(tmp_path, "k", state)
    restored = load_state(tmp_path, "k")
    assert restored is not None and restored.step_index == state.step_index
    assert _greedy(persona_lm, restored) == _greedy(persona_lm, state)
    assert load_state(tmp_path, "missing") is None
    (tmp_path / "k.safetensors").write_bytes(b"garbage")
    assert load_state(tmp_path, "k") is None  # unreadable: recomputed, never an error


def test_first_conversation_step_returns_the_given_silence(persona_lm):
    state = prompt_state(persona_lm, _voice(), [11])
    gen = ChatStepper(persona_lm, seed=3, start=state)
    step = gen.step(np.zeros(8, np.int64))
    sampled = np.array(step.sampled)
    assert list(sampled[2:]) == list(SILENCE_TOKENS[1:])  # forced, not sampled


def test_role_too_long_for_the_context_says_how_long_it_may_be(persona_lm):
    with pytest.raises(ConfigError, match=r"may be at most \d+ tokens"):
        prompt_state(persona_lm, _voice(40), list(range(200)))


def test_role_wrapping_and_files(tmp_path):
    assert wrapped(" be kind ") == "<system> be kind <system>"
    assert wrapped("<system> x <system>") == "<system> x <system>"
    (tmp_path / "role.txt").write_text("You are Ada.", encoding="utf-8")
    assert read_role(f"@{tmp_path / 'role.txt'}") == "You are Ada."
    with pytest.raises(ConfigError, match="role file not found"):
        read_role(f"@{tmp_path / 'none.txt'}")
    assert role_tokens("   ", None) == []


def test_voice_recordings_are_checked(tmp_path):
    long = tmp_path / "long.wav"
    soundfile.write(str(long), np.zeros(31 * 8000, np.float32) + 0.1, 8000)
    with pytest.raises(AudioError, match="at most 30 s"):
        load_voice_audio(long)
    silent = tmp_path / "silent.wav"
    soundfile.write(str(silent), np.zeros(24000, np.float32), 24000)
    with pytest.raises(AudioError, match="silent"):
        load_voice_audio(silent)


@pytest.fixture(scope="module")
def personaplex_files(tmp_path_factory):
    return write_tiny_personaplex(tmp_path_factory.mktemp("personaplex"))


def test_an_8_step_file_is_repaired_as_nvidia_does_with_notices(
    personaplex_files, tmp_path, caplog
):
    config = tiny_personaplex_config()
    path = write_eight_step_file(personaplex_files["moshi"], tmp_path / "eight.safetensors")
    with caplog.at_level(logging.WARNING, logger="moshi_mlx.checkpoints"):
        lm = load_lm(path, config, mx.float32, full_depformer=True)
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) == 2 and all("steps 8-15" in n for n in notices)
    slices = lm.depformer.slices
    for k in range(1, 8):
        assert mx.array_equal(slices[k + 8].linear_in.weight, slices[k].linear_in.weight)
        assert mx.array_equal(slices[k + 8].emb.weight, slices[k].emb.weight)
    attention = [s.transformer.layers[0].self_attn.in_proj.weight for s in (slices[3], slices[11])]
    assert mx.array_equal(*attention)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="moshi_mlx.checkpoints"):
        played = load_lm(path, config, mx.float32)  # inference needs no repair
    assert not caplog.records and len(played.depformer.slices) == 8


def test_personaplex_quantizes_to_files_that_carry_their_config(personaplex_files, tmp_path):
    moshi = personaplex_files["moshi"]
    output = tmp_path / "model.q4.safetensors"
    quantize_checkpoint(
        moshi, output, bits=4, group_size=64, progress=False, config=tiny_personaplex_config()
    )
    header = json.loads(
        output.read_bytes()[8 : 8 + int.from_bytes(output.read_bytes()[:8], "little")]
    )
    assert json.loads(header["__metadata__"]["lm_config"])["generator"] == "personaplex"
    lm = load_lm(output)  # no config file beside it, no flag
    assert lm.config == tiny_personaplex_config() and len(lm.depformer.slices) == 8
    state = prompt_state(lm, _voice(), [4, 5])
    assert len(_greedy(lm, state, steps=3)) == 3


def test_the_published_layout_is_personaplex_without_a_config(tmp_path):
    from moshi_mlx.checkpoints.io import SafetensorsWriter

    layout = {f"depformer_in.{k}.weight": ((1024, 4096), mx.bfloat16) for k in range(16)}
    with open(tmp_path / "m.safetensors", "wb") as file:  # sparse: no data written
        SafetensorsWriter(file, layout, metadata={})
    assert lm_config_of(tmp_path / "m.safetensors") == LmConfig.personaplex_7b()


def test_saved_voice_of_the_wrong_model_is_refused(persona_lm, tmp_path):
    from moshi_mlx.chat.persona.voice import read_voice, voice_source

    fixture = Path(__file__).parents[1] / "fixtures" / "torch_zip"
    own = fixture / "persona_voice.pt"  # the one made for this model (tests' voices.tgz)
    candidates = sorted(set(fixture.glob("*.pt")) - {own})
    assert candidates
    for candidate in candidates:  # none is a voice of this model: each refused in one line
        with pytest.raises(WeightsError):
            read_voice(voice_source(candidate), persona_lm.config, None)
    voice = read_voice(voice_source(own), persona_lm.config, None)
    assert voice.embeddings.shape == (4, persona_lm.config.dim) and voice.ring.shape == (17, 4)
