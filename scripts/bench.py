"""Speed of moshi_mlx's streaming loop on random weights, optionally beside Kyutai's moshi_mlx.

    python scripts/bench.py                                  # tiny + 1B, bf16 + q4, all parts
    python scripts/bench.py --shapes tiny --quant bf16,q8,q4 --parts lm --steps 100
    python scripts/bench.py --shapes tiny,1b --quant bf16,q4 --kyutai --json bench.json
    python scripts/bench.py --parts tts --shapes tts-small --steps 20 --kyutai --rounds 2

Parts: `lm` (ms per LM step: the whole step as `LmGen.step` runs it, and its split into
temporal transformer + text sampling / depformer + audio sampling / the 9 samplers alone),
`mimi` (ms per streaming 80 ms frame, encode and decode, per codec backend), `pipeline`
(encode + LM step + decode per frame, real-time factor, time to the first audio frame),
`echo` (ms of the live app's echo canceller, WebRTC AEC3, per 80 ms mic frame of a simulated
room with double talk; the canceller comparison is `scripts/echo_compare.py`),
`web` (`python -m moshi_mlx.local_web`'s own work per 80 ms frame, the model aside: decoding
the client's Ogg Opus, encoding Moshi's frame, and a websocket round trip of the two audio
messages on localhost; target <= 5 ms),
`tts` (Kyutai's text-to-speech, `moshi_mlx.tts`, on random weights of a `tts-*` shape
written in the published PyTorch layout with a tokenizer and voices (`tts_weights`): per
batch of 1 and `--streams` requests, the time to the first audio (`ttfa_ms`: from making the
requests with their whole texts to the first 80 ms returned; `ttfd_ms`: to the first frame
Mimi decoded, which Kyutai's reference cuts with the next one), and per step past it the
whole `TtsRun.step` (`frame_ms`), its LM part (`step_ms`: step, text schedule) and Mimi's
decoding (`decode_ms`); real-time factor at batch 1, audio per second of the batch against
batch 1. With `--kyutai`, Kyutai's `TTSModel.generate` on the same files, its frames decoded
as they come; `--shapes` without a tts shape: tts-small),
`persona` (PersonaPlex on the same weights: its prompt phase as one batched prefill against
a conversation step and against replaying the prompt step by step, a conversation's start
from a prompt state cached in memory or on disk, and PersonaPlex's step against Moshi's,
stepped alternately; `--prompt-steps`, `--prefill-steps`, `--replay-steps`,
`--persona-rounds`; its ratio column is each figure in PersonaPlex's steps).
Peak memory is MLX's (`mx.get_peak_memory`), reset before every case. Percentiles are over
the measured steps, after `--warmup` steps. Weights are random, written in the published
formats into `--weights-dir` (default: a temporary folder), never fetched.

With `--kyutai`, every LM case, the MLX Mimi case and the TTS cases also run Kyutai's
`moshi_mlx` 0.3.0 (`scripts/bench_kyutai.py` in `--kyutai-python`'s environment) on the same
files, alternating with ours, and the table shows the ratio ours / theirs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from bench_stats import (
    FRAME_MS,
    LM_SHAPES,
    QUANT_BITS,
    TTS_SHAPES,
    TTS_TEXTS,
    lm_result,
    pool_rounds,
    pool_tts,
    summarize,
    tts_result,
)
from fixture_tokenizer import train_bpe_tokenizer
from mlx.utils import tree_flatten

from moshi_mlx.chat.generate import (
    GenState,
    LmGen,
    fresh_state,
    teacher_forced_logits,
    token_ring_width,
)
from moshi_mlx.chat.model import step_frame
from moshi_mlx.chat.persona.cache import load_state, prompt_key, save_state
from moshi_mlx.chat.persona.prompt import VoicePrompt, prompt_state
from moshi_mlx.chat.persona.schedule import SILENCE_FRAMES, plan_prompt, prompt_frames
from moshi_mlx.checkpoints.io import SafetensorsWriter, read_safetensors
from moshi_mlx.checkpoints.lm import lm_from_tensors, load_lm
from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.checkpoints.spec import CONFIG_FILE
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.models.mimi import MimiConfig
from moshi_mlx.modules.kv_cache import KVRing
from moshi_mlx.modules.kv_quant import KVQuantization, recent_slots
from moshi_mlx.runtime.codec import load_codec
from moshi_mlx.runtime.memory_plan import kv_cache_bytes
from moshi_mlx.runtime.sampling import SamplingConfig, sample
from moshi_mlx.runtime.tokenizer import load_tokenizer
from moshi_mlx.stt.stepper import ListenStepper
from moshi_mlx.testing.checkpoints import (
    logit_fidelity,
    random_teacher_tokens,
    write_random_lm_checkpoint,
    write_random_mimi_checkpoint,
)
from moshi_mlx.tts.stepper import TtsSampling
from moshi_mlx.tts.synthesizer import TtsModel, TtsRequest, TtsRun
from moshi_mlx.tts.voices import VOICE_TENSOR

if TYPE_CHECKING:
    from typing_extensions import Self

SCRIPTS = Path(__file__).resolve().parent
KYUTAI_PYTHON = "/opt/venvs/kyutai/bin/python"
TTS_LM_FILE = "dsm_tts_1e68beda@240.safetensors"  # the published file's name
TTS_TOKENIZER = "tokenizer.model"
TTS_TOKENIZER_PIECES = 400


# Our compute dtype: "auto" is `load_lm`'s own choice for the device (float32 on the CPU).
DTYPES = {"auto": None, "bf16": mx.bfloat16, "f32": mx.float32}
_DTYPE_NAMES = {mx.bfloat16: "bf16", mx.float32: "f32"}


def _dtype_label(requested: mx.Dtype | None, lm: Lm) -> str:
    used = _DTYPE_NAMES[lm.out_norm.weight.dtype]
    return used if requested is not None else f"auto:{used}"


def _fresh_memory() -> None:
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()


def _peak_gb() -> float:
    return mx.get_peak_memory() / 1e9


# Weights ----------------------------------------------------------------------------------
def lm_weights(folder: Path, shape: str, quant: str) -> Path:
    """The random LM file of a case, written once per folder in Kyutai's MLX format."""
    bits, group_size = QUANT_BITS[quant]
    path = folder / f"lm_{shape}_{quant}.safetensors"
    if not path.exists():
        config = LmConfig.from_dict(LM_SHAPES[shape])
        write_random_lm_checkpoint(path, config, bits=bits, group_size=group_size, seed=0)
    return path


def mimi_weights(folder: Path) -> Path:
    """The random Mimi file, in the published PyTorch layout (all 32 codebooks)."""
    path = folder / "mimi.safetensors"
    if not path.exists():
        write_random_mimi_checkpoint(path, MimiConfig.moshi(), seed=0)
    return path


