"""The `persona` part: PersonaPlex on a Moshi file's weights. Its prompt phase as one batched
prefill against a conversation step and against replaying the prompt step by step, a
conversation's start from a prompt state cached in memory or on disk, and PersonaPlex's step
against Moshi's, stepped alternately (`--prompt-steps`, `--prefill-steps`, `--replay-steps`,
`--persona-rounds`); its ratio column is each figure in PersonaPlex's steps."""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from bench_stats import summarize

from moshi_mlx.chat.generate import ChatStepFunction, ChatStepper, GenState, fresh_state
from moshi_mlx.chat.persona.cache import load_state, prompt_key, save_state
from moshi_mlx.chat.persona.prompt import VoicePrompt, prompt_state
from moshi_mlx.chat.persona.schedule import SILENCE_FRAMES, plan_prompt, prompt_frames
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.runtime.delayed_tokens import delayed_tokens_width
from moshi_mlx.runtime.model_memo import ModelMemo
from moshi_mlx.testing.checkpoints import load_lm

from ..part import Part
from ..shapes import DTYPES, LM_SHAPES, dtype_label, lm_shapes, user_codes
from ..timing import compiled_temporal_step, count_graph_ops, fresh_memory, peak_gb, timed_step
from ..weights import lm_weights

# Rows of the `persona` part; the ratio column is PersonaPlex's step over Moshi's (the median
# of the alternated pairs), then each figure over PersonaPlex's median step.
PERSONA_METRICS = (
    "step_ms",
    "moshi_step_ms",
    "prefill_ms",
    "replay_ms",
    "replay_step_ms",
    "start_mem_ms",
    "start_disk_ms",
    "load_ms",
)


def personaplex_config(config: LmConfig) -> LmConfig:
    """PersonaPlex's structure over a Moshi shape: a depformer of `n_q` slices (the user's 8
    never sampled) and NVIDIA's generator (`LmConfig.personaplex_7b` for the 7B shape)."""
    user = config.n_q - config.dep_q
    return replace(config, dep_q=config.n_q, user_codebooks=user, generator="personaplex")


def persona_prompt(config: LmConfig, runs: int, seed: int) -> tuple[VoicePrompt, list[int]]:
    """A prompt of `runs` steps shaped as PersonaPlex's: a voice of random Mimi codes, 0.5 s
    of silence, about one role token per 15 frames, 0.5 s of silence (for 300 runs: a voice
    of 270 frames and 19 role tokens)."""
    free = runs + 1 - 2 * SILENCE_FRAMES  # the prompt's first frame only fills the delayed tokens
    if free < 1:
        raise ValueError(f"a prompt takes at least {2 * SILENCE_FRAMES} runs")
    role = free // 15
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, config.card, size=(free - role, config.moshi_codebooks))
    return VoicePrompt(codes=codes), rng.integers(0, config.text_card, role).tolist()


def _evaluated(state: GenState) -> GenState:
    ring = state.ring
    mx.eval(state.tokens, state.given, ring.keys, ring.values, ring.position)
    return state


def _timed_prompt_state(
    lm: Lm, voice: VoicePrompt, role: list[int], prefilled: int | None = None
) -> tuple[float, GenState]:
    """Seconds to build and evaluate the prompt's state (`prompt_state`), and the state.

    With `prefilled`, the prefill covers the prompt's first `prefilled` runs only
    (`prompt_state`'s work on fewer inputs) and the ring's later prompt positions stay zero:
    the state has the whole prompt's shapes, positions and bytes for what follows.
    """
    started = time.perf_counter()
    if prefilled is None:
        state = _evaluated(prompt_state(lm, voice, role))
        return time.perf_counter() - started, state
    config = lm.config
    plan = plan_prompt(config, prompt_frames(voice.codes, role), delayed_tokens_width(config))
    embeddings = lm.embed(mx.array(plan.inputs[:prefilled].T[None], mx.int32))
    ring = lm.prefill(embeddings, lm.make_ring())
    mx.eval(ring.keys, ring.values, ring.position)
    seconds = time.perf_counter() - started
    ring = ring.grown(plan.runs)
    ring = ring.replaced(ring.keys, ring.values, mx.array(plan.runs, mx.int32))
    columns, given = mx.array(plan.columns, mx.int32), mx.array(plan.given)
    return seconds, _evaluated(GenState(columns, given, ring, plan.runs))


def _replay_times(lm: Lm, inputs: np.ndarray) -> list[float]:
    """The prompt's inputs (runs, K) fed one by one through `Lm.step_text` over a `KVRing`
    (compiled as in a step), as NVIDIA's generator replays a prompt, its depformer aside:
    seconds per step, the ring growing in its buckets as in a conversation."""
    compiled_temporal = compiled_temporal_step(lm)
    ring = lm.make_ring()
    times = []
    for index, column in enumerate(inputs):
        tokens = mx.array(column.astype(np.int32))[None, :, None]
        ring = ring.grown(index)
        mx.eval(tokens, ring.keys, ring.values)
        start = time.perf_counter()
        out, text_logits, keys, values, position = compiled_temporal(
            tokens, ring.keys, ring.values, ring.position
        )
        ring = ring.replaced(keys, values, position)
        mx.eval(out, text_logits, keys, values, position)
        times.append(time.perf_counter() - start)
    return times


