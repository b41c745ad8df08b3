"""The batched listening step of models without a depformer (Kyutai's STT)."""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from moshi_mlx.errors import MoshiError
from moshi_mlx.models.config import LmConfig
from moshi_mlx.models.lm import Lm
from moshi_mlx.stt.stepper import SttStepper

STEPS = 40


def _tiny_stt(delays: list[int]) -> LmConfig:
    return LmConfig(
        dim=32, num_heads=2, num_layers=2, hidden_scale=2.0, context=12, card=16,
        text_card=50, n_q=8, dep_q=0, delays=tuple(delays), model_type="stt",
        extra_heads_num_heads=2, extra_heads_dim=3,
    )  # fmt: skip


def _model(delays: list[int]) -> Lm:
    mx.random.seed(3)
    lm = Lm(_tiny_stt(delays))
    lm.set_dtype(mx.float32)
    mx.eval(lm.parameters())
    return lm


def _run(lm: Lm, codes: np.ndarray, reserve: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """codes (B, steps, n_q) -> text (B, steps), heads (B, steps, H, C)."""
    stepper = SttStepper(lm, batch=codes.shape[0])
    stepper.reserve(reserve)
    texts, heads = [], []
    for t in range(codes.shape[1]):
        out = stepper.step(codes[:, t])
        texts.append(np.array(out.text))
        heads.append(np.array(out.head_probabilities))
    return np.stack(texts, axis=1), np.stack(heads, axis=1)


@pytest.mark.parametrize(
    "delays", [[0] * 9, [0, 2, 2, 2, 2, 2, 2, 2, 2], [1, 0, 0, 0, 0, 3, 3, 3, 3]]
)
def test_streams_batched_together_read_as_each_alone(delays):
    lm = _model(delays)
    codes = np.random.default_rng(0).integers(0, 16, (3, STEPS, 8))
    texts, heads = _run(lm, codes)
    for b in range(3):
        alone_text, alone_heads = _run(lm, codes[b : b + 1])
        assert np.array_equal(alone_text[0], texts[b])
        np.testing.assert_allclose(alone_heads[0], heads[b], atol=1e-5)
    assert heads.shape == (3, STEPS, 2, 3)
    np.testing.assert_allclose(heads.sum(-1), 1.0, atol=1e-5)


def test_a_step_reads_the_delayed_codes_and_its_own_text_like_kyutais_lmgen():
    """Step t feeds stream k the codes given at t - delays[k] (its start token before), and
    the text sampled at t - 1; its output is the text `max_delay - delays[0]` steps back."""
    delays = [1, 0, 0, 0, 0, 2, 2, 2, 2]
    lm = _model(delays)
    config = lm.config
    codes = np.random.default_rng(1).integers(0, 16, (1, STEPS, 8))
    texts, _ = _run(lm, codes)
    # The same model, unrolled by hand without a ring: greedy text from the full inputs.
    sampled, ring = [], lm.make_ring()
    for t in range(STEPS):
        inputs = [config.text_card if t <= delays[0] else sampled[t - 1]]
        inputs += [
            config.card if t <= d else int(codes[0, t - d, k]) for k, d in enumerate(delays[1:])
        ]
        ring = ring.grown(t)
        _, logits = lm.step_text(mx.array(inputs, mx.int32)[None, :, None], ring)
        ring = ring.advanced()
        sampled.append(int(mx.argmax(logits[0]).item()))
    lag = config.max_delay - delays[0]
    assert texts[0, config.max_delay :].tolist() == sampled[config.max_delay - lag : STEPS - lag]


def test_a_model_with_a_depformer_is_refused():
    with pytest.raises(MoshiError, match="without a depformer"):
        SttStepper(Lm(LmConfig.tiny()))


def test_a_ring_reserved_at_once_gives_the_same_steps():
    lm = Lm(replace(_tiny_stt([0] * 9), context=200))
    mx.eval(lm.parameters())
    codes = np.random.default_rng(1).integers(0, 16, (2, STEPS, 8))
    grown_texts, grown_heads = _run(lm, codes)
    texts, heads = _run(lm, codes, reserve=200)
    assert np.array_equal(texts, grown_texts)
    np.testing.assert_allclose(heads, grown_heads, atol=1e-6)


def test_a_step_writes_the_kv_ring_in_place():
    """A step adds one position to the ring: copying the whole ring instead (MLX does when a
    reference to the old buffers is still held) would cost a full ring's memory per step."""
    lm = Lm(replace(_tiny_stt([0] * 9), dim=64, context=64))
    mx.eval(lm.parameters())
    stepper = SttStepper(lm, batch=16)
    codes = np.zeros((16, 8), np.int32)
    for _ in range(3):
        mx.eval(stepper.step(codes).text)
    ring = stepper.ring
    ring_bytes = sum(buffer.nbytes for buffer in ring.keys + ring.values)
    del ring
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    out = stepper.step(codes)
    mx.eval(out.text, stepper.ring.keys, stepper.ring.values)
    assert mx.get_peak_memory() - before < ring_bytes / 4
