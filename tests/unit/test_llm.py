"""LlmModel on a tiny random mlx-lm model: one step per `next()`, stop strings, end of sequence,
limits, and prompt caches reused across turns without changing what greedy decoding says."""

from __future__ import annotations

import pytest

from moshi_mlx.llm import LlmError, LlmModel, TextPiece
from moshi_mlx.llm.model import PREFILL_CHUNK
from moshi_mlx.llm.prompt_cache import PromptCaches
from moshi_mlx.llm.stops import StopMatcher
from moshi_mlx.testing.llm import write_tiny_llm

SYSTEM = {"role": "system", "content": "You are a helpful voice assistant. Keep it short."}
HELLO = {"role": "user", "content": "Hello! How are you today?"}


class _CountingModel:
    """The model, recording every token it is run on."""

    def __init__(self, model):
        self._model = model
        self.fed: list[int] = []

    def __call__(self, inputs, cache=None, **kwargs):
        self.fed.extend(inputs.reshape(-1).tolist())
        return self._model(inputs, cache=cache, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """(mlx-lm model, tokenizer) of the tiny model, loaded once."""
    folder = write_tiny_llm(tmp_path_factory.mktemp("llm") / "tiny-llm")
    llm = LlmModel.load(folder)
    assert llm.name == "tiny-llm" and llm.context_length == 2048
    return llm.model, llm.tokenizer


def _llm(loaded, cached_conversations: int = 4) -> LlmModel:
    model, tokenizer = loaded
    llm = LlmModel(
        _CountingModel(model),
        tokenizer,
        "tiny-llm",
        context_length=2048,
        cached_conversations=cached_conversations,
    )
    return llm


def _run(llm: LlmModel, messages, **options) -> tuple[str, TextPiece, list[TextPiece]]:
    pieces = list(llm.generate(messages, temperature=0.0, **options))
    return "".join(p.text for p in pieces), pieces[-1], pieces


def _common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_one_step_per_next_and_the_token_limit(loaded):
    llm = _llm(loaded)
    text, last, pieces = _run(llm, [SYSTEM, HELLO], max_tokens=12)
    prompt = llm.encode_chat([SYSTEM, HELLO])
    assert last.finish_reason == "length"
    assert last.usage.prompt_tokens == len(prompt)
    assert last.usage.completion_tokens == 12 and last.usage.cached_tokens == 0
    assert len(pieces) == 12  # one piece per sampled token (the prompt fits one step)
    assert all(p.finish_reason is None for p in pieces[:-1])
    assert text and text.isprintable()
    # the model ran on the prompt, then on each token but the last (mlx-lm's look-ahead step
    # runs it too)
    assert llm.model.fed[: len(prompt)] == prompt and len(llm.model.fed) == len(prompt) + 12


def test_default_limit_and_context(loaded):
    llm = _llm(loaded)
    llm.default_max_tokens = 5
    assert _run(llm, [HELLO])[1].usage.completion_tokens == 5
    llm.context_length = len(llm.encode_chat([HELLO])) + 3
    assert _run(llm, [HELLO], max_tokens=50)[1].usage.completion_tokens == 3
    llm.context_length = 10
    with pytest.raises(LlmError, match="over the model's context of 10"):
        llm.generate([HELLO])


def test_a_template_that_fails_is_an_llm_error(loaded):
    with pytest.raises(LlmError, match="chat template"):
        _llm(loaded).generate([{"role": "user", "content": None}])


def test_stop_strings_end_the_reply_before_them(loaded):
    llm = _llm(loaded, cached_conversations=0)
    full, _, _ = _run(llm, [HELLO], max_tokens=40)
    stop = full[12:15]
    text, last, _ = _run(llm, [HELLO], max_tokens=40, stop=["never seen\u2014", stop])
    assert text == full[: full.index(stop)]
    assert last.finish_reason == "stop" and last.usage.completion_tokens < 40


def test_end_of_sequence_ends_the_reply(loaded):
    llm = _llm(loaded, cached_conversations=0)
    prompt = llm.encode_chat([HELLO])
    full, _, _ = _run(llm, [HELLO], max_tokens=20)
    reply = llm.model.fed[len(prompt) :]
    llm.eos_token_ids = frozenset({reply[5]})
    text, last, _ = _run(llm, [HELLO], max_tokens=20)
    assert last.finish_reason == "stop"
    assert last.usage.completion_tokens == reply.index(reply[5]) + 1
    assert full.startswith(text) and len(text) < len(full)


def test_turn_two_prefills_only_the_new_tokens(loaded):
    llm = _llm(loaded)
    first = [SYSTEM, HELLO]
    reply, last, _ = _run(llm, first, max_tokens=30)
    fed_first = list(llm.model.fed)
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": "Ok."}]
    prompt = llm.encode_chat(second)
    held = _common_prefix(fed_first, prompt)
    assert held >= len(llm.encode_chat(first))

    llm.model.fed.clear()
    text, last, _ = _run(llm, second, max_tokens=30)
    assert last.usage.cached_tokens == held
    assert last.usage.prefilled_tokens == len(prompt) - held
    assert llm.model.fed[: len(prompt) - held] == prompt[held:]
    assert len(llm.model.fed) == len(prompt) - held + 30

    fresh = _llm(loaded, cached_conversations=0)
    assert _run(fresh, second, max_tokens=30)[0] == text
    assert len(fresh.model.fed) == len(prompt) + 30


def test_a_diverging_conversation_trims_the_cache(loaded):
    llm = _llm(loaded)
    _run(llm, [SYSTEM, HELLO], max_tokens=10)
    edited = [SYSTEM, {"role": "user", "content": "Hello! How old are you?"}]
    prompt = llm.encode_chat(edited)
    shared = _common_prefix(llm.encode_chat([SYSTEM, HELLO]), prompt)
    text, last, _ = _run(llm, edited, max_tokens=10)
    assert last.usage.cached_tokens == shared
    assert _run(_llm(loaded, cached_conversations=0), edited, max_tokens=10)[0] == text


def test_long_prompts_prefill_in_chunks_and_closing_keeps_the_cache(loaded):
    llm = _llm(loaded)
    long = [SYSTEM, {"role": "user", "content": "tell me more about the weather " * 60}]
    prompt = llm.encode_chat(long)
    assert len(prompt) > 2 * PREFILL_CHUNK
    steps = llm.generate(long, temperature=0.0, max_tokens=10)
    chunks = (len(prompt) - 1) // PREFILL_CHUNK
    assert [next(steps) for _ in range(chunks)] == [TextPiece("")] * chunks
    first_tokens = [next(steps).text for _ in range(3)]
    steps.close()  # a client that left: the cache goes back to the store
    assert len(llm.caches) == 1

    text, last, _ = _run(llm, long, max_tokens=10)
    assert last.usage.cached_tokens == len(prompt) - 1
    assert text.startswith("".join(first_tokens))
    assert _run(_llm(loaded, cached_conversations=0), long, max_tokens=10)[0] == text


def test_stop_matcher_holds_back_only_what_may_start_a_stop():
    matcher = StopMatcher(["END", "\n\n"])
    assert matcher.feed("hello E") == ("hello ", False)
    assert matcher.feed("N") == ("", False)
    assert matcher.feed("X and\n") == ("ENX and", False)
    assert matcher.feed("\nmore") == ("", True)
    matcher = StopMatcher(["stop"])
    assert matcher.feed("a st") == ("a ", False)
    assert matcher.flush() == "st"
    assert StopMatcher([]).feed("stop") == ("stop", False)


def _cache(tokens: int) -> list:
    """A one-layer mlx-lm KV cache holding `tokens` positions."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    layer = KVCache()
    if tokens:
        keys = mx.zeros((1, 1, tokens, 4))
        layer.update_and_fetch(keys, keys)
    return [layer]


def test_prompt_caches_keep_the_newest_and_never_hand_a_whole_prompt():
    """mlx-lm's LRU underneath; the last prompt token always runs (for its logits)."""
    caches = PromptCaches(lambda: _cache(0), capacity=2)
    caches.put([1, 2, 3], _cache(3))
    caches.put([4, 5], _cache(2))
    caches.put([6], _cache(1))  # [1, 2, 3] leaves
    assert len(caches) == 2
    cache, held = caches.take([1, 2, 3, 4])
    assert held == 0 and cache[0].offset == 0
    cache, held = caches.take([4, 5, 9])  # extends: nothing trimmed
    assert held == 2 and cache[0].offset == 2
    other, _ = caches.take([4, 5, 9])
    assert other[0] is not cache[0]  # each generation its own copy
    caches.put([4, 5, 9, 10], _cache(4))
    cache, held = caches.take([4, 5, 9, 10])  # the whole prompt: its last token runs again
    assert held == 3 and cache[0].offset == 3
    cache, held = caches.take([4, 7])  # diverges after one token: trimmed back to it
    assert held == 1 and cache[0].offset == 1
    never = PromptCaches(lambda: _cache(0), capacity=0)
    never.put([1, 2], _cache(2))
    assert len(never) == 0 and never.take([1, 2, 3])[1] == 0
