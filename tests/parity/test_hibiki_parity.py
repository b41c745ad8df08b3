"""Hibiki against Kyutai's PyTorch `LMGen` (golden outputs of `scripts/make_stt_fixtures.py`,
tiny random weights in Hibiki 1B's layout, float32): the "description" condition summed into
every input, classifier-free guidance with cfg_coef 3 (batch 2: "very_good" and "very_bad")
and 1 (one "very_good" row), greedy, over 60 source frames with the end-of-input frame at 50.

Kyutai's MLX `LmGen` gives both guidance rows the condition "very_good", so its guidance does
nothing; ours follows PyTorch, and `test_guidance_changes_the_logits` shows it acts.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from closeness import max_relative

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.errors import ConfigError, MoshiError
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.testing.checkpoints import load_lm

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hibiki"
RELATIVE = 1e-4
SKIPPED = 2  # LMGen.step returns None while the delays (2) fill


@pytest.fixture(scope="module")
def hibiki():
    return load_lm(FIXTURES / "weights.safetensors", dtype=mx.float32)


def _run(lm, cfg_coef: float, source: np.ndarray) -> dict[str, np.ndarray]:
    generator = ChatStepper(lm, GREEDY, GREEDY, seed=0, cfg_coef=cfg_coef)
    out = {k: [] for k in ("text_logits", "depformer_logits", "sampled", "codes")}
    for codes in source:
        step = generator.step(codes)
        text_logits, audio_logits = step.text_logits, step.audio_logits
        out["text_logits"].append(np.array(text_logits))
        out["depformer_logits"].append(np.array(audio_logits))
        out["sampled"].append(np.array(step.sampled))
        codes = step.frame
        out["codes"].append(np.full(8, -1) if codes is None else np.array(codes))
    return {k: np.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("cfg_coef", [3.0, 1.0])
def test_guided_generation_matches_pytorch(hibiki, cfg_coef):
    golden = np.load(FIXTURES / f"golden_cfg{cfg_coef:g}.npz")
    condition = hibiki.condition(
        [{"description": v} for v in ("very_good", "very_bad")[: golden["condition"].shape[0]]]
    )
    assert max_relative(np.array(condition), golden["condition"][:, 0]) < RELATIVE
    ours = _run(hibiki, cfg_coef, golden["source_codes"])
    for t in range(len(golden["source_codes"])):
        assert max_relative(ours["text_logits"][t], golden["text_logits"][t]) < RELATIVE, t
        assert (
            max_relative(ours["depformer_logits"][t], golden["depformer_logits"][t]) < RELATIVE
        ), t
    np.testing.assert_array_equal(ours["sampled"][:, 0], golden["sampled_text"])
    np.testing.assert_array_equal(ours["sampled"][:, 1:], golden["sampled_audio"])
    # What LMGen.step returned: the text of 2 steps before, Moshi's realigned frame.
    np.testing.assert_array_equal(ours["codes"][SKIPPED:], golden["tokens"][SKIPPED:, 1:])
    np.testing.assert_array_equal(ours["sampled"][:-SKIPPED, 0], golden["tokens"][SKIPPED:, 0])


def test_a_first_step_without_input_is_lmgens_first_step(hibiki):
    """`LMGen` never reads its first step's input (the delays' initial tokens stand in), so
    `run_inference`'s first frame fed twice is a step without input (codes -1) then that
    frame: the same logits and tokens as the golden run, whose first step had other codes."""
    golden = np.load(FIXTURES / "golden_cfg3.npz")
    source = golden["source_codes"].copy()
    source[0] = -1
    ours = _run(hibiki, 3.0, source)
    for t in range(len(source)):
        assert max_relative(ours["text_logits"][t], golden["text_logits"][t]) < RELATIVE, t
    np.testing.assert_array_equal(ours["sampled"][:, 0], golden["sampled_text"])
    np.testing.assert_array_equal(ours["sampled"][:, 1:], golden["sampled_audio"])


def test_guidance_changes_the_logits(hibiki):
    source = np.load(FIXTURES / "golden_cfg3.npz")["source_codes"][:10]
    guided, plain = _run(hibiki, 3.0, source), _run(hibiki, 1.0, source)
    assert max_relative(guided["text_logits"], plain["text_logits"]) > 0.1
    assert max_relative(guided["depformer_logits"], plain["depformer_logits"]) > 0.1


def test_conditions_are_checked(hibiki, tiny_lm_checkpoints):
    with pytest.raises(ConfigError, match="cannot be 'great': use one of very_bad, bad"):
        ChatStepper(hibiki, condition={"description": "great"})
    with pytest.raises(MoshiError, match="takes no condition"):
        ChatStepper(load_lm(tiny_lm_checkpoints["bf16"]), cfg_coef=3.0)
