"""What every route family of `python -m moshi_mlx serve` gets: `ServeContext`.

Each family (Kyutai's chat, moshi-server STT, moshi-server TTS, OpenAI chat, OpenAI audio) is
a module with `add_routes(app: web.Application, context: ServeContext) -> None`, mounted when
its model is loaded. Model work goes through `context.thread` only (`call` for one-off requests, a
`RealTimeClock` for streams, `background` for token-by-token generation).
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from moshi_mlx.llm import LlmModel
from moshi_mlx.runtime.model_thread import ModelThread
from moshi_mlx.runtime.sampling import Sampling
from moshi_mlx.serve.chat.service import ChatService
from moshi_mlx.serve.cloned_voices import ClonedVoices
from moshi_mlx.serve.guard import EventTally
from moshi_mlx.serve.limits import Limits
from moshi_mlx.stt.transcriber import SttModel
from moshi_mlx.tts.synthesizer import TtsModel

API_KEY_HEADER = "kyutai-api-key"  # Kyutai's servers; OpenAI routes take "Authorization: Bearer"
API_KEY_QUERY = "auth_id"  # for browsers, which cannot set a websocket's headers


@dataclass
class ServeContext:
    """The model thread, the loaded models and the server's limits, shared by every route."""

    thread: ModelThread
    tally: EventTally
    limits: Limits = field(default_factory=Limits)
    api_keys: frozenset[str] = frozenset()  # empty: no key needed
    stt: SttModel | None = None
    tts: TtsModel | None = None
    llm: LlmModel | None = None
    chat: ChatService | None = None  # Moshi, PersonaPlex or Hibiki (loads while serving)
    # The id each loaded model answers to (OpenAI's `model` field): "stt", "tts", "llm" -> id
    # (`add_model` sets it: a local folder's base name, so that no path goes to a client).
    model_names: dict[str, str] = field(default_factory=dict)
    # Where each model was loaded from (a hub repo id or a folder): accepted as its id too.
    model_sources: dict[str, str] = field(default_factory=dict)
    max_streams: int = 8  # live STT streams (the rows of the STT batch)
    # Seconds of an STT client's audio that may wait for the model before it is dropped.
    max_buffered_seconds: float = 60.0
    # The STT streams' batch, `rows -> SttRows` (default: `SttBatch` of `stt`; tests give
    # a fake; with one, the STT route is mounted without `stt`).
    stt_rows: Callable[[int], object] | None = None
    stt_sampling: Sampling | None = None  # the STT streams' text sampling (None: greedy)
    max_tts_streams: int = 2  # live TTS streams (the rows of each TTS batch)
    loopback_only: bool = False  # bound to loopback: answer only for loopback host names
    voice_repo: str | None = None  # TTS voices: a hub repo id or a folder laid out like one
    # Voices cloned from uploads (POST /v1/audio/voices), named by every TTS route.
    cloned_voices: ClonedVoices = field(default_factory=ClonedVoices)
    # One entry per mounted moshi-server module for `/api/modules_info`: a function giving its
    # fields ("type", "path", "used_slots", "total_slots", ... as strings, as Kyutai's).
    modules: list[Callable[[], dict[str, str]]] = field(default_factory=list)

    def add_model(self, kind: str, source: str) -> None:
        """Name the model of `kind` ("stt", "tts", "llm") loaded from `source`: its id is the
        folder's base name for a local folder, else the repo id."""
        folder = Path(source).expanduser()
        self.model_names[kind] = folder.resolve().name if folder.is_dir() else source
        self.model_sources[kind] = source

    def is_model(self, kind: str, name: str) -> bool:
        """Whether a client's `name` names the model of `kind`: its id or its source."""
        return name in (self.model_names.get(kind), self.model_sources.get(kind))

    def check_kyutai_key(self, request: web.Request) -> None:
        """Raise a 401 unless `request` carries an allowed key the way Kyutai's clients send
        it: the `kyutai-api-key` header or `?auth_id=`."""
        key = request.headers.get(API_KEY_HEADER, request.query.get(API_KEY_QUERY))
        if not self.key_allowed(key):
            self.tally.count("requests refused for a missing or wrong API key", request.remote)
            raise web.HTTPUnauthorized(text=f"send a valid {API_KEY_HEADER} header")

    def key_allowed(self, key: str | None) -> bool:
        """Whether a client's key passes (`key_matches` against `api_keys`)."""
        return self.key_matches(key, self.api_keys)

    @staticmethod
    def key_matches(key: str | None, api_keys: frozenset[str]) -> bool:
        """Kyutai's rule: the key must be one of `api_keys`; with none configured, all pass.
        A key that is not UTF-8 text (aiohttp hands its bytes over as surrogates) never
        matches, and never raises."""
        if not api_keys:
            return True
        if key is None:
            return False
        try:
            raw = key.encode("utf-8")
        except UnicodeEncodeError:
            return False
        return any(hmac.compare_digest(raw, allowed.encode()) for allowed in api_keys)
