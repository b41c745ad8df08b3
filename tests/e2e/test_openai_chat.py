"""`/v1/models` and `/v1/chat/completions` with OpenAI's own client against a loopback server
running the tiny random LLM on a model thread; and clients that send junk or leave early."""

from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import threading
import time

import openai
import pytest
from aiohttp import web

from moshi_mlx.llm import LlmModel
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.serve.context import ServeContext
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.openai import chat
from moshi_mlx.serve.openai.errors import add_fallback_route
from moshi_mlx.testing.llm import write_tiny_llm

MODEL = "tiny-llm"
HELLO = [{"role": "user", "content": "Hello! How are you?"}]


class _Server:
    """The chat routes on 127.0.0.1, their event loop on a thread of their own."""

    def __init__(self, folder):
        self.thread = ModelThread("test-llm-model")
        self.thread.start()
        llm = self.thread.call_soon(lambda: LlmModel.load(folder)).result(120)
        self.context = ServeContext(
            thread=self.thread, tally=EventTally(logging.getLogger("test")), llm=llm
        )
        self.folder = folder
        self.context.add_model("llm", str(folder))  # a folder: its base name is the id
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        self.loop_thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.loop_thread.start()
        assert started.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        chat.add_routes(app, self.context)
        add_fallback_route(app, self.context.key_allowed)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.loop_thread.join(10)
        self.thread.stop()

    def post(self, body: bytes, headers: dict | None = None) -> tuple[int, dict]:
        """A raw POST to /v1/chat/completions: (status, JSON body)."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        connection.request("POST", "/v1/chat/completions", body=body, headers=headers or {})
        response = connection.getresponse()
        status, data = response.status, response.read()
        connection.close()
        return status, json.loads(data)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = _Server(write_tiny_llm(tmp_path_factory.mktemp("llm") / MODEL))
    yield running
    running.close()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_the_chat_model_answers_to_its_folder_and_an_error_names_its_id(client, server):
    """Served from a folder, the model's id is the folder's base name (no path is listed);
    the folder as given on the command line is accepted too."""
    assert MODEL == server.folder.name and str(server.folder) not in str(client.models.list())
    done = client.chat.completions.create(model=str(server.folder), messages=HELLO, max_tokens=2)
    assert done.model == MODEL
    with pytest.raises(openai.NotFoundError, match=f"served: '{MODEL}'"):
        client.chat.completions.create(model="llama", messages=HELLO, max_tokens=2)


def test_a_route_not_served_answers_in_openai_shape(client, server):
    """Unknown /v1 routes, and the audio routes of a server without --stt/--tts: OpenAI's
    JSON error (the client raises its typed error), not aiohttp's plain text."""
    with pytest.raises(openai.NotFoundError, match="no such route: POST /v1/embeddings"):
        client.embeddings.create(model=MODEL, input="hi")
    with pytest.raises(openai.NotFoundError, match="no such route"):
        client.responses.create(model=MODEL, input="hi")
    with pytest.raises(openai.NotFoundError, match="start the server with --stt"):
        client.audio.transcriptions.create(model="stt", file=("a.wav", b"RIFF"))
    with pytest.raises(openai.NotFoundError, match="start the server with --tts"):
        client.audio.speech.create(model="tts", voice="alloy", input="hi")
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    connection.request("GET", "/v1/chat/completions")
    response = connection.getresponse()
    error = json.loads(response.read())["error"]
    assert response.status == 405 and "takes POST" in error["message"]
    assert set(error) == {"message", "type", "param", "code"}
    connection.close()


def test_a_completion_with_usage(client, server):
    completion = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_tokens=8
    )
    assert completion.object == "chat.completion" and completion.model == MODEL
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    prompt = server.context.llm.encode_chat(HELLO)
    assert completion.usage.prompt_tokens == len(prompt)
    assert completion.usage.completion_tokens == 8
    assert completion.usage.total_tokens == len(prompt) + 8


