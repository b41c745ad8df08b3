"""Sampling and the streaming generator: seeds, delays, reset, long runs with flat memory."""

import time

import mlx.core as mx
import numpy as np
import pytest

from moshi_mlx.chat.generate import AUDIO_SAMPLING, TEXT_SAMPLING, ChatStepFunction, ChatStepper
from moshi_mlx.chat.teacher_forcing import depformer_logits
from moshi_mlx.errors import MoshiError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.runtime.model_memo import MAX_STEP_FUNCTIONS, ModelMemo
from moshi_mlx.runtime.sampling import GREEDY, Sampling, gumbel_noise, split_key
from moshi_mlx.testing.checkpoints import load_lm


@pytest.fixture(scope="module")
def tiny_lm(tiny_lm_checkpoints):
    return load_lm(tiny_lm_checkpoints["bf16"])


def _user_codes(steps: int, card: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, card, (steps, 8))


def _run(gen: ChatStepper, user: np.ndarray) -> tuple[list[int], np.ndarray]:
    texts, codes = [], []
    for user_codes in user:
        step = gen.step(user_codes)
        texts.append(step.text.item())
        if step.frame is not None:
            codes.append(np.array(step.frame))
    return texts, np.stack(codes)


def sample(logits: mx.array, temp: float, top_k: int, key: mx.array | None) -> mx.array:
    return Sampling(temp, top_k).sample(logits, key)


def test_sample_greedy_and_top_k():
    logits = mx.array([[0.0, 3.0, 1.0, 2.9, -1.0]] * 2000)
    assert sample(logits, 0.0, 0, None).tolist() == [1] * 2000
    tokens = np.array(sample(logits, 1.0, 2, mx.random.key(0)))
    assert set(np.unique(tokens)) == {1, 3}
    assert 0.4 < (tokens == 1).mean() < 0.65  # e^3 / (e^3 + e^2.9) = 0.525
    spread = np.array(sample(logits, 5.0, 0, mx.random.key(1)))
    assert set(np.unique(spread)) == {0, 1, 2, 3, 4}
    sharp = np.array(sample(logits, 0.05, 0, mx.random.key(1)))
    assert (sharp == 1).mean() > 0.85


def test_sample_follows_the_softmax_of_the_top_k():
    """The Gumbel-max draw among the top k is distributed as softmax(logits / temp) there;
    the same noise split per codebook (`sample_with_noise`) samples the same tokens."""
    logits = mx.array([[0.5, 2.0, -1.0, 1.0, 1.5]] * 40000)
    tokens = np.array(sample(logits, 0.7, 3, mx.random.key(3)))
    top = np.array([2.0, 1.0, 1.5]) / 0.7
    expected = np.exp(top) / np.exp(top).sum()
    found = np.array([(tokens == k).mean() for k in (1, 3, 4)])
    assert set(np.unique(tokens)) == {1, 3, 4}
    np.testing.assert_allclose(found, expected, atol=0.01)
    noise = gumbel_noise(logits.shape, mx.random.key(3))
    assert Sampling(0.7, 3).sample_with_noise(logits, noise).tolist() == tokens.tolist()


def test_sample_is_a_function_of_the_key():
    logits = mx.random.normal((4, 100), key=mx.random.key(5))
    a = sample(logits, 0.8, 25, mx.random.key(9))
    b = sample(logits, 0.8, 25, mx.random.key(9))
    assert a.tolist() == b.tolist()
    draws = {tuple(sample(logits, 0.8, 25, mx.random.key(s)).tolist()) for s in range(10)}
    assert len(draws) > 1


def test_split_key_gives_mx_random_splits_keys():
    for seed in range(5):
        for count in (2, 3):
            key = mx.random.key(seed)
            keys = split_key(key, count)
            assert [k.shape for k in keys] == [(2,)] * count
            assert [k.tolist() for k in keys] == mx.random.split(key, count).tolist()


