"""OpenAI's `GET /v1/models` and `POST /v1/chat/completions` on the server's models.

`/v1/models` lists every served model, the chat model first (Unmute picks a model itself only
when one is listed: with more, it wants `KYUTAI_LLM_MODEL`), each under the id its routes
accept (a local folder's base name, never its path); `/v1/models/{id}` finds each. Mount these
routes whenever the server has a model; `/v1/chat/completions` answers 404 without an LLM. A
completion runs on the model thread as a background job, one token per step; a client that
disconnects or stops reading ends its generation.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from aiohttp import web

from moshi_mlx.errors import one_line
from moshi_mlx.llm import LlmError, TextPiece, Usage
from moshi_mlx.serve.openai.chat_request import ChatRequest, parse_chat_request
from moshi_mlx.serve.openai.errors import (
    ApiError,
    answers_api_errors,
    check_bearer_key,
    read_json_object,
)

if TYPE_CHECKING:
    from moshi_mlx.serve.context import ServeContext

# Generations at once; more wait for none and get a 429 (each holds a KV cache and a share of
# the model thread).
MAX_GENERATIONS = 4
# A streaming client that has not taken a chunk for this long is dropped.
WRITE_SECONDS = 10.0
_MODEL_KINDS = ("llm", "stt", "tts", "moshi")  # the order of /v1/models
_LOADED = {"moshi": "chat"}  # the context's field holding a kind's model, where not its name


def add_routes(app: web.Application, context: ServeContext) -> None:
    """Mount `/v1/models`, `/v1/models/{model}` and `/v1/chat/completions`."""
    routes = _ChatRoutes(context)
    app.router.add_get("/v1/models", routes.list_models)
    app.router.add_get("/v1/models/{model:.+}", routes.get_model)  # ids hold "/"
    app.router.add_post("/v1/chat/completions", routes.chat_completions)


class _ChatRoutes:
    def __init__(self, context: ServeContext):
        self.context = context
        self.created = int(time.time())
        self.generations = 0

    def served_models(self) -> dict[str, str]:
        """{model id: kind} of the loaded models, the LLM first."""
        names = dict(self.context.model_names)
        if self.context.llm is not None:
            names.setdefault("llm", self.context.llm.name)
        loaded = {
            kind: getattr(self.context, _LOADED.get(kind, kind)) is not None
            for kind in _MODEL_KINDS
        }
        return {names[kind]: kind for kind in _MODEL_KINDS if loaded[kind] and kind in names}

    def model_object(self, model_id: str) -> dict[str, Any]:
        return {"id": model_id, "object": "model", "created": self.created, "owned_by": "moshi_mlx"}

    @answers_api_errors
    async def list_models(self, request: web.Request) -> web.Response:
        check_bearer_key(request, self.context.key_allowed)
        data = [self.model_object(model_id) for model_id in self.served_models()]
        return web.json_response({"object": "list", "data": data})

    @answers_api_errors
    async def get_model(self, request: web.Request) -> web.Response:
        check_bearer_key(request, self.context.key_allowed)
        model_id = request.match_info["model"]
        served = self.served_models()
        if model_id not in served:
            raise _no_such_model(model_id, served)
        return web.json_response(self.model_object(model_id))

    @answers_api_errors
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        check_bearer_key(request, self.context.key_allowed)
        llm = self.context.llm
        if llm is None:
            raise ApiError(404, "this server runs no chat model", "model", "model_not_found")
        chat = parse_chat_request(await read_json_object(request))
        model_id = self.context.model_names.get("llm", llm.name)
        if chat.model not in (None, model_id) and not self.context.is_model("llm", chat.model):
            raise _no_such_model(chat.model, {model_id: "llm"})
        if self.generations >= MAX_GENERATIONS:
            raise ApiError(429, f"{MAX_GENERATIONS} chat completions are running: retry later")
        self.generations += 1
        try:
            try:  # the chat template runs here, off the event loop and the model thread
                steps = await asyncio.to_thread(
                    llm.generate,
                    chat.messages,
                    temperature=chat.temperature,
                    top_p=chat.top_p,
                    max_tokens=chat.max_tokens,
                    stop=chat.stop,
                )
            except LlmError as exc:
                raise ApiError(400, str(exc), "messages") from None
            pieces = self.context.thread.background(steps)
            reply = _Reply(model_id)
            if chat.stream:
                return await _stream(request, chat, reply, pieces)
            return await _complete(request, reply, pieces)
        finally:
            self.generations -= 1


def _no_such_model(model_id: str, served: dict[str, str]) -> ApiError:
    """A 404 naming the ids this server answers to."""
    ids = ", ".join(f"'{served_id}'" for served_id in served) or "none"
    message = f"the model '{model_id[:100]}' does not exist here; served: {ids}"
    return ApiError(404, message, "model", "model_not_found")


class _Reply:
    """The fields every object of one completion shares."""

    def __init__(self, model_id: str):
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model_id

    def object(self, kind: str, choices: list[dict], usage: Usage | None = None) -> dict:
        body = {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = _usage(usage)
        return body


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


async def _complete(
    request: web.Request, reply: _Reply, pieces: AsyncIterator[TextPiece]
) -> web.StreamResponse:
    """The whole reply as one `chat.completion`; a client gone before the end stops it."""
    texts: list[str] = []
    last = TextPiece("")
    try:
        async for last in pieces:
            texts.append(last.text)
            if request.transport is None or request.transport.is_closing():
                return web.Response(status=499)  # nobody reads it
    except Exception as exc:  # noqa: BLE001 - a failed model step, in OpenAI's shape
        raise ApiError(500, f"the generation failed: {one_line(exc)}") from None
    finally:
        await pieces.aclose()
    message = {"role": "assistant", "content": "".join(texts)}
    choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": last.finish_reason}
    return web.json_response(reply.object("chat.completion", [choice], last.usage))


async def _stream(
    request: web.Request, chat: ChatRequest, reply: _Reply, pieces: AsyncIterator[TextPiece]
) -> web.StreamResponse:
    """The reply as server-sent events: `data: {chat.completion.chunk}` lines, then
    `data: [DONE]`. An error after the headers is sent as `data: {"error": ...}`."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        await _send(response, _chunk(reply, {"role": "assistant", "content": ""}))
        async for piece in pieces:
            if piece.text:
                await _send(response, _chunk(reply, {"content": piece.text}))
            if piece.finish_reason is not None:
                await _send(response, _chunk(reply, {}, piece.finish_reason))
                if chat.include_usage and piece.usage is not None:
                    chunk = reply.object("chat.completion.chunk", [], piece.usage)
                    await _send(response, chunk)
        await _send(response, "[DONE]")
    except (ConnectionError, asyncio.TimeoutError):
        return response  # the client left or stopped reading: its generation ends below
    except Exception as exc:  # noqa: BLE001 - reported in the stream; the headers are sent
        error = ApiError(500, f"the generation failed: {one_line(exc)}")
        await _send_quietly(response, error.body())
    finally:
        await pieces.aclose()
    return response


def _chunk(reply: _Reply, delta: dict[str, str], finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return reply.object("chat.completion.chunk", [choice])


async def _send(response: web.StreamResponse, data: dict | str) -> None:
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    await asyncio.wait_for(response.write(f"data: {text}\n\n".encode()), WRITE_SECONDS)


async def _send_quietly(response: web.StreamResponse, data: dict) -> None:
    try:
        await _send(response, data)
    except (ConnectionError, asyncio.TimeoutError):
        pass