def tts_pytorch_layout(config: dict) -> dict[str, tuple[tuple[int, ...], mx.Dtype]]:
    """Names, shapes and dtypes of a TTS LM file in the published PyTorch layout (that of
    kyutai/tts-1.6b-en_fr's `dsm_tts_1e68beda@240.safetensors`) for a Kyutai `config.json`:
    packed attention projections, the depformer's weight sets stacked or numbered by the
    schedule's values, low-rank depformer embeddings, the conditioners in float32."""
    dim, card, vocab = config["dim"], config["card"], config["text_card"] + 1
    hidden = 2 * int(config["hidden_scale"] * dim) // 3  # the gated FFN's width (SiLU gating)
    ddim, rank = config["depformer_dim"], config["depformer_low_rank_embeddings"]
    dhidden = 2 * config["depformer_dim_feedforward"] // 3
    sets = max(config["depformer_weights_per_step_schedule"]) + 1
    dep_q = config["dep_q"]
    bf16, f32 = mx.bfloat16, mx.float32
    layout: dict[str, tuple[tuple[int, ...], mx.Dtype]] = {}
    for name, conditioner in config["conditioners"].items():
        prefix = f"condition_provider.conditioners.{name}"
        if conditioner["type"] == "lut":
            lut = conditioner["lut"]
            layout[f"{prefix}.embed.weight"] = ((lut["n_bins"] + 1, lut["dim"]), f32)
            layout[f"{prefix}.output_proj.weight"] = ((dim, lut["dim"]), f32)
        else:
            layout[f"{prefix}.output_proj.weight"] = ((dim, conditioner["tensor"]["dim"]), f32)
        layout[f"{prefix}.learnt_padding"] = ((1, 1, dim), f32)
    for layer in range(config["depformer_num_layers"]):
        prefix = f"depformer.layers.{layer}"
        for s in range(sets):
            layout[f"{prefix}.gating.{s}.linear_in.weight"] = ((2 * dhidden, ddim), bf16)
            layout[f"{prefix}.gating.{s}.linear_out.weight"] = ((ddim, dhidden), bf16)
        layout[f"{prefix}.norm1.alpha"] = layout[f"{prefix}.norm2.alpha"] = ((1, 1, ddim), bf16)
        layout[f"{prefix}.self_attn.in_proj_weight"] = ((sets * 3 * ddim, ddim), bf16)
        layout[f"{prefix}.self_attn.out_proj.weight"] = ((sets * ddim, ddim), bf16)
    for k in range(dep_q - 1):
        layout[f"depformer_emb.{k}.low_rank.weight"] = ((ddim, rank), bf16)
        layout[f"depformer_emb.{k}.weight"] = ((card + 1, rank), bf16)
    for s in range(sets):
        layout[f"depformer_in.{s}.weight"] = ((ddim, dim), bf16)
    for part in ("low_rank", "out1", "out2"):
        layout[f"depformer_text_emb.{part}.weight"] = ((ddim, rank), bf16)
    layout["depformer_text_emb.weight"] = ((vocab, rank), bf16)
    for k in range(config["n_q"]):
        layout[f"emb.{k}.weight"] = ((card + 1, dim), bf16)
    for k in range(dep_q):
        layout[f"linears.{k}.weight"] = ((card, ddim), bf16)
    layout["out_norm.alpha"] = ((1, 1, dim), bf16)
    layout["text_emb.out1.weight"] = layout["text_emb.out2.weight"] = ((dim, dim), bf16)
    layout["text_emb.weight"] = ((vocab, dim), bf16)
    layout["text_linear.weight"] = ((config["text_card"], dim), bf16)
    for layer in range(config["num_layers"]):
        prefix = f"transformer.layers.{layer}"
        for attention in ("self_attn", "cross_attention"):
            layout[f"{prefix}.{attention}.in_proj_weight"] = ((3 * dim, dim), bf16)
            layout[f"{prefix}.{attention}.out_proj.weight"] = ((dim, dim), bf16)
        layout[f"{prefix}.gating.linear_in.weight"] = ((2 * hidden, dim), bf16)
        layout[f"{prefix}.gating.linear_out.weight"] = ((dim, hidden), bf16)
        layout[f"{prefix}.norm1.alpha"] = layout[f"{prefix}.norm2.alpha"] = ((1, 1, dim), bf16)
        layout[f"{prefix}.norm_cross.bias"] = layout[f"{prefix}.norm_cross.weight"] = ((dim,), bf16)
    return dict(sorted(layout.items()))


def _random_tts_tensor(name: str, shape: tuple[int, ...], key: mx.array) -> mx.array:
    """Norm gains in [0.8, 1.2], biases and learnt paddings in [-0.1, 0.1], matrices and
    embeddings uniform with variance 1/fan_in (as `write_random_lm_checkpoint`)."""
    if name.endswith((".alpha", "norm_cross.weight")):
        return mx.random.uniform(0.8, 1.2, shape, key=key)
    if name.endswith((".bias", "learnt_padding")):
        return mx.random.uniform(-0.1, 0.1, shape, key=key)
    bound = (3 / shape[-1]) ** 0.5
    return mx.random.uniform(-bound, bound, shape, key=key)


TTS_VOICE_FRAMES = 125  # a published voice: speaker_wavs (1, 512, 125) float32