def test_seeded_generation_repeats_and_seeds_differ(tiny_lm):
    user = _user_codes(25, tiny_lm.config.card)
    first = _run(ChatStepper(tiny_lm, seed=42), user)
    again = _run(ChatStepper(tiny_lm, seed=42), user)
    other = _run(ChatStepper(tiny_lm, seed=43), user)
    assert first[0] == again[0] and np.array_equal(first[1], again[1])
    assert first[0] != other[0] or not np.array_equal(first[1], other[1])
    gen = ChatStepper(tiny_lm, seed=42)
    _run(gen, user[:7])
    gen.reset()
    after_reset = _run(gen, user)
    assert after_reset[0] == first[0] and np.array_equal(after_reset[1], first[1])


def test_step_outputs_and_delays(tiny_lm):
    config = tiny_lm.config
    gen = ChatStepper(tiny_lm, Sampling(1.0, 25), Sampling(1.0, 250), seed=0)
    steps = [gen.step(codes) for codes in _user_codes(5, config.card)]
    assert steps[0].frame is None  # max delay 1: the first frame is not complete yet
    for step in steps[1:]:
        codes = np.array(step.frame)
        assert codes.shape == (config.dep_q,) and codes.dtype == np.int32
        assert ((codes >= 0) & (codes < config.card)).all()
    assert all(0 <= step.text.item() < config.text_card for step in steps)
    gen.step(mx.array([-1] * 8))  # "no input" codes and mx arrays are accepted
    with pytest.raises(MoshiError, match="8 user codes"):
        gen.step(np.zeros(7, np.int64))


def test_a_model_keeps_the_compiled_steps_of_its_latest_samplings(tiny_lm):
    """Each sampling gets its compiled step once; a model keeps only the most recently used
    ones, so clients choosing ever new temperatures do not grow it without bound."""
    samplings = [Sampling(0.5 + k / 100, 25) for k in range(MAX_STEP_FUNCTIONS + 2)]
    cache = ModelMemo(tiny_lm)
    choice = (samplings[0], AUDIO_SAMPLING, None, 1.0)
    first = ChatStepFunction.shared(tiny_lm, cache, choice)
    assert ChatStepFunction.shared(tiny_lm, cache, choice) is first
    generators = [ChatStepper(tiny_lm, s, seed=0, compiled_steps=cache) for s in samplings]
    kept = samplings[-MAX_STEP_FUNCTIONS:]
    assert cache.choices() == [(s, AUDIO_SAMPLING, None, 1.0) for s in kept]
    step = generators[0].step(_user_codes(1, tiny_lm.config.card)[0])  # its own still runs
    assert 0 <= step.text.item() < tiny_lm.config.text_card


def test_long_run_memory_is_flat():
    """Thousands of steps far past the context (16): memory and step time stay flat.

    A slimmer config than `tiny()` (fewer layers and codebooks) keeps this test fast; the
    caches are the same objects whatever the sizes.
    """
    slim = {
        "num_layers": 1,
        "depformer_num_layers": 1,
        "n_q": 4,
        "dep_q": 2,
        "delays": [0, 0, 1, 0, 1],
    }
    lm = Lm(LmConfig.from_dict(LmConfig.tiny().to_dict() | slim))
    mx.eval(lm.parameters())
    gen = ChatStepper(lm, seed=0)
    user = np.random.default_rng(0).integers(0, lm.config.card, (256, 2))
    steps = 3200
    memory, times = {}, []
    for t in range(steps):
        start = time.perf_counter()
        gen.step(user[t % len(user)])
        times.append(time.perf_counter() - start)
        if t in (200, steps - 1):
            memory[t] = mx.get_active_memory()
    assert gen.step_index == steps
    assert memory[steps - 1] <= memory[200] + 64 * 1024, memory
    assert np.median(times[-500:]) < 3 * np.median(times[200:700])