def test_streaming_says_what_the_completion_says(client):
    whole = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, max_completion_tokens=20
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=HELLO,
        temperature=0,
        max_completion_tokens=20,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0  # the same prompt again


def test_stop_strings_and_sampling(client):
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0, top_p=1)
    text = whole.choices[0].message.content
    stop = text[10:13]
    stopped = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, stop=[stop, "zzzz"]
    )
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    sampled = client.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=1.5, top_p=0.9, max_tokens=5, stop="x"
    )
    assert sampled.choices[0].finish_reason in ("stop", "length")


def test_bad_requests_get_openai_errors(client, server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=HELLO)
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.chat.completions.create(model=MODEL, messages=[])
    with pytest.raises(openai.BadRequestError, match="'temperature' must be a number"):
        client.chat.completions.create(
            model=MODEL, messages=HELLO, extra_body={"temperature": "hot"}
        )
    with pytest.raises(openai.BadRequestError, match="role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])

    cases = {
        b"{not json": "not valid JSON",
        b'["a list"]': "must be a JSON object",
        b"\xff\xfe{}": "not UTF-8",
        b'{"model": "tiny-llm"}': "'messages' is required",
        b'{"messages": [{"role": "user", "content": 5}]}': "must be a string or a list",
        b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}': "'max_tokens'",
        b'{"messages": [{"role": "user", "content": "hi"}], "stop": [1]}': "'stop'",
        b"[" * 100_000: "not valid JSON",
    }
    for body, message in cases.items():
        status, error = server.post(body)
        assert status == 400, body[:40]
        assert error["error"]["type"] == "invalid_request_error"
        assert message in error["error"]["message"], body[:40]


def test_a_huge_body_is_refused_unread(server):
    status, error = server.post(b"x" * (3 * 1024 * 1024))
    assert status == 413 and "over" in error["error"]["message"]
    # A chunked body announces no length: it is cut at the limit all the same.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    chunks = (b"x" * 65536 for _ in range(64))
    connection.request("POST", "/v1/chat/completions", body=chunks, encode_chunked=True)
    response = connection.getresponse()
    assert response.status == 413
    connection.close()


def test_api_keys_are_checked(client, server):
    server.context.api_keys = frozenset({"secret"})
    try:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
        keyed = client.with_options(api_key="secret")
        assert keyed.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).usage
    finally:
        server.context.api_keys = frozenset()


class _CountingModel:
    """The model, counting its calls (one per step)."""

    def __init__(self, model):
        self._model = model
        self.calls = 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_a_client_that_leaves_mid_stream_stops_its_generation(server):
    llm = server.context.llm
    counting = llm.model = _CountingModel(llm.model)
    body = {"model": MODEL, "messages": HELLO, "stream": True, "max_tokens": 1500}
    request = json.dumps(body).encode()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {len(request)}\r\n\r\n".encode()
                + request
            )
            received = b""
            while received.count(b"data: ") < 5:
                received += sock.recv(4096)
        assert b"HTTP/1.1 200" in received and b"text/event-stream" in received
        deadline = time.monotonic() + 20
        steps = -1
        while steps != counting.calls and time.monotonic() < deadline:
            steps = counting.calls
            time.sleep(0.5)
        assert steps == counting.calls < 1000, "the generation went on after its client left"
    finally:
        llm.model = counting._model


class _BrokenModel(_CountingModel):
    def __call__(self, *args, **kwargs):
        raise RuntimeError("the accelerator fell over")


def test_a_failing_generation_is_an_openai_error(client, server):
    llm = server.context.llm
    llm.model = _BrokenModel(llm.model)
    try:
        with pytest.raises(openai.InternalServerError, match="fell over"):
            client.chat.completions.create(model=MODEL, messages=HELLO)
        with pytest.raises(openai.APIError, match="fell over"):
            list(client.chat.completions.create(model=MODEL, messages=HELLO, stream=True))
    finally:
        llm.model = llm.model._model
    assert client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=2).usage
