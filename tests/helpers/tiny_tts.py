"""The tiny random TTS of tests/fixtures/tts loaded for tests, its streams run alone and compared
with their batched runs (tests of `TtsBatch`)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
from tiny_moshi import TINY_TTS

from moshi_mlx.checkpoints.hub import lm_config_of
from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.runtime.sampling import GREEDY
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.testing.checkpoints import load_lm
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun

TINY_TTS_VOICES = {name: TINY_TTS / "voices" / f"{name}.safetensors" for name in ("alice", "bob")}


def load_tiny_tts_lm(fixtures: Path = TINY_TTS, config: Path | None = None):
    """The float32 LM of `fixtures` (its weights; `config` if given, else the one beside them)."""
    weights = fixtures / "weights.safetensors"
    return load_lm(weights, lm_config_of(weights, config), dtype=mx.float32)


def tiny_tts_model(fixtures: Path, mimi_checkpoint, config: Path | None = None) -> TtsModel:
    """The float32 TTS of `fixtures` (weights, tokenizer; `config` if given) on a tiny Mimi."""
    lm = load_tiny_tts_lm(fixtures, config)
    path, mimi_config = mimi_checkpoint
    codec = SimpleNamespace(model=load_mimi(path, lm.config.dep_q, mimi_config))
    return TtsModel(lm, codec, load_tokenizer(fixtures / "tokenizer.model"), files=None)


def steps_alone(model: TtsModel, request: TtsRequest) -> list[tuple]:
    """Per step of the request run alone (greedy): predicted, fed, frame (list or None), pcm."""
    run = TtsRun(model, [request], GREEDY, GREEDY, seed=0)
    run.schedules[0].push(model.entries(request.text))
    run.schedules[0].close()
    steps = []
    while not run.finished:
        step = run.step()
        frame = None if step.tokens.frame is None else np.array(step.tokens.frame[0]).tolist()
        steps.append((step.tokens.predicted[0], step.tokens.fed[0], frame, step.pcm[0]))
    return steps


def assert_same_stream(batched: list, alone: list, atol: float) -> None:
    """Asserts a batched stream's steps are its `steps_alone`: tokens equal, pcm within atol."""
    assert len(batched) == len(alone)
    assert [s[:3] for s in batched] == [s[:3] for s in alone]
    for (*_, pcm), (*_, pcm_alone) in zip(batched, alone):
        assert (pcm is None) == (pcm_alone is None)
        if pcm is not None:
            np.testing.assert_allclose(pcm, pcm_alone, rtol=0, atol=atol)


def run_to_the_end(run: TtsRun) -> tuple[list[list], list[list[np.ndarray]]]:
    """Steps `run` (tokens only) to its end. Returns, per row, each step's [predicted, fed] text
    tokens and the frames it wrote."""
    rows = len(run.schedules)
    logged: list[list] = [[] for _ in range(rows)]
    frames: list[list[np.ndarray]] = [[] for _ in range(rows)]
    while not run.finished:
        tokens = run.step_tokens()
        for b in range(rows):
            logged[b].append([tokens.predicted[b], tokens.fed[b]])
            if tokens.frame is not None:
                frames[b].append(np.array(tokens.frame[b]))
    return logged, frames