class _EagerChat:
    """The step loop without `mx.compile` or the delayed tokens: the temporal transformer and the
    depformer stepped eagerly, the delays kept in numpy on the host."""

    def __init__(self, lm: Lm, sampling: tuple[Sampling, Sampling], seed: int):
        config = lm.config
        self.lm, self.config = lm, config
        self.text_sampling, self.audio_sampling = sampling
        self.ring = lm.make_ring()
        self.step_text = type(lm).step_text  # as made: a test may count later calls
        self.key = mx.random.key(seed)
        self.delays = np.array(config.delays)
        self.initial = np.array([config.text_card] + [config.card] * config.n_q)
        self.tokens = np.full((config.num_codebooks, config.max_delay + 2), -2, np.int64)
        self.t = 0

    def step(self, codes: np.ndarray) -> tuple[int, np.ndarray | None]:
        config, t, width = self.config, self.t, self.tokens.shape[1]
        user_rows = np.arange(1 + config.dep_q, config.num_codebooks)
        self.tokens[user_rows, (t + self.delays[user_rows]) % width] = codes
        inputs = np.where(t <= self.delays, self.initial, self.tokens[:, t % width])
        self.ring = self.ring.grown(t)
        tokens = mx.array(inputs.astype(np.int32))[None, :, None]
        out, logits = self.step_text(self.lm, tokens, self.ring)
        self.ring = self.ring.advanced()
        generated = np.array(self._sample(out, logits), dtype=np.int64)
        self.t = t = t + 1
        self.tokens[: 1 + config.dep_q, t % width] = generated
        if t <= config.max_delay:
            return int(generated[0]), None
        rows = np.arange(1, 1 + config.dep_q)
        return int(generated[0]), self.tokens[
            rows, (t - config.max_delay + self.delays[rows]) % width
        ]

    def _sample(self, temporal_out: mx.array, text_logits: mx.array) -> mx.array:
        """Text, then the depformer's slices one by one, eagerly."""
        audio_sampling, depformer = self.audio_sampling, self.lm.depformer
        self.key, text_key, audio_key = mx.random.split(self.key, 3)
        text = self.text_sampling.sample(text_logits, text_key)
        noise = gumbel_noise((1, self.config.dep_q * self.config.card), audio_key)  # all codebooks'
        noises = mx.split(noise, self.config.dep_q, axis=-1)
        tokens = [text]
        for k in range(self.config.dep_q):
            previous = mx.stack(tokens, axis=1)  # (1, k + 1): the slices' inputs so far
            logits = depformer_logits(depformer, temporal_out, previous)[:, k]
            noise = noises[k] if audio_sampling.draws else None
            tokens.append(audio_sampling.sample_with_noise(logits, noise))
        return mx.concatenate(tokens)


@pytest.mark.parametrize("sampling", [(TEXT_SAMPLING, AUDIO_SAMPLING), (GREEDY, GREEDY)])
def test_compiled_step_equals_eager_stepping_past_the_context(sampling, monkeypatch):
    """Context 100: 240 steps cross the KV buckets (64, 100) and wrap the ring twice; the
    tokens equal those of the eager loop, and the step is traced once per bucket."""
    config = LmConfig.from_dict(LmConfig.tiny().to_dict() | {"context": 100})
    lm = Lm(config)
    lm.set_dtype(mx.bfloat16)
    mx.eval(lm.parameters())
    user = _user_codes(240, config.card, seed=3)
    user[::7] = -1  # some "no input" frames
    eager = _EagerChat(lm, sampling, seed=11)
    traces = []
    real_step_text = Lm.step_text  # runs only when the compiled step is traced
    monkeypatch.setattr(Lm, "step_text", lambda *a: traces.append(1) or real_step_text(*a))
    cache = ModelMemo(lm)
    compiled = ChatStepper(lm, *sampling, seed=11, compiled_steps=cache)
    texts = set()
    for t, codes in enumerate(user):
        text, moshi_codes = eager.step(codes)
        step = compiled.step(codes)
        assert step.text.item() == text, t
        if moshi_codes is None:
            assert step.frame is None
        else:
            np.testing.assert_array_equal(np.array(step.frame), moshi_codes)
        texts.add(text)
        if t == 0:
            eager_first_text = text
    assert len(texts) > 5  # a stream worth comparing
    assert len(traces) == 2  # the 64-slot and 100-slot buckets
    assert compiled.ring.capacity == config.context
    again = ChatStepper(lm, *sampling, seed=11, compiled_steps=cache)  # a new one reuses the traces
    assert again.step(user[0]).text.item() == eager_first_text and len(traces) == 2
