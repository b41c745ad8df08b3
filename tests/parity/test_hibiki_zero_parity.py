"""Hibiki-Zero against Kyutai's PyTorch `LMGen` as the `hibiki-zero` package drives it (golden
outputs of `scripts/make_hibiki_zero_fixtures.py`: tiny random weights in the layout of
kyutai/hibiki-zero-3b-pytorch-bf16, float32, greedy): grouped-query attention, split-halves
RoPE, depformer output norms and 16 slices over 9 weight sets, over 60 source frames (the
context is 16, so past the attention window) with the end-of-input frame at 50.
"""

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from closeness import max_relative

from moshi_mlx.chat.check import compare_generation
from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.chat.teacher_forcing import depformer_logits
from moshi_mlx.checkpoints.quantize import quantize_checkpoint
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.testing.checkpoints import load_lm

FIXTURES = Path(__file__).parents[1] / "fixtures" / "hibiki_zero"
RELATIVE = 1e-4
SKIPPED = 2  # LMGen.step returns None while the delays (2) fill


@pytest.fixture(scope="module")
def hibiki_zero():
    return load_lm(FIXTURES / "weights.safetensors", dtype=mx.float32)


@pytest.fixture(scope="module")
def golden():
    return np.load(FIXTURES / "golden.npz")


def test_the_published_layout_is_read(hibiki_zero):
    config = hibiki_zero.config
    assert (config.kv_repeat, config.positional_embedding, config.depformer_norm) == (
        2,
        "rope_concat",
        "layer_norm",
    )
    assert config.depformer_weights_per_step_schedule == (*range(8), *[8] * 8)
    assert config.temporal_config().num_kv_heads == 2
    ring = hibiki_zero.make_ring()
    assert ring.keys[0].shape[1] == 2  # the ring holds the key/value heads, not the queries'


def test_teacher_forced_logits_step_by_step(hibiki_zero, golden):
    """The reference's inputs through the temporal step (its KV ring) and the depformer's
    slices with their inputs given (`depformer_logits`)."""
    ring = hibiki_zero.make_ring()
    for t, column in enumerate(golden["input_tokens"]):
        ring = ring.grown(t)
        out, logits = hibiki_zero.step_text(mx.array(column[None, :, None]), ring)
        ring = ring.advanced()
        assert max_relative(np.array(logits[0]), golden["text_logits"][t]) < RELATIVE, t
        prev = mx.array(golden["depformer_prev"][t][None])
        dep_logits = depformer_logits(hibiki_zero.depformer, out, prev)[0]
        assert max_relative(np.array(dep_logits), golden["depformer_logits"][t]) < RELATIVE, t


def test_greedy_generation_matches_pytorch(hibiki_zero, golden):
    """The compiled step (KV ring past its window) gives the reference's tokens exactly."""
    generator = ChatStepper(hibiki_zero, GREEDY, GREEDY, seed=0)
    inputs, sampled, codes = [], [], []
    for frame in golden["source_codes"]:
        step = generator.step(frame)
        inputs.append(np.array(step.inputs))
        sampled.append(np.array(step.sampled))
        moshi = step.frame
        codes.append(np.full(16, -1) if moshi is None else np.array(moshi))
    sampled = np.stack(sampled)
    np.testing.assert_array_equal(np.stack(inputs), golden["input_tokens"])
    np.testing.assert_array_equal(sampled[:, 0], golden["sampled_text"])
    np.testing.assert_array_equal(sampled[:, 1:], golden["sampled_audio"])
    np.testing.assert_array_equal(np.stack(codes)[SKIPPED:], golden["tokens"][SKIPPED:, 1:])
    np.testing.assert_array_equal(sampled[:-SKIPPED, 0], golden["tokens"][SKIPPED:, 0])
    assert len(np.unique(golden["sampled_text"])) > 10  # a stream worth comparing


@pytest.mark.parametrize("bits", [8, 4])
def test_our_quantizer_reads_the_published_layout(hibiki_zero, bits, tmp_path):
    """The PyTorch-named bf16 file to our q8 / q4 (grouped attention rows, the norms kept in
    float), loaded and run beside the bf16 model."""
    out = tmp_path / f"model.q{bits}.safetensors"
    quantize_checkpoint(FIXTURES / "weights.safetensors", out, bits, progress=False)
    weights = FIXTURES / "weights.safetensors"
    check = compare_generation(weights, out, hibiki_zero.config, steps=20)
    print(f"q{bits}", check.summary())
    assert check.text_agreement >= (0.8 if bits == 8 else 0.3), check.summary()
    assert check.relative_logit_error < (0.08 if bits == 8 else 0.4), check.summary()