def tts_weights(folder: Path, shape: str, voices: int = 8) -> Path:
    """The random TTS of a shape, written once into `folder / shape`: `config.json` (Kyutai's,
    naming the files), the LM in the published PyTorch layout (bf16, conditioners float32),
    a BPE tokenizer of the bench's texts (its few hundred pieces all below `text_card`), and
    voice embeddings `voices/voice{i}.safetensors` for i < `voices` (those missing are added).
    Mimi is `mimi_weights(folder)`."""
    from safetensors.numpy import save_file

    out = folder / shape
    config = {**TTS_SHAPES[shape], "moshi_name": TTS_LM_FILE, "tokenizer_name": TTS_TOKENIZER}
    if not (out / CONFIG_FILE).exists():  # written last
        out.mkdir(parents=True, exist_ok=True)
        layout = tts_pytorch_layout(config)
        keys = mx.random.split(mx.random.key(0), len(layout))
        with open(out / TTS_LM_FILE, "wb") as file:
            writer = SafetensorsWriter(file, layout, metadata={"format": "pt"})
            for (name, (dims, dtype)), key in zip(layout.items(), keys):
                array = _random_tts_tensor(name, dims, key).astype(dtype)
                mx.eval(array)
                writer.write_rows(name, 0, array)
            writer.check_complete()
        sentences = [s for text in TTS_TEXTS for s in text.split(". ")]
        tokenizer = train_bpe_tokenizer(sentences, TTS_TOKENIZER_PIECES, 3)
        (out / TTS_TOKENIZER).write_bytes(tokenizer)
        (out / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    dim = config["conditioners"]["speaker_wavs"]["tensor"]["dim"]
    (out / "voices").mkdir(exist_ok=True)
    for index in range(voices):
        path = out / "voices" / f"voice{index}.safetensors"
        if not path.exists():
            rng = np.random.default_rng(index)
            wavs = rng.standard_normal((1, dim, TTS_VOICE_FRAMES)).astype(np.float32)
            save_file({VOICE_TENSOR: wavs}, str(path))
    return out


def _user_codes(card: int, count: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, card, size=(count, 8)).astype(np.int32)


# LM ---------------------------------------------------------------------------------------
def _compiled_temporal_step(lm: Lm):
    """The temporal transformer with the text head over a `KVRing`, compiled as in a step:
    (tokens (1, K, 1), ring keys, values, position) -> (out, text logits, next keys, values,
    position)."""
    cfg = lm.cfg

    def temporal_step(tokens: mx.array, keys: list, values: list, position: mx.array):
        ring = KVRing(keys, values, position, cfg.context)
        out, text_logits = lm.step_text(tokens, ring)
        ring = ring.advanced()
        return out, text_logits, ring.keys, ring.values, ring.position

    return mx.compile(temporal_step)


def _split_times(lm: Lm, sampling: SamplingConfig, total: int, seed: int) -> dict[str, list]:
    """Per step, each part evaluated on its own (so the two add up to a step plus one host
    sync): the temporal transformer with the text head (compiled over a `KVRing`, as in a
    step), then `LmGen.sample_tokens` (text sampling and the depformer's 8 slices with audio
    sampling, compiled as in a step)."""
    cfg = lm.cfg
    gen = LmGen(lm, sampling, seed=seed)
    compiled_temporal = _compiled_temporal_step(lm)
    ring = lm.make_ring()
    rng = np.random.default_rng(seed)
    key = mx.random.key(seed)
    temporal, depformer = [], []
    for index in range(total):
        tokens = np.concatenate([rng.integers(0, cfg.text_card, 1), rng.integers(0, cfg.card, 16)])
        tokens = mx.array(tokens.astype(np.int32))[None, :, None]
        ring = ring.grown(index)
        mx.eval(tokens, ring.keys, ring.values)
        t0 = time.perf_counter()
        out, text_logits, keys, values, position = compiled_temporal(
            tokens, ring.keys, ring.values, ring.position
        )
        ring = KVRing(keys, values, position, cfg.context)
        mx.eval(out, text_logits, keys, values, position)
        t1 = time.perf_counter()
        generated, key = gen.sample_tokens(out, text_logits, key)
        mx.eval(generated, key)
        temporal.append(t1 - t0)
        depformer.append(time.perf_counter() - t1)
    return {"temporal": temporal, "depformer": depformer}


def _sampling_times(cfg: LmConfig, sampling: SamplingConfig, total: int) -> list[float]:
    """The text sampler and the 8 audio samplers alone, on logits of the real shapes."""
    times = []
    keys = mx.random.split(mx.random.key(1), 1 + cfg.dep_q)
    for _ in range(total):
        text_logits = mx.random.normal((1, cfg.text_card)).astype(mx.bfloat16)
        audio_logits = mx.random.normal((cfg.dep_q, 1, cfg.card)).astype(mx.bfloat16)
        mx.eval(text_logits, audio_logits)
        t0 = time.perf_counter()
        tokens = [sample(text_logits, sampling.text_temp, sampling.text_top_k, keys[0])]
        tokens += [
            sample(audio_logits[k], sampling.audio_temp, sampling.audio_top_k, keys[1 + k])
            for k in range(cfg.dep_q)
        ]
        mx.eval(tokens)
        times.append(time.perf_counter() - t0)
    return times


class SyncMeter:
    """Counts host synchronisations, and the time the host waits in them, while active.

    Wraps `mx.eval`, `mx.array.item`, `mx.array.tolist` and numpy's array conversions. A call
    counts as a sync when it touches an array that no earlier call of the same frame
    evaluated or read (`new_frame()` forgets them): reading a token of an array the frame
    already evaluated costs no wait. `mx.async_eval` does not make the host wait for the
    result (no sync), but the time it takes to launch the work counts as evaluation time
    (`wait_s`): on MLX's CPU backend it runs the graph's operations before it returns.
    """

    def __init__(self):
        self.syncs = 0
        self.wait_s = 0.0
        self._seen: dict[int, mx.array] = {}
        self._saved: list[tuple[Any, str, Any]] = []

    def new_frame(self) -> None:
        self._seen.clear()

    def _wrap(self, fn, waits: bool):
        def measured(*args, **kwargs):
            arrays = [a for _, a in tree_flatten(list(args)) if isinstance(a, mx.array)]
            fresh = [a for a in arrays if id(a) not in self._seen]
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if fresh:
                    self.wait_s += time.perf_counter() - start
                if fresh and waits:
                    self.syncs += 1
                    self._seen.update((id(a), a) for a in arrays)

        return measured

    def __enter__(self) -> Self:
        wrapped = [(mx, "eval"), (mx, "async_eval"), (mx.array, "item"), (mx.array, "tolist")]
        for owner, name in [*wrapped, (np, "array"), (np, "asarray"), (np, "ascontiguousarray")]:
            original = getattr(owner, name)
            self._saved.append((owner, name, original))
            setattr(owner, name, self._wrap(original, waits=name != "async_eval"))
        return self

    def __exit__(self, *exc_info) -> None:
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


def count_graph_ops(outputs) -> int:
    """Operations (primitives) in the lazy graph that computes `outputs`, evaluated inputs
    excluded, from MLX's own graph export (`mx.export_to_dot`)."""
    arrays = [a for _, a in tree_flatten(list(outputs)) if isinstance(a, mx.array)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "step.dot"
        mx.export_to_dot(str(path), *arrays)
        return path.read_text().count("shape=rectangle")


def _step_anatomy(lm: Lm, sampling: SamplingConfig, total: int, seed: int) -> dict:
    """Where a step's time goes, per step as a caller runs it (`LmGen.step`, then its text
    token and Moshi's codes read on the host): host time outside evaluation (Python and
    graph building), time in evaluation (launching it and waiting for it), syncs; and the
    operations in the step's graph before and after `mx.compile` (`LmGen.step_graph` at the
    last step's state)."""
    gen = LmGen(lm, sampling, seed=seed)
    user = [mx.array(codes) for codes in _user_codes(lm.cfg.card, total, seed)]
    mx.eval(user)
    host, wait, syncs = [], [], []
    with SyncMeter() as meter:
        for codes in user:
            meter.new_frame()
            syncs_before, wait_before = meter.syncs, meter.wait_s
            t0 = time.perf_counter()
            result = gen.step(codes)
            _ = result.text_token, result.moshi_codes
            elapsed = time.perf_counter() - t0
            wait.append(meter.wait_s - wait_before)
            host.append(elapsed - wait[-1])
            syncs.append(meter.syncs - syncs_before)
    graph_ops = {
        "eager": count_graph_ops(gen.step_graph(user[0], compiled=False)),
        "compiled": count_graph_ops(gen.step_graph(user[0], compiled=True)),
    }
    return {"host": host, "eval": wait, "syncs": syncs, "graph_ops": graph_ops}


def bench_lm(
    weights: Path,
    shape: str,
    steps: int,
    warmup: int,
    seed: int,
    split_steps: int,
    dtype: mx.Dtype | None = None,
) -> dict:
    """Our `LmGen.step` per step (p50/p95), its split, first audio step and peak memory.

    `dtype` is the compute dtype (activations, norms, quantization scales): bf16 as
    Kyutai's loader, float32, or None for `load_lm`'s choice for the device.
    """
    _fresh_memory()
    config = LmConfig.from_dict(LM_SHAPES[shape])
    start = time.perf_counter()
    lm = load_lm(weights, config, dtype=dtype)
    load_s = time.perf_counter() - start
    sampling = SamplingConfig()
    total = warmup + steps

    mx.reset_peak_memory()
    gen = LmGen(lm, sampling, seed=seed)
    step_times, first_audio_step = [], None
    for index, codes in enumerate(_user_codes(config.card, total, seed)):
        t0 = time.perf_counter()
        result = gen.step(codes)
        moshi_codes, _ = result.moshi_codes, result.text_token  # on the host, as a caller
        step_times.append(time.perf_counter() - t0)
        if moshi_codes is not None and first_audio_step is None:
            first_audio_step = index
    peak_gb = _peak_gb()

    samples = {"step_ms": step_times[warmup:]}
    anatomy = {}
    if split_steps > 0:
        split = _split_times(lm, sampling, warmup + split_steps, seed)
        anatomy = _step_anatomy(lm, sampling, warmup + split_steps, seed)
        samples.update(
            temporal_ms=split["temporal"][warmup:],
            depformer_ms=split["depformer"][warmup:],
            sampling_ms=_sampling_times(config, sampling, warmup + split_steps)[warmup:],
            host_ms=anatomy["host"][warmup:],
            eval_ms=anatomy["eval"][warmup:],
        )
    return {
        "impl": "ours",
        "dtype": _dtype_label(dtype, lm),
        "mlx": mx.__version__,
        "load_s": load_s,
        **lm_result(samples),
        "syncs_per_step": float(np.mean(anatomy["syncs"][warmup:])) if anatomy else None,
        "graph_ops": anatomy.get("graph_ops"),
        "first_audio_step": first_audio_step,
        "peak_memory_gb": peak_gb,
    }


# Mimi -------------------------------------------------------------------------------------
def bench_kv_caches(
    weights: Path,
    shape: str,
    kv_bits: list[int | None],
    steps: int,
    seed: int,
    dtype: mx.Dtype | None,
) -> list[dict]:
    """Conversations with the KV ring allocated at the full context (as after `context`
    steps), the cache unquantized or in each of `kv_bits`, over one load of the weights.

    Per cache: the peak MLX memory of the load plus a compiled step and one more (each cache
    alone, the others freed), the planned cache, and the step time when every slot of the
    ring is attended over, with the caches stepped in turn (one step each, `steps` times) so
    that the machine's load hits them alike; `ratio` is the median of each turn's step time
    over the first cache's."""
    config = LmConfig.from_dict(LM_SHAPES[shape])
    _fresh_memory()
    lm = load_lm(weights, config, dtype=dtype)
    mx.eval(lm.parameters())
    weights_gb = mx.get_active_memory() / 1e9
    load_peak = mx.get_peak_memory()
    user = _user_codes(config.card, steps + 2, seed)

    def generator(bits: int | None) -> LmGen:
        quantization = KVQuantization.of(bits) if bits else None
        gen = LmGen(lm, SamplingConfig(), seed=seed, kv_quantization=quantization)
        gen.reserve_full_context()
        return gen

    def timed_step(gen: LmGen, codes: np.ndarray) -> float:
        start = time.perf_counter()
        mx.eval(gen.step(codes).text_token_array)
        return time.perf_counter() - start

    peaks = []
    for bits in kv_bits:
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        gen = generator(bits)
        for codes in user[:2]:  # compile and allocate, then a step
            timed_step(gen, codes)
        peaks.append(max(load_peak, mx.get_peak_memory()) / 1e9)
        del gen
    gens = [generator(bits) for bits in kv_bits]
    for gen in gens:
        timed_step(gen, user[0])
    times = [[timed_step(gen, codes) for gen in gens] for codes in user[2:]]
    dtype_used = lm.out_norm.weight.dtype
    return [
        {
            "impl": "ours",
            "kv": f"{bits}-bit" if bits else "unquantized",
            "dtype": _dtype_label(dtype, lm),
            "step_ms": summarize([turn[i] for turn in times]),
            "ratio": float(np.median([turn[i] / turn[0] for turn in times])),
            "weights_gb": weights_gb,
            "planned_kv_gb": kv_cache_bytes(config, dtype_used, gen.kv_quantization) / 1e9,
            "peak_memory_gb": peak,
        }
        for i, (bits, gen, peak) in enumerate(zip(kv_bits, gens, peaks))
    ]


def bench_kv_fidelity(
    weights: Path, shape: str, kv_bits: list[int], steps: int, seed: int, dtype: mx.Dtype | None
) -> list[dict]:
    """Each quantized cache against the unquantized one on the first `steps` steps of a
    conversation, teacher-forced on random tokens (`teacher_forced_logits`): relative error
    of the text and depformer logits and greedy agreement, over all steps and over the steps
    past the unquantized ring of the newest positions (whose attention reads packed slots)."""
    config = LmConfig.from_dict(LM_SHAPES[shape])
    _fresh_memory()
    lm = load_lm(weights, config, dtype=dtype)
    inputs, previous = random_teacher_tokens(config, steps, seed)
    reference = [np.array(a) for a in teacher_forced_logits(lm, inputs, previous)]

    def figures(ours: list[np.ndarray], first: int) -> dict | None:
        if first >= steps:
            return None
        return logit_fidelity([q[first:] for q in ours], [r[first:] for r in reference])

    recent = recent_slots(config.context)
    results = []
    for bits in kv_bits:
        quantization = KVQuantization.of(bits)
        ours = [np.array(a) for a in teacher_forced_logits(lm, inputs, previous, quantization)]
        results.append(
            {
                "impl": "ours",
                "kv": f"{bits}-bit",
                "dtype": _dtype_label(dtype, lm),
                "steps": steps,
                "all_steps": figures(ours, 0),
                "recent_slots": recent,
                "past_recent": figures(ours, recent),
            }
        )
    return results


def _frames(count: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return (0.1 * rng.standard_normal((count, 1920))).astype(np.float32)


def bench_codec(weights: Path, backend: str, frames: int, warmup: int, seed: int) -> dict:
    """ms per streaming frame through the `Codec` interface (numpy in, numpy out)."""
    _fresh_memory()
    start = time.perf_counter()
    codec = load_codec(weights, backend=backend)
    load_s = time.perf_counter() - start
    mx.reset_peak_memory()
    encode, decode = [], []
    for pcm in _frames(warmup + frames, seed):
        t0 = time.perf_counter()
        codes = codec.encode_step(pcm)
        mx.eval(codes, codec.state)
        t1 = time.perf_counter()
        mx.eval(codec.decode_step(codes), codec.state)
        encode.append(t1 - t0)
        decode.append(time.perf_counter() - t1)
    frame = summarize([e + d for e, d in zip(encode, decode)][warmup:])
    return {
        "impl": "ours" if backend == "mlx" else backend,
        "backend": backend,
        "load_s": load_s,
        "encode_ms": summarize(encode[warmup:]),
        "decode_ms": summarize(decode[warmup:]),
        "frame_ms": frame,
        "real_time_factor": FRAME_MS / frame["p50"],
        "peak_memory_gb": _peak_gb() if backend == "mlx" else None,
    }


def bench_codec_batch(weights: Path, backend: str, seconds: float, repeats: int, seed: int) -> dict:
    """ms to encode `seconds` of audio in one call, and to decode its codes back."""
    rng = np.random.default_rng(seed)
    pcm = (0.1 * rng.standard_normal(int(24_000 * seconds))).astype(np.float32)
    if backend == "mlx":
        mimi = load_mimi(weights)

        def encode():
            codes = mimi.encode(mx.array(pcm)[None, None])
            mx.eval(codes)
            return codes

        def decode(codes):
            mx.eval(mimi.decode(codes))
    else:
        import rustymimi

        tokenizer = rustymimi.Tokenizer(str(weights), num_codebooks=8)

        def encode():
            return tokenizer.encode(pcm[None, None])

        def decode(codes):
            tokenizer.decode(codes)

    encode_times, decode_times = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        codes = encode()
        t1 = time.perf_counter()
        decode(codes)
        encode_times.append(t1 - t0)
        decode_times.append(time.perf_counter() - t1)
    return {"batch_encode_ms": summarize(encode_times), "batch_decode_ms": summarize(decode_times)}


# Pipeline ---------------------------------------------------------------------------------
def bench_pipeline(
    lm_file: Path,
    mimi_file: Path,
    shape: str,
    backend: str,
    frames: int,
    warmup: int,
    seed: int,
    dtype: mx.Dtype | None = None,
) -> dict:
    """Encode the user's frame, step the LM, decode Moshi's frame: ms per 80 ms frame, as
    `Conversation.step` runs it (`api.step_frame`: one evaluation per frame); host time
    outside evaluation, time in evaluation and syncs per frame (`SyncMeter`)."""
    _fresh_memory()
    lm = load_lm(lm_file, LmConfig.from_dict(LM_SHAPES[shape]), dtype=dtype)
    codec = load_codec(mimi_file, backend=backend)
    gen = LmGen(lm, SamplingConfig(), seed=seed)

    def frame_step(pcm: np.ndarray) -> bool:
        step, reply = step_frame(gen, codec, pcm)
        _ = step.text_token, None if reply is None else np.array(reply)
        return reply is not None

    def run(pcm_frames: np.ndarray, meter: SyncMeter) -> dict:
        gen.reset()
        codec.reset()
        times, host, syncs, first_audio_s = [], [], [], None
        start = time.perf_counter()
        for pcm in pcm_frames:
            meter.new_frame()
            syncs_before, wait_before = meter.syncs, meter.wait_s
            t0 = time.perf_counter()
            audio = frame_step(pcm)
            times.append(time.perf_counter() - t0)
            host.append(times[-1] - (meter.wait_s - wait_before))
            syncs.append(meter.syncs - syncs_before)
            if audio and first_audio_s is None:
                first_audio_s = time.perf_counter() - start
        return {"times": times, "host": host, "syncs": syncs, "first_audio_s": first_audio_s}

    pcm_frames = _frames(warmup + frames, seed)
    with SyncMeter() as meter:
        run(pcm_frames[:warmup], meter)  # compile/allocate, then start a fresh conversation
        mx.reset_peak_memory()
        measured = run(pcm_frames, meter)
    frame = summarize(measured["times"][warmup:])
    first_audio_s = measured["first_audio_s"]
    return {
        "impl": "ours",
        "backend": backend,
        "dtype": _dtype_label(dtype, lm),
        "frame_ms": frame,
        "host_ms": summarize(measured["host"][warmup:]),
        "syncs_per_frame": float(np.mean(measured["syncs"][warmup:])),
        "real_time_factor": FRAME_MS / frame["p50"],
        "first_audio_ms": None if first_audio_s is None else 1000 * first_audio_s,
        "peak_memory_gb": _peak_gb(),
    }


# PersonaPlex ------------------------------------------------------------------------------
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


def bench_stt(
    lm_file: Path, mimi_file: Path, shape: str, backend: str, streams: int, steps: int, seed: int
) -> dict:
    """Speech-to-text throughput as `SpeechToText` steps (every stream's Mimi encoding in one
    batch, then the LM step), for one stream and for `streams` in one batch, as seconds of
    audio per second. The two take their steps in turn, so both see the same machine; at a
    stream's start (the KV ring's first bucket) and with the whole attention window (the ring
    reserved to the context, as every step of a stream past `context` steps pays)."""
    config = LmConfig.from_dict(LM_SHAPES[shape])
    lm = load_lm(lm_file, config)
    codec = load_codec(mimi_file, backend, config.n_q)
    rng = np.random.default_rng(seed)
    result = {"streams": streams, "ld_preload": os.environ.get("LD_PRELOAD", "")}
    for window in ("start", "full"):
        runs = {}
        for count in (1, streams):
            stepper = ListenStepper(lm, count)
            if window == "full":
                stepper.reserve(config.context)
            runs[count] = (codec.batch_encoder(count), stepper, [])
        for step in range(steps + 3):
            for count, (encoder, stepper, times) in runs.items():
                pcm = rng.normal(0, 0.1, (count, 1920)).astype(np.float32)
                started = time.perf_counter()
                out = stepper.step(encoder.encode_frames(pcm))
                mx.eval(out.text_tokens, out.head_probabilities, encoder.state)
                if step >= 3:  # the first steps compile
                    times.append(time.perf_counter() - started)
        for count, (_, _, times) in runs.items():
            step_s = float(np.median(times))
            result[f"{window}_step_ms_{count}"] = 1000 * step_s
            result[f"{window}_audio_per_s_{count}"] = count * 0.08 / step_s
        ratio = result[f"{window}_audio_per_s_{streams}"] / result[f"{window}_audio_per_s_1"]
        result[f"{window}_speedup"] = ratio
        runs.clear()
    return result


def personaplex_config(config: LmConfig) -> LmConfig:
    """PersonaPlex's structure over a Moshi shape: a depformer of `n_q` slices (the user's 8
    never sampled) and NVIDIA's generator (`LmConfig.personaplex_7b` for the 7B shape)."""
    user = config.n_q - config.dep_q
    return replace(config, dep_q=config.n_q, user_codebooks=user, generator="personaplex")


def persona_prompt(cfg: LmConfig, runs: int, seed: int) -> tuple[VoicePrompt, list[int]]:
    """A prompt of `runs` steps shaped as PersonaPlex's: a voice of random Mimi codes, 0.5 s
    of silence, about one role token per 15 frames, 0.5 s of silence (for 300 runs: a voice
    of 270 frames and 19 role tokens)."""
    free = runs + 1 - 2 * SILENCE_FRAMES  # the prompt's first frame only fills the token ring
    if free < 1:
        raise ValueError(f"a prompt takes at least {2 * SILENCE_FRAMES} runs")
    role = free // 15
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, cfg.card, size=(free - role, cfg.moshi_codebooks))
    return VoicePrompt(codes=codes), rng.integers(0, cfg.text_card, role).tolist()


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
    cfg = lm.cfg
    plan = plan_prompt(cfg, prompt_frames(voice.codes, role), token_ring_width(cfg))
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
    compiled_temporal = _compiled_temporal_step(lm)
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


def _timed_step(gen: LmGen, codes: np.ndarray) -> float:
    """Seconds of one `LmGen.step` with its text token and Moshi's codes read on the host."""
    start = time.perf_counter()
    result = gen.step(codes)
    _ = result.text_token, result.moshi_codes
    return time.perf_counter() - start


def _persona_and_moshi(weights: Path, shape: str, dtype: mx.Dtype | None) -> tuple[Lm, Lm, float]:
    """PersonaPlex's `Lm` (`personaplex_config`) and Moshi's over one load of a Moshi file,
    sharing every array, and the seconds the load took."""
    moshi_config = LmConfig.from_dict(LM_SHAPES[shape])
    tensors, metadata = read_safetensors(weights)
    started = time.perf_counter()
    moshi_lm = lm_from_tensors(tensors, metadata, moshi_config, str(weights), dtype)
    lm = lm_from_tensors(tensors, metadata, personaplex_config(moshi_config), str(weights), dtype)
    lm.update(moshi_lm.parameters())
    return lm, moshi_lm, time.perf_counter() - started


def _alternated_steps(gens: dict[str, LmGen], user: np.ndarray) -> dict[str, list[float]]:
    """Seconds per step of each generator, stepped in turn on the same user codes, the order
    swapped every round (A B, B A, ...) so that the machine's load hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in gens}
    for index, codes in enumerate(user):
        for name in list(gens) if index % 2 == 0 else list(gens)[::-1]:
            times[name].append(_timed_step(gens[name], codes))
    return times


def _cached_starts(
    lm: Lm, state: GenState, user_codes: np.ndarray, rounds: int, seed: int
) -> dict[str, Any]:
    """A conversation's start from `state`, up to its first step done: held in memory, or
    saved with `persona.cache.save_state` and read back with `load_state` (from the page
    cache: the file was just written), alternated `rounds` times."""
    sampling = SamplingConfig()
    memory, disk, load = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        folder, key = Path(tmp), prompt_key(bench="persona", seed=seed)
        started = time.perf_counter()
        saved = save_state(folder, key, state)
        save_s = time.perf_counter() - started
        for _ in range(rounds):
            started = time.perf_counter()
            _timed_step(LmGen(lm, sampling, seed=seed, start=state), user_codes)
            memory.append(time.perf_counter() - started)
            started = time.perf_counter()
            loaded = _evaluated(load_state(folder, key))
            load.append(time.perf_counter() - started)
            _timed_step(LmGen(lm, sampling, seed=seed, start=loaded), user_codes)
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
    - the step: PersonaPlex's `LmGen.step` from the prompt's state against Moshi's from the
      same KV ring and position (same weights, tokens and user codes), alternated
      (`_alternated_steps`, `warmup` + `steps` rounds); and each step's graph operations.
    """
    _fresh_memory()
    lm, moshi_lm, load_s = _persona_and_moshi(weights, shape, dtype)
    _fresh_memory()
    cfg = lm.cfg
    voice, role = persona_prompt(cfg, prompt_steps, seed)
    inputs = plan_prompt(cfg, prompt_frames(voice.codes, role), token_ring_width(cfg)).inputs
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
    sampling = SamplingConfig()
    moshi_start = replace(fresh_state(moshi_lm), ring=state.ring, step_index=state.step_index)
    gens = {
        "personaplex": LmGen(lm, sampling, seed=seed, start=state),
        "moshi": LmGen(moshi_lm, sampling, seed=seed, start=moshi_start),
    }
    user = _user_codes(cfg.card, warmup + steps, seed)
    step_s = {name: t[warmup:] for name, t in _alternated_steps(gens, user).items()}
    graph_ops = {
        name: {
            "eager": count_graph_ops(gen.step_graph(user[0], compiled=False)),
            "compiled": count_graph_ops(gen.step_graph(user[0], compiled=True)),
        }
        for name, gen in gens.items()
    }
    del gens
    starts = _cached_starts(lm, state, user[0], rounds, seed)

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
        "dtype": _dtype_label(dtype, lm),
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
        "peak_memory_gb": _peak_gb(),
    }


# Echo canceller ---------------------------------------------------------------------------
def bench_echo(frames: int, warmup: int, seed: int) -> dict:
    """Time of the live app's echo canceller per 80 ms mic frame (8 sub-frames of 10 ms) on
    the simulated room of `echo_path` (espeak-ng speech, or noise without espeak-ng)."""
    from moshi_mlx.audio.echo import EchoCanceller
    from moshi_mlx.testing import echo_path

    far = echo_path.speak(echo_path.FAR_TEXT)
    near = echo_path.speak(echo_path.NEAR_TEXT, voice="en+f3")
    if far is None or near is None:
        rng = np.random.default_rng(seed)
        far, near = (0.1 * rng.normal(size=16 * 24_000).astype(np.float32) for _ in range(2))
    scene, _ = echo_path.conversation_scene(far, near, delay_s=0.1, gain_db=-3.0, seed=seed)
    canceller = EchoCanceller()
    times = []
    total = min(warmup + frames, len(scene.mic) // 1920)
    for k in range(total):
        frame = slice(k * 1920, (k + 1) * 1920)
        started = time.perf_counter()
        canceller.process(scene.mic[frame], scene.far[frame])
        if k >= warmup:
            times.append(time.perf_counter() - started)
    return {"backend": "webrtc-aec3", "frame_ms": summarize(times)}


# Web server -------------------------------------------------------------------------------
def _voiced_frames(count: int, seed: int) -> np.ndarray:
    """Speech-like audio (harmonics of a gliding pitch, syllable-rate envelope, a little
    noise): what the server's Opus codec sees. White noise costs the encoder up to 4x more."""
    t = np.arange(count * 1920) / 24_000
    pitch = 140 + 30 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / 24_000
    voice = sum(np.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2
    noise = np.random.default_rng(seed).standard_normal(len(t))
    pcm = 0.1 * voice * envelope + 0.005 * noise
    return pcm.astype(np.float32).reshape(count, 1920)


def bench_web(frames: int, warmup: int, seed: int) -> dict:
    """ms per 80 ms frame that the web server spends besides the model step."""
    import asyncio

    import aiohttp
    import sphn
    from aiohttp import web

    from moshi_mlx.serve.chat.opus import OpusFrameReader, OpusFrameWriter

    pcm = _voiced_frames(warmup + frames, seed)
    client_writer = sphn.OpusStreamWriter(24_000)
    client_pages = [client_writer.append_pcm(frame) for frame in pcm]  # the mic's 80 ms
    reader, writer = OpusFrameReader(24_000, 1920), OpusFrameWriter(24_000)
    decode, encode, replies = [], [], []
    for pages, reply in zip(client_pages, pcm[::-1]):
        t0 = time.perf_counter()
        reader.feed(pages)
        t1 = time.perf_counter()
        replies.append(writer.encode(reply))
        decode.append(t1 - t0)
        encode.append(time.perf_counter() - t1)

    async def echo(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        index = 0
        async for _message in ws:  # each client message answered by Moshi's pages
            await ws.send_bytes(b"\x01" + replies[index])
            index += 1
        return ws

    async def round_trips() -> list[float]:
        app = web.Application()
        app.router.add_get("/api/chat", echo)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        times = []
        chat = f"ws://127.0.0.1:{port}/api/chat"
        async with aiohttp.ClientSession() as session, session.ws_connect(chat) as ws:
            for pages in client_pages:
                t0 = time.perf_counter()
                await ws.send_bytes(b"\x01" + pages)
                await ws.receive()
                times.append(time.perf_counter() - t0)
        await runner.cleanup()
        return times

    websocket = asyncio.run(round_trips())
    total = [d + e + w for d, e, w in zip(decode, encode, websocket)]
    return {
        "impl": "ours",
        "backend": "sphn+aiohttp",
        "decode_ms": summarize(decode[warmup:]),
        "encode_ms": summarize(encode[warmup:]),
        "websocket_ms": summarize(websocket[warmup:]),
        "overhead_ms": summarize(total[warmup:]),
        "client_bytes_per_frame": float(np.mean([len(p) for p in client_pages[warmup:]])),
        "reply_bytes_per_frame": float(np.mean([len(r) for r in replies[warmup:]])),
    }


# Text-to-speech ---------------------------------------------------------------------------
class _TimedMimi:
    """A Mimi whose `decode_step`s are timed, each from its codes' evaluation (the LM step's
    work, not Mimi's) to its pcm's; everything else is the Mimi's own."""

    def __init__(self, mimi):
        self.mimi = mimi
        self.decodes: list[tuple[float, float]] = []  # (start, end) of each decode_step

    def __getattr__(self, name: str):
        return getattr(self.mimi, name)

    def decode_step(self, codes: mx.array, state):
        mx.eval(codes)
        start = time.perf_counter()
        pcm = self.mimi.decode_step(codes, state)
        mx.eval(pcm)
        self.decodes.append((start, time.perf_counter()))
        return pcm


def _tts_run(model: TtsModel, folder: Path, batch: int, steps: int, seed: int) -> dict:
    """`batch` requests (text and voice b for request b) through `TtsRun.step` (the LM step,
    the text schedule, Mimi's decoding and the audio on the host), from making the requests
    to `steps` steps past the first audio. Seconds: `ttfa` to the first 80 ms of audio
    returned (Kyutai's first `SKIPPED_FRAMES` frames are decoded but cut), `ttfd` to the
    first frame decoded, per step past the first audio the whole step (`frame`) and Mimi's
    decoding in it (`decode`); `first_step`: the steps run at the first audio."""
    mimi = model.codec.model
    mimi.decodes.clear()
    start = time.perf_counter()
    voices = [folder / "voices" / f"voice{b}.safetensors" for b in range(batch)]
    requests = [TtsRequest(TTS_TEXTS[b], (voice,)) for b, voice in enumerate(voices)]
    run = TtsRun(model, requests, TtsSampling(), seed)
    for request, schedule in zip(requests, run.schedules):
        schedule.push(model.entries(request.text))
        schedule.close()
    ttfa, first_step, frame, decode = None, None, [], []
    while len(frame) < steps:
        decoded = len(mimi.decodes)
        started = time.perf_counter()
        pcm = run.step().pcm
        ended = time.perf_counter()
        if ttfa is not None:
            frame.append(ended - started)
            decode.append(sum(e - s for s, e in mimi.decodes[decoded:]))
        elif any(p is not None for p in pcm):
            ttfa, first_step = ended - start, run.step_index
        if any(s.end_step is not None for s in run.schedules):  # texts as long as the bench
            raise RuntimeError(f"a request's text ended at step {run.step_index}")
    return {
        "ttfa": ttfa,
        "ttfd": mimi.decodes[0][1] - start,
        "frame": frame,
        "decode": decode,
        "first_step": first_step,
    }


def bench_tts(
    folder: Path,
    mimi_file: Path,
    batches: list[int],
    steps: int,
    warmup: int,
    seed: int,
    dtype: mx.Dtype | None = None,
    model: TtsModel | None = None,
) -> tuple[dict, TtsModel]:
    """Our TTS on a `tts_weights` folder, per batch size: a warm-up run (`warmup` steps past
    the first audio: every compiled step and ring size traced) on a fresh model, then a
    measured run (`_tts_run`, `tts_result`'s figures). Returns the result and the model (pass
    it back to measure again without the load and the warm-up)."""
    fresh = model is None
    if fresh:
        _fresh_memory()
        config = LmConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
        lm = load_lm(folder / TTS_LM_FILE, config, dtype=dtype)
        codec = SimpleNamespace(model=_TimedMimi(load_mimi(mimi_file, config.dep_q)))
        model = TtsModel(lm, codec, load_tokenizer(folder / TTS_TOKENIZER), files=None)
    result = {"impl": "ours", "dtype": _dtype_label(dtype, model.lm), "mlx": mx.__version__}
    for batch in batches:
        if fresh:
            _tts_run(model, folder, batch, warmup, seed)
        _fresh_memory()
        run = _tts_run(model, folder, batch, steps, seed)
        step = [f - d for f, d in zip(run["frame"], run["decode"])]
        figures = (run["ttfa"], run["ttfd"], run["first_step"], run["frame"], step, run["decode"])
        result.update(tts_result(batch, *figures, _peak_gb()))
    return result, model


# Kyutai -----------------------------------------------------------------------------------
def run_kyutai(python: str, part: str, weights: Path, extra: list[str]) -> dict:
    """Run `bench_kyutai.py` in Kyutai's environment; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [python, str(SCRIPTS / "bench_kyutai.py"), part, "--weights", str(weights)]
        command += [*extra, "--json", str(out)]
        # Kyutai's environment must import its own moshi_mlx, never a PYTHONPATH'd one of ours.
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=tmp, env=env)
        return json.loads(out.read_text())


# Bandwidth floor --------------------------------------------------------------------------
# Memory bandwidth specs of Apple chip classes, GB/s (the vendor's published figures).
APPLE_BANDWIDTH_GBS = {
    "M1": 68,
    "M1 Pro": 200,
    "M1 Max": 400,
    "M2": 100,
    "M2 Pro": 200,
    "M2 Max": 400,
    "M3": 100,
    "M3 Pro": 150,
    "M3 Max (30-core GPU)": 300,
    "M3 Max (40-core GPU)": 400,
    "M4": 120,
    "M4 Pro": 273,
    "M4 Max (32-core GPU)": 410,
    "M4 Max (40-core GPU)": 546,
    "M1/M2 Ultra": 800,
}
_MANIFEST_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "uint32": 4}
# Embedding tables are gathered: a step reads one row of each (text, 16 audio, 8 depformer).
_TABLE_PREFIXES = ("text_emb.", "audio_embs.")


def weight_bytes_per_step(manifest: Path) -> tuple[int, int]:
    """(file bytes, weight bytes one LM step reads) from a `moshiko_mlx_*.tsv` manifest.

    Every matrix is read once per step (each depformer slice's own weights once); of the
    embedding tables only the looked-up row (and its scales/biases row) is read.
    """
    total = read = 0
    for line in manifest.read_text().splitlines()[1:]:
        name, shape, dtype = line.split("\t")
        dims = [int(d) for d in shape.split(",")]
        size = int(np.prod(dims)) * _MANIFEST_BYTES[dtype]
        total += size
        is_table = name.startswith(_TABLE_PREFIXES) or ".emb." in name
        read += size // dims[0] if is_table else size
    return total, read


def format_floor(formats_dir: Path) -> str:
    """Markdown table: ms per step at each chip's bandwidth, for the published 7B files."""
    config = LmConfig.moshi_7b()
    kv_full = kv_cache_bytes(config, mx.bfloat16)
    variants = {
        q: weight_bytes_per_step(formats_dir / f"moshiko_mlx_{q}.tsv") for q in ("bf16", "q8", "q4")
    }
    lines = ["| | " + " | ".join(variants) + " |", "|---|" + "---:|" * len(variants)]
    lines.append("| file GB | " + " | ".join(f"{t / 1e9:.2f}" for t, _ in variants.values()) + " |")
    lines.append(
        "| weights read per step, GB | "
        + " | ".join(f"{r / 1e9:.2f}" for _, r in variants.values())
        + " |"
    )
    lines.append(
        f"| + KV cache at {config.context} positions, GB | "
        + " | ".join(f"{(r + kv_full) / 1e9:.2f}" for _, r in variants.values())
        + " |"
    )
    lines += [
        "",
        "| chip | GB/s | " + " | ".join(f"{q} ms (full context)" for q in variants) + " |",
        "|---|---:|" + "---:|" * len(variants),
    ]
    for chip, gbs in APPLE_BANDWIDTH_GBS.items():
        cells = [
            f"{r / gbs / 1e6:.1f} ({(r + kv_full) / gbs / 1e6:.1f})" for _, r in variants.values()
        ]
        lines.append(f"| {chip} | {gbs} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


# Report -----------------------------------------------------------------------------------
def _ms(value: float) -> str:
    """A table cell of milliseconds: 2 decimals, none from 100 s (the persona part's 7B
    prompts run to an hour here)."""
    return f"{value:>10.2f}" if value < 1e5 else f"{value:>10.0f}"


def _metric_rows(case: dict, names: tuple[str, ...]) -> list[tuple[str, float, float]]:
    return [(n, case[n]["p50"], case[n]["p95"]) for n in names if case.get(n) is not None]


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


# Rows of the `tts` part, per batch size (`tts_result`).
TTS_METRICS = ("ttfa_ms", "ttfd_ms", "frame_ms", "step_ms", "decode_ms")


def _tts_line(label: str, data: dict, batches: list[int]) -> str:
    """The `tts` case's real-time factor at batch 1 and audio per second of each batch."""
    parts = []
    for batch in batches:
        if f"error_b{batch}" in data:
            parts.append(f"batch {batch} failed: {data[f'error_b{batch}']}")
            continue
        figure = f"batch {batch}: {data[f'audio_per_s_b{batch}']:.3f} s of audio/s"
        if batch == 1:
            figure = f"batch 1: real-time factor {data['real_time_factor_b1']:.3f}"
        elif "audio_per_s_b1" in data:
            figure += f" ({data[f'audio_per_s_b{batch}'] / data['audio_per_s_b1']:.2f}x batch 1)"
        parts.append(f"{figure}, first audio at step {data[f'first_audio_step_b{batch}']}")
    return f"  {label}: " + "; ".join(parts)


def format_table(results: list[dict]) -> str:
    """One row per (case, metric): p50, p95, and ours/Kyutai's p50 where both ran."""
    header = f"{'part':<9}{'shape':<13}{'quant':<6}{'impl':<18}{'metric':<14}"
    header += f"{'p50 ms':>10}{'p95 ms':>10}{'ratio':>8}{'peak GB':>9}"
    lines = [header, "-" * len(header)]
    metrics = {
        "lm": ("step_ms", "temporal_ms", "depformer_ms", "sampling_ms", "host_ms", "eval_ms"),
        "mimi": ("encode_ms", "decode_ms", "frame_ms", "batch_encode_ms", "batch_decode_ms"),
        "pipeline": ("frame_ms", "host_ms"),
        "echo": ("frame_ms",),
        "web": ("decode_ms", "encode_ms", "websocket_ms", "overhead_ms"),
        "kv": ("step_ms",),
        "kv-fidelity": (),
        "persona": PERSONA_METRICS,
    }
    shown: set[int] = set()  # Kyutai's result is shared by the cases of each dtype of ours
    for case in results:
        if case["part"] == "tts":
            metrics["tts"] = tuple(f"{m}_b{b}" for b in case["batches"] for m in TTS_METRICS)
        theirs = case.get("kyutai")
        for impl, data in (("ours", case["ours"]), ("kyutai", theirs)):
            if data is None or id(data) in shown:
                continue
            shown.add(id(data))
            if impl == "kyutai":
                label = "kyutai"
            elif case["part"] in ("lm", "persona", "tts"):
                label = f"ours-{data['dtype']}"
            elif case["part"] in ("kv", "kv-fidelity"):
                label = f"{data['kv']}-{data['dtype']}"
            elif case["part"] in ("pipeline", "web"):
                label = f"{data['backend']}-{data.get('dtype', '')}".rstrip("-")
            else:
                label = data["backend"]
            peak = data.get("peak_memory_gb")
            for i, (name, p50, p95) in enumerate(_metric_rows(data, metrics[case["part"]])):
                ratio = ""
                if impl == "ours" and theirs is not None and theirs.get(name) is not None:
                    ratio = f"{p50 / theirs[name]['p50']:.2f}"
                elif case["part"] == "kv":  # against the unquantized cache, stepped in turn
                    ratio = f"{data['ratio']:.2f}"
                elif case["part"] == "persona" and name in data["ratios"]:
                    ratio = f"{data['ratios'][name]:.2f}"
                row = f"{case['part']:<9}{case.get('shape', '-'):<13}{case.get('quant', '-'):<6}"
                row += f"{label:<18}{name:<14}{_ms(p50)}{_ms(p95)}{ratio:>8}"
                row += f"{peak:>9.2f}" if (i == 0 and peak is not None) else f"{'':>9}"
                lines.append(row)
            if data.get("syncs_per_step") is not None:
                ops = data["graph_ops"]
                lines.append(
                    f"  syncs per step {data['syncs_per_step']:.2f}, graph ops per step "
                    f"{ops['eager']} eager, {ops['compiled']} compiled"
                )
            for span in ("all_steps", "past_recent"):
                if data.get(span) is not None:
                    fig = data[span]
                    text, audio = fig["agreement"]
                    lines.append(
                        f"  {label} {span} of {data['steps']}: relative logit error text "
                        f"{fig['text_error']:.2e}, depformer {fig['audio_error']:.2e}; greedy "
                        f"agreement {text:.1%} / {audio:.1%}"
                    )
            if case["part"] == "persona":
                lines.extend(_persona_lines(data))
            if case["part"] == "tts":
                lines.append(_tts_line(label, data, case["batches"]))
            if "real_time_factor" in data:
                extra = f"  real-time factor {data['real_time_factor']:.3f}"
                if data.get("first_audio_ms") is not None:
                    extra += f", first audio frame after {data['first_audio_ms']:.0f} ms"
                if data.get("syncs_per_frame") is not None:
                    extra += f", syncs per frame {data['syncs_per_frame']:.2f}"
                lines.append(extra)
    return "\n".join(lines)


PARTS = ("lm", "mimi", "pipeline", "echo", "web", "kv", "kv-fidelity", "persona", "stt", "tts")


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes",
        type=_csv,
        default=["tiny", "1b"],
        help="tiny,1b,7b,7b-structure,stt-1b; tts part: tts-tiny,tts-small,tts-1.6b",
    )
    parser.add_argument("--quant", type=_csv, default=["bf16", "q4"], help="bf16,q8,q4")
    parser.add_argument(
        "--parts",
        type=_csv,
        default=["lm", "mimi", "pipeline", "echo"],
        help="lm,mimi,pipeline,echo,web,kv,kv-fidelity,persona,stt,tts (stt: shape stt-1b)",
    )
    parser.add_argument(
        "--streams", type=int, default=8, help="stt, tts: streams (requests) in one batch"
    )
    parser.add_argument(
        "--kv-bits", type=_csv, default=["none", "8", "4"], help="KV caches of --parts kv"
    )
    parser.add_argument("--codec", type=_csv, default=["mlx", "rustymimi"], help="mlx,rustymimi")
    parser.add_argument("--steps", type=int, default=50, help="measured LM steps per case")
    parser.add_argument("--split-steps", type=int, default=20, help="steps timed part by part")
    parser.add_argument(
        "--dtype", type=_csv, default=["auto"], help="our compute dtype(s): auto,bf16,f32"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="LM runs per case, alternating with Kyutai's"
    )
    parser.add_argument("--frames", type=int, default=20, help="measured Mimi/pipeline frames")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--batch-seconds", type=float, default=10.0, help="batch Mimi encode/decode (0: skip)"
    )
    parser.add_argument(
        "--prompt-steps", type=int, default=300, help="persona: the prompt's steps (runs)"
    )
    parser.add_argument(
        "--prefill-steps", type=int, default=0, help="persona: prompt steps prefilled (0: all)"
    )
    parser.add_argument(
        "--replay-steps", type=int, default=0, help="persona: prompt steps replayed (0: all)"
    )
    parser.add_argument(
        "--persona-rounds", type=int, default=3, help="persona: prefills and cached starts timed"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--weights-dir", type=Path, help="keep/reuse random weights here")
    parser.add_argument("--kyutai", action="store_true", help="also run Kyutai's moshi_mlx")
    parser.add_argument("--kyutai-python", default=KYUTAI_PYTHON)
    parser.add_argument("--json", type=Path, help="write all results here")
    parser.add_argument(
        "--floor", action="store_true", help="print the 7B bandwidth floor per Apple chip and exit"
    )
    parser.add_argument(
        "--formats-dir",
        type=Path,
        default=SCRIPTS.parent / "tests" / "manifests",
        help="folder of the published checkpoints' .tsv manifests",
    )
    args = parser.parse_args(argv)
    for name, allowed in (
        ("shapes", {**LM_SHAPES, **TTS_SHAPES}),
        ("quant", QUANT_BITS),
        ("parts", PARTS),
        ("kv_bits", ("none", "8", "4")),
        ("codec", ("mlx", "rustymimi")),
        ("dtype", DTYPES),
    ):
        unknown = set(getattr(args, name)) - set(allowed)
        if unknown:
            parser.error(f"--{name}: unknown {', '.join(sorted(unknown))}")
    lm_contexts = [LM_SHAPES[shape]["context"] for shape in args.shapes if shape in LM_SHAPES]
    context = min(lm_contexts, default=LM_SHAPES["tiny"]["context"])
    if not 2 * SILENCE_FRAMES <= args.prompt_steps < context:
        parser.error(f"--prompt-steps: from {2 * SILENCE_FRAMES} to {context - 1}")
    if args.persona_rounds < 1 or min(args.prefill_steps, args.replay_steps) < 0:
        parser.error("--persona-rounds must be >= 1, --prefill-steps and --replay-steps >= 0")
    return args


def tts_shapes(shapes: list[str]) -> list[str]:
    """The TTS shapes of `--shapes`; tts-small when it names none."""
    return [shape for shape in shapes if shape in TTS_SHAPES] or ["tts-small"]


def run_tts_cases(args: argparse.Namespace, folder: Path) -> list[dict]:
    """The `tts` part: per TTS shape and dtype of ours, `--rounds` rounds of our TTS at batch
    1 and `--streams` and, with `--kyutai`, of Kyutai's on the same files (theirs first in
    each round, then ours: a slow spell of the machine hits both); statistics over the
    rounds' samples. Our model is loaded and warmed up once per case."""
    mimi_file = mimi_weights(folder)
    batches = sorted({1, args.streams})
    cases = []
    for shape in tts_shapes(args.shapes):
        tts_dir = tts_weights(folder, shape, max(batches))
        extra = ["--mimi", str(mimi_file), "--batches", ",".join(map(str, batches))]
        extra += [
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--seed",
            str(args.seed),
        ]
        theirs_runs, ours_runs = [], {dtype: [] for dtype in args.dtype}
        models: dict[str, TtsModel] = {}
        for _ in range(args.rounds):
            if args.kyutai:
                theirs_runs.append(run_kyutai(args.kyutai_python, "tts", tts_dir, extra))
            for dtype in args.dtype:
                ours, models[dtype] = bench_tts(
                    tts_dir, mimi_file, batches, args.steps, args.warmup, args.seed,
                    DTYPES[dtype], models.get(dtype),
                )  # fmt: skip
                ours_runs[dtype].append(ours)
        models.clear()
        theirs = pool_tts(theirs_runs, batches) if theirs_runs else None
        for dtype in args.dtype:
            case = {"part": "tts", "shape": shape, "quant": "bf16", "batches": batches}
            case.update(ours=pool_tts(ours_runs[dtype], batches), kyutai=theirs)
            case["ld_preload"] = os.environ.get("LD_PRELOAD", "")
            cases.append(case)
    return cases


def run(args: argparse.Namespace, folder: Path) -> list[dict]:
    results = []
    lm_shapes = [shape for shape in args.shapes if shape in LM_SHAPES]

    def report(case: dict) -> None:  # kept for the JSON, and printed as it comes
        results.append(case)
        print(format_table([case]).split("\n", 2)[2], flush=True)

    common = ["--warmup", str(args.warmup), "--seed", str(args.seed)]
    if "lm" in args.parts:
        for shape in lm_shapes:
            for quant in args.quant:
                weights = lm_weights(folder, shape, quant)
                extra = ["--shape", shape, "--steps", str(args.steps), *common]
                extra += ["--split-steps", str(args.split_steps)]
                theirs_runs, ours_runs = [], {dtype: [] for dtype in args.dtype}
                for _ in range(args.rounds):  # alternate: theirs, ours, theirs, ours...
                    if args.kyutai:
                        theirs_runs.append(run_kyutai(args.kyutai_python, "lm", weights, extra))
                    for dtype in args.dtype:
                        ours_runs[dtype].append(
                            bench_lm(
                                weights,
                                shape,
                                args.steps,
                                args.warmup,
                                args.seed,
                                args.split_steps,
                                DTYPES[dtype],
                            )
                        )
                theirs = pool_rounds(theirs_runs) if theirs_runs else None
                for dtype in args.dtype:
                    case = {"part": "lm", "shape": shape, "quant": quant, "kyutai": theirs}
                    case["ours"] = pool_rounds(ours_runs[dtype])
                    report(case)
    if "mimi" in args.parts or "pipeline" in args.parts:
        mimi_file = mimi_weights(folder)
    if "mimi" in args.parts:
        for backend in args.codec:
            case = {"part": "mimi", "codec": backend}
            case["ours"] = bench_codec(mimi_file, backend, args.frames, args.warmup, args.seed)
            if args.batch_seconds > 0:
                case["ours"].update(
                    bench_codec_batch(mimi_file, backend, args.batch_seconds, 2, args.seed)
                )
            if args.kyutai and backend == "mlx":
                extra = ["--frames", str(args.frames), *common]
                extra += ["--batch-seconds", str(args.batch_seconds)]
                case["kyutai"] = run_kyutai(args.kyutai_python, "mimi", mimi_file, extra)
            report(case)
    if "pipeline" in args.parts:
        for shape in lm_shapes:
            for quant in args.quant:
                lm_file = lm_weights(folder, shape, quant)
                for dtype in args.dtype:
                    for backend in args.codec:
                        case = {"part": "pipeline", "shape": shape, "quant": quant}
                        case["ours"] = bench_pipeline(
                            lm_file,
                            mimi_file,
                            shape,
                            backend,
                            args.frames,
                            args.warmup,
                            args.seed,
                            DTYPES[dtype],
                        )
                        report(case)
    if "echo" in args.parts:
        case = {"part": "echo", "ours": bench_echo(max(args.frames, 100), args.warmup, args.seed)}
        report(case)
    kv_benches = {"kv": bench_kv_caches, "kv-fidelity": bench_kv_fidelity}
    for part in [part for part in kv_benches if part in args.parts]:
        kv_bits = [None if kv == "none" else int(kv) for kv in args.kv_bits]
        if part == "kv-fidelity":  # each quantized cache against the unquantized one
            kv_bits = [bits for bits in kv_bits if bits is not None]
        for shape in lm_shapes:
            for quant in args.quant:
                weights = lm_weights(folder, shape, quant)
                for dtype in args.dtype:
                    for ours in kv_benches[part](
                        weights, shape, kv_bits, args.steps, args.seed, DTYPES[dtype]
                    ):
                        case = {"part": part, "shape": shape, "quant": quant, "ours": ours}
                        report(case)
    if "stt" in args.parts:
        mimi_file = mimi_weights(folder)
        for shape in [shape for shape in lm_shapes if shape.startswith("stt")]:
            for quant in args.quant:
                for backend in args.codec:
                    ours = bench_stt(
                        lm_weights(folder, shape, quant), mimi_file, shape, backend,
                        args.streams, args.steps, args.seed,
                    )  # fmt: skip
                    results.append({"part": "stt", "shape": shape, "quant": quant, "ours": ours})
                    for window in ("start", "full"):
                        print(
                            f"stt {shape} {quant} {backend} ({window} window): 1 stream "
                            f"{ours[f'{window}_step_ms_1']:.0f} ms/step "
                            f"({ours[f'{window}_audio_per_s_1']:.2f} s of audio/s); "
                            f"{args.streams} streams "
                            f"{ours[f'{window}_step_ms_{args.streams}']:.0f} ms/step "
                            f"({ours[f'{window}_audio_per_s_{args.streams}']:.2f} s/s): "
                            f"{ours[f'{window}_speedup']:.2f}x",
                            flush=True,
                        )
    if "persona" in args.parts:
        for shape in lm_shapes:
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
                    report({"part": "persona", "shape": shape, "quant": quant, "ours": ours})
    if "tts" in args.parts:
        for case in run_tts_cases(args, folder):
            report(case)
    if "web" in args.parts:
        frames = max(args.frames, 10)
        case = {"part": "web", "ours": bench_web(frames, args.warmup, args.seed)}
        report(case)
    return results


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if args.floor:
        print(format_floor(args.formats_dir))
        return []
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.weights_dir or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        results = run(args, folder)
    print()
    print(format_table([case for case in results if case["part"] != "stt"]))  # stt: printed
    if args.json is not None:
        report = {
            "machine": {
                "platform": platform.platform(),
                "processor": platform.processor(),
                "mlx": mx.__version__,
                "device": str(mx.default_device()),
            },
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "results": results,
        }
        args.json.write_text(json.dumps(report, indent=2))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
