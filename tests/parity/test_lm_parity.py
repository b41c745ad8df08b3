"""Golden parity with Kyutai's PyTorch reference (fixtures from scripts/make_lm_fixtures.py).

The tiny reference model has context 16, so the 20 teacher-forced and 40 greedy steps also
check the attention window once the KV ring wraps.
"""

import mlx.core as mx
import numpy as np
from closeness import max_relative

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.chat.teacher_forcing import teacher_forced_logits
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.sampling import GREEDY

MAX_RELATIVE_ERROR = 1e-4


def test_fixture_config_is_the_tiny_preset(golden_lm):
    lm, _ = golden_lm
    assert lm.config == LmConfig.tiny()


def test_teacher_forced_logits_step_by_step(golden_lm):
    lm, golden = golden_lm
    tokens, dep_prev = golden["tf_tokens"], golden["tf_dep_prev"]
    text_logits, dep_logits = teacher_forced_logits(
        lm, mx.array(tokens.T.astype(np.int32)), mx.array(dep_prev.T.astype(np.int32))
    )
    assert max_relative(np.array(text_logits), golden["tf_text_logits"]) < MAX_RELATIVE_ERROR
    assert max_relative(np.array(dep_logits), golden["tf_dep_logits"]) < MAX_RELATIVE_ERROR


def test_teacher_forced_text_logits_after_a_prefill(golden_lm):
    """The first context - 1 positions in one call (`Lm.prefill`), then steps past the
    context: the text logits of the steps are the reference's."""
    lm, golden = golden_lm
    tokens = mx.array(golden["tf_tokens"][None].astype(np.int32))  # (1, K, T)
    prefix = lm.config.context - 1
    ring = lm.prefill(lm.embed(tokens[:, :, :prefix]), lm.make_ring())
    logits = []
    for t in range(prefix, tokens.shape[2]):
        ring = ring.grown(t)
        logits.append(np.array(lm.step_text(tokens[:, :, t : t + 1], ring)[1][0]))
        ring = ring.advanced()
    reference = golden["tf_text_logits"][prefix:]
    assert max_relative(np.stack(logits), reference) < MAX_RELATIVE_ERROR


def test_greedy_stream_matches_reference_exactly(golden_lm):
    lm, golden = golden_lm
    gen = ChatStepper(lm, GREEDY, GREEDY)
    for _ in range(2):  # a second conversation after reset() repeats the first
        texts, codes = [], []
        for user_codes in golden["greedy_user"]:
            step = gen.step(user_codes)
            texts.append(step.text.item())
            codes.append(None if step.frame is None else np.array(step.frame))
        np.testing.assert_array_equal(texts, golden["greedy_text"])
        # Reference output before the delays are filled is all -2 ("ungenerated").
        assert codes[0] is None and (golden["greedy_out"][0] == -2).all()
        np.testing.assert_array_equal(np.stack(codes[1:]), golden["greedy_out"][1:, 1:])
        assert len(np.unique(golden["greedy_text"])) > 10  # a stream worth comparing
        gen.reset()
