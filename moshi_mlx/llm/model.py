"""A chat LLM on mlx-lm: `LlmModel.load(repo_or_folder)`, then `generate(messages, ...)`, an
iterator of `TextPiece`s that runs one model step per `next()`.

mlx-lm (and the transformers it imports, about a second) is imported only here, when an LLM is
loaded. Like every MLX model, an `LlmModel` belongs to the thread that loaded it: load it, and
iterate its generations, on one thread (a server's model thread).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moshi_mlx.errors import MoshiError, WeightsError, one_line
from moshi_mlx.llm.prompt_cache import LayerCaches, PromptCaches
from moshi_mlx.llm.stops import StopMatcher

# Tokens a reply may have when the caller sets no limit. Speech is the main use: 256 tokens are
# about 190 English words, over a minute of speech and far more than a spoken turn, yet a model
# that rambles or loops holds the model thread for 256 steps at most (mlx-lm's 512 doubles it).
DEFAULT_MAX_TOKENS = 256
# Prompt tokens prefilled per step: long prompts are run in chunks, one per `next()`, so that a
# server's real-time jobs step between them.
PREFILL_CHUNK = 256
# Conversations whose caches are kept for their next turn.
DEFAULT_CACHED_CONVERSATIONS = 4


class LlmError(MoshiError):
    """A chat request the LLM cannot run: messages its template refuses, a prompt too long."""


@dataclass(frozen=True)
class Usage:
    """The tokens of one generation."""

    prompt_tokens: int
    completion_tokens: int  # sampled, the end-of-sequence token included
    cached_tokens: int  # prompt tokens whose keys and values came from a kept cache

    @property
    def prefilled_tokens(self) -> int:
        """Prompt tokens the model ran for this generation."""
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class TextPiece:
    """What one step of a generation adds: text (often empty: a prefill chunk, a token whose
    characters are incomplete, text that may begin a stop string) and, on the last piece,
    why it ended ("stop": end of sequence or a stop string; "length": the token limit) and
    the token usage."""

    text: str
    finish_reason: str | None = None
    usage: Usage | None = None


Message = Mapping[str, str]  # {"role": "system" | "user" | "assistant", "content": text}


class LlmModel:
    """An mlx-lm model and its tokenizer, with the prompt caches of recent conversations."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        name: str,
        *,
        context_length: int | None = None,
        default_max_tokens: int = DEFAULT_MAX_TOKENS,
        cached_conversations: int = DEFAULT_CACHED_CONVERSATIONS,
    ):
        if not tokenizer.has_chat_template:
            raise LlmError(f"the LLM {name} has no chat template: it is not a chat model")
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)
        self.caches = PromptCaches(self._make_cache, cached_conversations)

    @classmethod
    def load(cls, repo_or_folder: str | Path, **options: Any) -> LlmModel:
        """Load an mlx-lm model from a local folder or a Hugging Face repo id (downloaded
        when not cached); `options` go to the constructor. Its name is the repo id, or the
        folder's name."""
        import mlx_lm

        try:
            model, tokenizer, config = mlx_lm.load(str(repo_or_folder), return_config=True)
        except (OSError, ValueError, KeyError) as exc:
            raise WeightsError(f"cannot load the LLM {repo_or_folder}: {one_line(exc)}") from None
        folder = Path(repo_or_folder)
        name = folder.name if folder.exists() else str(repo_or_folder)
        context = config.get("max_position_embeddings")
        return cls(model, tokenizer, name, context_length=context, **options)

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """The prompt tokens of `messages` with the assistant's turn opened (the chat
        template's generation prompt). Uses the tokenizer only: any thread may call it."""
        try:
            tokens = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - jinja's TemplateError and tokenizer errors
            raise LlmError(f"the chat template refuses these messages: {one_line(exc)}") from None
        if not tokens:
            raise LlmError("the messages make an empty prompt")
        return list(tokens)

    def generate(
        self,
        messages: Sequence[Message],
        temperature: float = 1.0,
        top_p: float = 1.0,
        max_tokens: int | None = None,
        stop: Sequence[str] = (),
    ) -> Iterator[TextPiece]:
        """The reply to `messages`, one model step per `next()` (prefill chunks first).

        Sampling at `temperature` (0: greedy) within the `top_p` nucleus; at most
        `max_tokens` tokens (None: `default_max_tokens`), and never past the model's context.
        The reply ends at the end-of-sequence token or before the first of the `stop`
        strings. Messages are checked here, before any step: `LlmError` for a conversation
        the template refuses or one that fills the context. The prompt's longest start
        held by a kept cache is not prefilled again.
        """
        prompt = self.encode_chat(messages)
        budget = self._token_budget(len(prompt), max_tokens)
        return self._steps(prompt, temperature, top_p, budget, StopMatcher(stop))

    def _token_budget(self, prompt_tokens: int, max_tokens: int | None) -> int:
        budget = self.default_max_tokens if max_tokens is None else max_tokens
        if self.context_length is None:
            return budget
        room = self.context_length - prompt_tokens
        if room < 1:
            raise LlmError(
                f"the conversation is {prompt_tokens} tokens, over the model's context of "
                f"{self.context_length}"
            )
        return min(budget, room)

    def _make_cache(self) -> LayerCaches:
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)

    def _steps(
        self, prompt: list[int], temperature: float, top_p: float, budget: int, stops: StopMatcher
    ) -> Iterator[TextPiece]:
        import mlx.core as mx
        from mlx_lm.generate import generate_step, generation_stream
        from mlx_lm.sample_utils import make_sampler

        cache, cached = self.caches.take(prompt)
        held = prompt[:cached]  # the tokens whose keys and values `cache` holds
        reply: list[int] = []
        failed = False
        try:
            rest = prompt[cached:]
            while len(rest) > PREFILL_CHUNK:
                chunk, rest = rest[:PREFILL_CHUNK], rest[PREFILL_CHUNK:]
                self.model(mx.array(chunk)[None], cache=cache)
                mx.eval([layer.state for layer in cache])
                held = held + chunk
                yield TextPiece("")
            tokens = generate_step(
                mx.array(rest),
                self.model,
                max_tokens=budget,
                sampler=make_sampler(temp=temperature, top_p=top_p),
                prompt_cache=cache,
                prefill_step_size=PREFILL_CHUNK,
            )
            text = _ReplyText(self.tokenizer.detokenizer, stops)
            for token, _ in tokens:
                # mlx-lm queued the next token's step before handing this one over: wait for
                # it here, so that a step's compute lands in its own slot of the model thread
                # and not in the next real-time (STT, TTS) step's.
                mx.synchronize(generation_stream)
                reply.append(token)
                held = prompt + reply  # generate_step has run `token` already, for the next
                if token in self.eos_token_ids:
                    piece, finish = text.close()[0], "stop"
                else:
                    piece, stopped = text.add(token)
                    if stopped:
                        finish = "stop"
                    elif len(reply) == budget:
                        end, stopped = text.close()
                        piece, finish = piece + end, "stop" if stopped else "length"
                    else:
                        yield TextPiece(piece)
                        continue
                yield TextPiece(piece, finish, Usage(len(prompt), len(reply), cached))
                return
        except Exception:
            failed = True  # a step failed midway: the cache's content is unknown
            raise
        finally:
            if not failed:
                self.caches.put(held, cache)


class _ReplyText:
    """Reply tokens to shown text: the streaming detokenizer, then the stop strings."""

    def __init__(self, detokenizer: Any, stops: StopMatcher):
        self._detokenizer = detokenizer
        self._stops = stops

    def add(self, token: int) -> tuple[str, bool]:
        """(the text that may be shown now, whether a stop string has appeared)."""
        self._detokenizer.add_token(token)
        return self._stops.feed(self._detokenizer.last_segment)

    def close(self) -> tuple[str, bool]:
        """The rest of the text at the end of the reply, and whether it held a stop string."""
        self._detokenizer.finalize()
        text, stopped = self._stops.feed(self._detokenizer.last_segment)
        return (text, True) if stopped else (text + self._stops.flush(), False)
