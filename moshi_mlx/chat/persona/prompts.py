"""A PersonaPlex model's prompt states by (voice, role): from memory, from disk, or computed."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from pathlib import Path

import mlx.core as mx
import sentencepiece

from moshi_mlx.chat.generate import GenState
from moshi_mlx.chat.persona.cache import (
    cache_dir,
    file_fingerprint,
    load_state,
    prompt_key,
    save_state,
)
from moshi_mlx.chat.persona.prompt import prompt_state
from moshi_mlx.chat.persona.role import DEFAULT_ROLE, read_role, role_tokens
from moshi_mlx.chat.persona.voice import (
    DEFAULT_VOICE,
    VoiceSource,
    archive_with_voice,
    extract_voice,
    is_voice_name,
    read_voice,
    voice_names,
    voice_source,
)
from moshi_mlx.checkpoints.hub import WeightFiles, resolve_voices
from moshi_mlx.models.lm import Lm
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.codec import Codec

log = logging.getLogger("moshi_mlx.chat.persona")
KEPT_IN_MEMORY = 2  # prompt states held for new conversations (each is a KV ring's prefix)


class Prompts:
    """The prompt states of one loaded model. `state(voice, role)` is what a conversation
    starts from; computed once per (weights, voice, role) and kept on disk (`persona.cache`)."""

    def __init__(
        self,
        lm: Lm,
        codec: Codec,
        tokenizer: sentencepiece.SentencePieceProcessor,
        files: WeightFiles,
        kv_quantization: KVQuantization | None,
        folder: Path | None = None,
    ):
        self.lm, self.codec, self.tokenizer, self.files = lm, codec, tokenizer, files
        self.kv_quantization = kv_quantization
        self.folder = folder or cache_dir()
        self._memory: OrderedDict[str, GenState] = OrderedDict()
        self._fingerprints: dict[Path, str] = {}
        self._archive: Path | None = None

    def voices_archive(self) -> Path:
        """The model's `voices.tgz` (found or downloaded on first use)."""
        if self._archive is None:
            self._archive = resolve_voices(self.files)
        return self._archive

    def voice_names(self) -> list[str]:
        """The published voices, by name."""
        return voice_names(self.voices_archive())

    def source(self, voice: str | Path | None) -> VoiceSource:
        """The file of a voice choice: a name, a recording or a `.pt`."""
        choice = str(voice) if voice is not None else DEFAULT_VOICE
        if is_voice_name(choice):
            archive = archive_with_voice(choice, self.voices_archive)
            folder = self.folder.parent / "voices" / self._fingerprint(archive)[:16]
            return voice_source(extract_voice(archive, choice, folder), choice)
        return voice_source(Path(choice))

    def state(self, voice: str | Path | None = None, role: str | None = None) -> GenState:
        """The state after the prompt of `voice` (default `DEFAULT_VOICE`) and `role`
        (default `DEFAULT_ROLE`; `@file` reads a file), evaluated."""
        source = self.source(voice)
        tokens = role_tokens(read_role(role if role is not None else DEFAULT_ROLE), self.tokenizer)
        config, dtype = self.lm.config, self.lm.text_emb.weight.dtype
        key = prompt_key(
            lm=self._fingerprint(self.files.moshi),
            codec=self._fingerprint(self.files.mimi),
            voice=source.digest,
            role=tokens,
            config=config.to_dict(),
            dtype=str(dtype),
            kv=str(self.kv_quantization),
        )
        if key in self._memory:
            self._memory.move_to_end(key)
            return self._memory[key]
        start = time.perf_counter()
        state = load_state(self.folder, key)
        if state is not None:
            mx.eval(state.tokens, state.given, state.ring.keys, state.ring.values)
            how = "read from the prompt cache"
        else:
            voice_prompt = read_voice(source, config, self.codec.fresh())
            state = prompt_state(self.lm, voice_prompt, tokens, self.kv_quantization)
            mx.eval(state.tokens, state.given, state.ring.keys, state.ring.values)
            how = "computed"
            try:
                save_state(self.folder, key, state)
                how += f", saved in {self.folder}"
            except OSError as exc:
                how += f" (not saved: {exc.strerror or exc})"
        log.info(
            "prompt (voice %s, role of %d tokens, %d steps) %s in %.2f s",
            source.label,
            len(tokens),
            state.step_index,
            how,
            time.perf_counter() - start,
        )
        self._memory[key] = state
        while len(self._memory) > KEPT_IN_MEMORY:
            self._memory.popitem(last=False)
        return state

    def _fingerprint(self, path: Path) -> str:
        if path not in self._fingerprints:
            self._fingerprints[path] = file_fingerprint(path)
        return self._fingerprints[path]