def _persona_and_moshi(weights: Path, shape: str, dtype: mx.Dtype | None) -> tuple[Lm, Lm, float]:
    """PersonaPlex's `Lm` (`personaplex_config`) and Moshi's of a Moshi file, sharing every
    array, and the seconds the loads took."""
    moshi_config = LmConfig.from_dict(LM_SHAPES[shape])
    started = time.perf_counter()
    moshi_lm = load_lm(weights, moshi_config, dtype)
    lm = load_lm(weights, personaplex_config(moshi_config), dtype)
    lm.update(moshi_lm.parameters())
    return lm, moshi_lm, time.perf_counter() - started


def _alternated_steps(gens: dict[str, ChatStepper], user: np.ndarray) -> dict[str, list[float]]:
    """Seconds per step of each generator, stepped in turn on the same user codes, the order
    swapped every round (A B, B A, ...) so that the machine's load hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in gens}
    for index, codes in enumerate(user):
        for name in list(gens) if index % 2 == 0 else list(gens)[::-1]:
            times[name].append(timed_step(gens[name], codes))
    return times


def _cached_starts(
    lm: Lm,
    state: GenState,
    user_codes: np.ndarray,
    rounds: int,
    seed: int,
    compiled_steps: ModelMemo[ChatStepFunction],
) -> dict[str, Any]:
    """A conversation's start from `state`, up to its first step done: held in memory, or
    saved with `persona.cache.save_state` and read back with `load_state` (from the page
    cache: the file was just written), alternated `rounds` times; the step's traces are
    `compiled_steps`'s, as a model's conversations share them."""
    memory, disk, load = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder, key = Path(tmp), prompt_key(bench="persona", seed=seed)
        started = time.perf_counter()
        saved = save_state(folder, key, state)
        save_s = time.perf_counter() - started
        for _ in range(rounds):
            started = time.perf_counter()
            timed_step(
                ChatStepper(lm, seed=seed, start=state, compiled_steps=compiled_steps), user_codes
            )
            memory.append(time.perf_counter() - started)
            started = time.perf_counter()
            loaded = _evaluated(load_state(folder, key))
            load.append(time.perf_counter() - started)
            timed_step(
                ChatStepper(lm, seed=seed, start=loaded, compiled_steps=compiled_steps), user_codes
            )
            disk.append(time.perf_counter() - started)
            del loaded
        state_mb = saved.stat().st_size / 1e6
    return {"memory": memory, "disk": disk, "load": load, "save_s": save_s, "state_mb": state_mb}


def bench_persona(
    weights: Path,
    shape: str,
    steps: int,
    warmup: int,
    seed: int,
    dtype: mx.Dtype | None,
    prompt_steps: int,
    prefill_steps: int = 0,
    replay_steps: int = 0,
    rounds: int = 3,
) -> dict:
    """PersonaPlex on a Moshi file's weights (`_persona_and_moshi`), each figure against its
    conversation step:

    - the prompt phase: `prompt_state` of a `prompt_steps`-run prompt (`persona_prompt`), one
      batched prefill, built and evaluated (`rounds` times, after a 2-position warm-up);
      against replaying its inputs step by step (`_replay_times`). Where a whole prompt
      costs too much (7B on a CPU), the prefill covers its first `prefill_steps` runs and
      the replay its first `replay_steps` (0: all), each extrapolated to the whole prompt in
      proportion (the prefill from each round, the replay from its median step);
    - a cached start (`_cached_starts`, `rounds` of each);
    - the step: PersonaPlex's `ChatStepper.step` from the prompt's state against Moshi's from the
      same KV ring and position (same weights, tokens and user codes), alternated
      (`_alternated_steps`, `warmup` + `steps` rounds); and each step's graph operations.
    """
    fresh_memory()
    lm, moshi_lm, load_s = _persona_and_moshi(weights, shape, dtype)
    fresh_memory()
    config = lm.config
    voice, role = persona_prompt(config, prompt_steps, seed)
    inputs = plan_prompt(
        config, prompt_frames(voice.codes, role), delayed_tokens_width(config)
    ).inputs
    runs = len(inputs)

    # Prompt phase: one batched prefill, and the step-by-step replay it replaces.
    warm = mx.array(inputs[:2].T[None].astype(np.int32))
    mx.eval(lm.prefill(lm.embed(warm), lm.make_ring()).keys)
    prefilled = prefill_steps if 0 < prefill_steps < runs else None
    prefill, state = [], None
    for _ in range(rounds):
        state = None  # the previous round's state freed first
        seconds, state = _timed_prompt_state(lm, voice, role, prefilled)
        prefill.append(seconds)
    replayed = inputs[: replay_steps or runs]
    replay = _replay_times(lm, replayed)[min(warmup, len(replayed) - 1) :]

    # Steps: PersonaPlex from the prompt, Moshi from the same KV ring and position.
    moshi_start = replace(fresh_state(moshi_lm), ring=state.ring, step_index=state.step_index)
    compiled_steps = ModelMemo(lm)  # shared with the cached starts, as a model's conversations
    gens = {
        "personaplex": ChatStepper(lm, seed=seed, start=state, compiled_steps=compiled_steps),
        "moshi": ChatStepper(moshi_lm, seed=seed, start=moshi_start),
    }
    user = user_codes(config.card, warmup + steps, seed)
    step_s = {name: t[warmup:] for name, t in _alternated_steps(gens, user).items()}
    graph_ops = {
        name: {
            "eager": count_graph_ops(gen.step_graph(user[0], compiled=False)),
            "compiled": count_graph_ops(gen.step_graph(user[0], compiled=True)),
        }
        for name, gen in gens.items()
    }
    del gens
    starts = _cached_starts(lm, state, user[0], rounds, seed, compiled_steps)

    scale = runs / (prefilled or runs)
    stats = {
        "step_ms": summarize(step_s["personaplex"]),
        "moshi_step_ms": summarize(step_s["moshi"]),
        "prefill_ms": summarize([t * scale for t in prefill]),
        "replay_ms": summarize([t * runs for t in replay]),
        "replay_step_ms": summarize(replay),
        "start_mem_ms": summarize(starts["memory"]),
        "start_disk_ms": summarize(starts["disk"]),
        "load_ms": summarize(starts["load"]),
    }
    step_ms = stats["step_ms"]["p50"]
    ratios = {name: stats[name]["p50"] / step_ms for name in PERSONA_METRICS[2:]}
    pairs = zip(step_s["personaplex"], step_s["moshi"])
    ratios["step_ms"] = float(np.median([ours / moshi for ours, moshi in pairs]))
    return {
        "impl": "ours",
        "dtype": dtype_label(dtype, lm),
        "mlx": mx.__version__,
        "load_s": load_s,
        **stats,
        "ratios": ratios,
        "prompt": {
            "runs": runs,
            "voice_frames": voice.frames,
            "role_tokens": len(role),
            "prefill_steps": prefilled or runs,
            "prefill_measured_ms": [1000 * t for t in prefill],
            "replay_steps": len(replayed),
            "replay_measured": len(replay),
            "replay_total_ms": 1000 * sum(replay) if len(replayed) == runs else None,
        },
        "save_ms": 1000 * starts["save_s"],
        "state_mb": starts["state_mb"],
        "graph_ops": graph_ops,
        "samples_ms": {name: [1000 * t for t in times] for name, times in step_s.items()},
        "peak_memory_gb": peak_gb(),
    }


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """Per LM shape, quant and dtype."""
    for shape in lm_shapes(args.shapes):
        for quant in args.quant:
            weights = lm_weights(folder, shape, quant)
            for dtype in args.dtype:
                ours = bench_persona(
                    weights,
                    shape,
                    args.steps,
                    args.warmup,
                    args.seed,
                    DTYPES[dtype],
                    args.prompt_steps,
                    args.prefill_steps,
                    args.replay_steps,
                    args.persona_rounds,
                )
                yield {"part": "persona", "shape": shape, "quant": quant, "ours": ours}


def _persona_lines(data: dict) -> list[str]:
    """The `persona` case's figures in steps of PersonaPlex's conversation."""
    prompt, ops, ratios = data["prompt"], data["graph_ops"], data["ratios"]
    replay = f"{prompt['replay_measured']} of its {prompt['replay_steps']} steps timed"
    if prompt["replay_steps"] < prompt["runs"]:
        replay += ", extrapolated"
    prefilled = ""
    if prompt["prefill_steps"] < prompt["runs"]:
        prefilled = f" (its first {prompt['prefill_steps']} steps timed, extrapolated)"
    voice = f"voice {prompt['voice_frames']} frames, role {prompt['role_tokens']} tokens"
    state = f"state {data['state_mb']:.0f} MB, saved in {data['save_ms']:.0f} ms"
    graphs = "; ".join(
        f"{name} {ops[name]['eager']} eager, {ops[name]['compiled']} compiled" for name in ops
    )
    prefill, replay_steps = ratios["prefill_ms"], ratios["replay_ms"]
    memory, disk, load = ratios["start_mem_ms"], ratios["start_disk_ms"], ratios["load_ms"]
    prompt_line = f"  prompt of {prompt['runs']} steps ({voice}): prefill {prefill:.1f} steps"
    prompt_line += prefilled
    prompt_line += f", replay {replay_steps:.1f} steps ({replay}); {state}"
    start_line = f"  cached start: from memory {memory:.2f} steps, from disk {disk:.2f} steps"
    start_line += f" (its load {load:.2f})"
    step_line = f"  PersonaPlex / Moshi step {ratios['step_ms']:.3f} (median of alternated"
    step_line += f" pairs); graph ops per step: {graphs}"
    return [prompt_line, start_line, step_line]


def _ratio(metric: str, data: dict) -> str:
    return f"{data['ratios'][metric]:.2f}" if metric in data["ratios"] else ""


PART = Part(
    "persona",
    cases,
    metrics=lambda case: PERSONA_METRICS,
    ratio=_ratio,
    notes=lambda label, data, case: _persona_lines(data),
)
