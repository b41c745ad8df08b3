"""PersonaPlex against NVIDIA's PyTorch reference (golden outputs of
`scripts/make_personaplex_fixtures.py`, tiny random weights in its published layout, float32):
the prompt of a wav voice and a role, then a conversation on fixed user codes."""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from closeness import max_relative
from tiny_moshi import write_eight_step_file

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.chat.persona.prompt import VoicePrompt, prompt_state
from moshi_mlx.chat.persona.voice import encode_voice, load_voice_audio, read_voice, voice_source
from moshi_mlx.chat.teacher_forcing import depformer_logits
from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.models.mimi import MimiConfig
from moshi_mlx.runtime.codec import MlxCodec
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.testing.checkpoints import load_lm

FIXTURES = Path(__file__).parents[1] / "fixtures" / "personaplex"
MIMI = Path(__file__).parents[1] / "fixtures" / "mimi"
TEACHER_STEPS = 40
RELATIVE = 1e-4

pytestmark = pytest.mark.skipif(
    not (FIXTURES / "golden16.npz").is_file(), reason="PersonaPlex fixtures not generated"
)


@pytest.fixture(scope="module")
def tiny_mimi():
    config = MimiConfig.from_dict(json.loads((MIMI / "config.json").read_text()))
    return load_mimi(MIMI / "weights.safetensors", 8, config)


def _config() -> LmConfig:
    return LmConfig.from_dict(json.loads((FIXTURES / "config.json").read_text()))


def _conversation(lm, state, user_codes, steps):
    """Greedy steps from `state` on the user's codes, with each step's logits computed on the
    inputs the step fed: tokens (steps, 17), text logits, Moshi's audio logits."""
    generator = ChatStepper(lm, GREEDY, GREEDY, seed=0, start=state)
    ring = state.ring
    tokens, text_logits, audio_logits = [], [], []
    for t in range(steps):
        step = generator.step(user_codes[t])
        ring = ring.grown(state.step_index + t)
        temporal_out, text = lm.step_text(step.inputs[None, :, None], ring)
        ring = ring.advanced()
        previous = step.sampled[None, : lm.config.moshi_codebooks]
        audio = depformer_logits(lm.depformer, temporal_out, previous)
        mx.eval(text, audio, ring.keys, ring.values)
        text_logits.append(np.array(text[0]))
        audio_logits.append(np.array(audio[0]))
        tokens.append([step.text.item(), *np.array(step.frame).tolist()])
    return np.array(tokens), np.stack(text_logits), np.stack(audio_logits)


def _check_tokens(ours: np.ndarray, theirs: np.ndarray) -> None:
    """Our steps' tokens against NVIDIA's outputs: the same audio frames; the text token
    equal too, one step earlier (we return it when it is sampled, NVIDIA's generator with
    its frame, `max_delay` steps later; its first is the prompt's last, padding)."""
    np.testing.assert_array_equal(ours[:, 1:], theirs[:, 1 : ours.shape[1]])
    np.testing.assert_array_equal(ours[:-1, 0], theirs[1:, 0])
    assert theirs[0, 0] == 3


def _check_audio_logits(audio: np.ndarray, golden: dict, prefix: str) -> None:
    """Moshi's codebooks' logits against the reference's: the columns it kept, and each
    distribution's log-sum-exp (which all the columns enter)."""
    kept = golden[f"{prefix}audio_logits"][: len(audio), : audio.shape[1]]
    columns = golden["audio_logit_columns"]
    assert max_relative(audio[:, :, columns], kept) <= RELATIVE
    logsumexp = np.log(np.exp(audio.astype(np.float64)).sum(-1))
    theirs = golden[f"{prefix}audio_logsumexp"][: len(audio), : audio.shape[1]]
    assert max_relative(logsumexp, theirs) <= RELATIVE


@pytest.mark.parametrize("steps_in_file", [16, 8])
def test_wav_voice_role_and_conversation_match_nvidia(steps_in_file, tiny_mimi, tmp_path):
    """The 8-step file is cut from the 16-step one as the fixture script cuts it."""
    golden = dict(np.load(FIXTURES / f"golden{steps_in_file}.npz"))
    weights = FIXTURES / "weights16.safetensors"
    if steps_in_file == 8:
        weights = write_eight_step_file(weights, tmp_path / "weights8.safetensors")
    lm = load_lm(weights, _config(), mx.float32)
    codes = encode_voice(load_voice_audio(FIXTURES / "voice.wav"), MlxCodec(tiny_mimi))
    np.testing.assert_array_equal(codes, golden["voice_codes"])
    state = prompt_state(lm, VoicePrompt(codes=codes), list(golden["role_tokens"]))
    assert state.step_index == int(golden["prompt_calls"]) - 1
    steps = len(golden["tokens"])
    tokens, text, audio = _conversation(lm, state, golden["user_codes"], steps)
    _check_tokens(tokens, golden["tokens"])
    n = min(TEACHER_STEPS, len(golden["text_logits"]))
    assert max_relative(text[:n], golden["text_logits"][:n]) <= RELATIVE
    _check_audio_logits(audio[:n], golden, "")


def test_a_voice_saved_by_nvidia_gives_the_state_of_its_wav(tiny_mimi):
    golden = dict(np.load(FIXTURES / "golden16.npz"))
    lm = load_lm(FIXTURES / "weights16.safetensors", _config(), mx.float32)
    role = list(golden["role_tokens"])
    from_wav = prompt_state(
        lm, read_voice(voice_source(FIXTURES / "voice.wav"), lm.config, MlxCodec(tiny_mimi)), role
    )
    from_pt = prompt_state(
        lm, read_voice(voice_source(FIXTURES / "voice.pt"), lm.config, None), role
    )
    np.testing.assert_array_equal(np.array(from_pt.tokens), np.array(from_wav.tokens))
    np.testing.assert_array_equal(np.array(from_pt.given), np.array(from_wav.given))
    for ours, theirs in zip(from_pt.ring.keys, from_wav.ring.keys):
        assert max_relative(np.array(ours), np.array(theirs)) <= RELATIVE
    steps = len(golden["pt_tokens"])
    tokens, text, audio = _conversation(lm, from_pt, golden["user_codes"], steps)
    _check_tokens(tokens, golden["pt_tokens"])
    n = TEACHER_STEPS
    assert max_relative(text[:n], golden["pt_text_logits"][:n]) <= RELATIVE
    _check_audio_logits(audio[:n], golden, "pt_")
