"""Golden parity with Kyutai's PyTorch reference (fixtures from scripts/make_lm_fixtures.py).

The tiny reference model has context 16, so the 20 teacher-forced and 40 greedy steps also
check the attention window once the KV ring wraps.
"""

import mlx.core as mx
import numpy as np

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.runtime.sampling import GREEDY

MAX_RELATIVE_ERROR = 1e-4


def _relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.abs(ours - reference).max() / np.abs(reference).max())


def test_fixture_config_is_the_tiny_preset(golden_lm):
    lm, _ = golden_lm
    assert lm.cfg == LmConfig.tiny()


def test_teacher_forced_logits_step_by_step(golden_lm):
    lm, golden = golden_lm
    tokens, dep_prev = golden["tf_tokens"], golden["tf_dep_prev"]
    caches, dep_caches = lm.make_caches(), lm.depformer.make_caches()
    text_logits, dep_logits = [], []
    for t in range(tokens.shape[1]):
        out, logits = lm.forward_text(mx.array(tokens[None, :, t : t + 1]), caches)
        text_logits.append(np.array(logits[0, 0]))
        dep_logits.append(
            np.array(lm.depformer.logits(out, mx.array(dep_prev[None, :, t]), dep_caches)[0])
        )
    assert _relative_error(np.stack(text_logits), golden["tf_text_logits"]) < MAX_RELATIVE_ERROR
    assert _relative_error(np.stack(dep_logits), golden["tf_dep_logits"]) < MAX_RELATIVE_ERROR


def test_teacher_forced_text_logits_whole_sequence(golden_lm):
    lm, golden = golden_lm
    _, logits = lm.forward_text(mx.array(golden["tf_tokens"][None]), lm.make_caches())
    assert _relative_error(np.array(logits[0]), golden["tf_text_logits"]) < MAX_RELATIVE_ERROR


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
