"""Random checkpoints in the published formats, for tests and the bench, and what compares
two LMs on them.

Real weights cannot be part of a test; these writers produce files with Kyutai's exact names,
shapes and dtypes (LM: MLX bf16/q8/q4; Mimi: the PyTorch layout; TTS LM: the PyTorch layout
of kyutai/tts-1.6b-en_fr), filled with random values at the scale of a trained model's, so the
loaders and the whole pipeline run on them. Voice embeddings: `moshi_mlx.testing.voices`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from moshi_mlx.checkpoints.io import SafetensorsWriter
from moshi_mlx.checkpoints.lm import quantize_lm
from moshi_mlx.checkpoints.mimi import MIMI_CONFIG_KEY, TensorEntry, mimi_tensor_table
from moshi_mlx.checkpoints.spec import CONFIG_FILE, LM_FILES
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.models.mimi import MimiConfig
from moshi_mlx.runtime.loading import LoadOptions, load_parts


def _save_safetensors_lazily(path: str | Path, tensors: dict[str, mx.array]) -> None:
    """Write lazy arrays to a safetensors file, evaluating and releasing one at a time.

    Memory stays at about one tensor, so a 7B-sized random checkpoint never sits in memory
    whole. `tensors` is emptied as it is written.
    """
    layout = {name: (tuple(tensors[name].shape), tensors[name].dtype) for name in sorted(tensors)}
    with open(path, "wb") as file:
        writer = SafetensorsWriter(file, layout, metadata={})
        for name in layout:
            array = tensors.pop(name)
            mx.eval(array)
            writer.write_rows(name, 0, array)
            del array
        writer.check_complete()


def _random_weights(model: Lm, seed: int) -> dict[str, mx.array]:
    """Uniform weights with variance 1/fan_in (cheaper to draw than Gaussians at 7B scale),
    norm gains in [0.8, 1.2]."""
    params = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    weights = {}
    for (name, p), key in zip(params, keys):
        if p.ndim == 1:
            weights[name] = mx.random.uniform(0.8, 1.2, p.shape, key=key)
        else:
            bound = (3 / p.shape[-1]) ** 0.5
            weights[name] = mx.random.uniform(-bound, bound, p.shape, key=key)
    return weights


def lazy_lm(
    config: LmConfig,
    dtype: mx.Dtype = mx.bfloat16,
    bits: int | None = None,
    group_size: int | None = None,
    full_depformer: bool = False,
) -> Lm:
    """An `Lm` of `config` whose weights are not evaluated (nothing is allocated), in `dtype`,
    quantized as Kyutai's files are when `bits`: what a random checkpoint is made from."""
    model = Lm(config, full_depformer)
    model.set_dtype(dtype)
    if bits is not None:
        quantize_lm(model, bits, group_size)
    return model


def load_lm(
    path: str | Path,
    config: LmConfig | str | Path | None = None,
    dtype: mx.Dtype | None = None,
    full_depformer: bool = False,
) -> Lm:
    """The LM alone of an LM file, or of the folder holding one (its most precise), loaded
    by the one load path (`load_parts(..., lm_only=True)`); `config` an `LmConfig` or a
    config.json (default: the config.json beside the file, else what the file says)."""
    path = Path(path)
    folder, file = (path, None) if path.is_dir() else (path.parent, path)
    options = LoadOptions(
        moshi_weight=file, lm_config=config, dtype=dtype, full_depformer=full_depformer
    )
    return load_parts(str(folder), options, lm_only=True).lm


def write_random_lm_checkpoint(
    path: str | Path,
    config: LmConfig,
    bits: int | None = None,
    group_size: int | None = None,
    seed: int = 0,
    write_config: bool = False,
) -> Path:
    """Write a random checkpoint in Kyutai's MLX format (bf16, or quantized when `bits`),
    with every depformer slice of `config` (PersonaPlex's for the user's codebooks too).

    `path` is the file, or a directory that receives `model.safetensors` /
    `model.q{bits}.safetensors`. With `write_config`, Kyutai's `config.json` is written
    beside it. Returns the checkpoint's path.
    """
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path = path / LM_FILES[bits or 16][1]
    path.parent.mkdir(parents=True, exist_ok=True)
    model = lazy_lm(config, dtype=mx.float32, full_depformer=True)
    model.update(tree_unflatten(list(_random_weights(model, seed).items())))
    model.set_dtype(mx.bfloat16)
    if bits is not None:
        quantize_lm(model, bits, group_size)
    weights = dict(tree_flatten(model.parameters()))
    del model
    _save_safetensors_lazily(path, weights)
    if write_config:
        (path.parent / CONFIG_FILE).write_text(json.dumps(config.to_dict(), indent=2))
    return path


# Random codebooks at the scale of a random model's latents, so that codes vary with the input.
_RANDOM_CODEBOOK_STD = 0.005


def _random_tensor(entry: TensorEntry, rng: np.random.Generator) -> np.ndarray:
    name, shape = entry.name, entry.shape
    if entry.layout == "flag":
        return np.ones(shape, np.float32)
    if entry.layout == "cluster_usage":
        return rng.uniform(0.5, 2.0, shape).astype(np.float32)
    if entry.layout == "embedding_sum":  # scaled by the usage in write_random_mimi_checkpoint
        return rng.normal(0.0, _RANDOM_CODEBOOK_STD, shape).astype(np.float32)
    if name.endswith(("layer_scale_1.scale", "layer_scale_2.scale")):
        return np.full(shape, 0.01, np.float32)
    if ".norm" in name:
        return (np.ones(shape) if name.endswith("weight") else np.zeros(shape)).astype(np.float32)
    if len(shape) == 1:  # biases
        return rng.uniform(-0.01, 0.01, shape).astype(np.float32)
    # Like PyTorch's default init: uniform in +-1/sqrt(fan_in).
    fan_in = shape[1] * (shape[2] if len(shape) == 3 else 1)
    if entry.layout == "convtr":
        fan_in = shape[1] * shape[2]
    bound = fan_in**-0.5
    return rng.uniform(-bound, bound, shape).astype(np.float32)


def mimi_config_dict(config: MimiConfig) -> dict:
    """`config` in Kyutai's Mimi config layout (what `MimiConfig.from_dict` reads)."""
    transformer, quantizer = config.transformer, config.quantizer
    seanet = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(config.seanet).items()}
    return {
        "sample_rate": config.sample_rate,
        "frame_rate": config.frame_rate,
        "seanet": seanet,
        "transformer": {
            "d_model": transformer.d_model,
            "num_heads": transformer.num_heads,
            "num_layers": transformer.num_layers,
            "dim_feedforward": transformer.ffn_hidden,
            "context": transformer.context,
            "max_period": transformer.max_period,
            "layer_scale": transformer.layer_scale,
        },
        "quantizer": {
            "dimension": quantizer.dimension,
            "bins": quantizer.bins,
            "n_q": quantizer.total_codebooks,
            "n_q_semantic": quantizer.semantic_codebooks,
        },
    }


def write_random_mimi_checkpoint(
    path: str | Path, config: MimiConfig | None = None, seed: int = 0
) -> Path:
    """Write a random-weights Mimi checkpoint with the published names, shapes and dtypes; a
    config other than the published model's is written into the file's metadata
    (`MIMI_CONFIG_KEY`), so that the loaders build that model from the file alone."""
    from safetensors.numpy import save_file

    config = config or MimiConfig.moshi()
    rng = np.random.default_rng(seed)
    tensors = {}
    for entry in mimi_tensor_table(config):
        tensor = _random_tensor(entry, rng)
        if entry.layout == "embedding_sum":  # codebook = embedding_sum / cluster_usage
            usage = tensors[entry.name.replace("embedding_sum", "cluster_usage")]
            tensor = tensor * usage[:, None]
        tensors[entry.name] = tensor
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = None
    if config != MimiConfig.moshi():
        metadata = {MIMI_CONFIG_KEY: json.dumps(mimi_config_dict(config))}
    save_file(tensors, str(path), metadata=metadata)
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
    layout["text_linear.weight"] = ((config.get("text_card_out") or config["text_card"], dim), bf16)
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


def write_random_tts_checkpoint(path: str | Path, config: dict, seed: int = 0) -> Path:
    """Write a random TTS LM file in the published PyTorch layout (`tts_pytorch_layout` of
    Kyutai's `config.json` dict `config`: bf16, the conditioners float32), one tensor in
    memory at a time. Returns `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    layout = tts_pytorch_layout(config)
    keys = mx.random.split(mx.random.key(seed), len(layout))
    with open(path, "wb") as file:
        writer = SafetensorsWriter(file, layout, metadata={"format": "pt"})
        for (name, (dims, dtype)), key in zip(layout.items(), keys):
            array = _random_tts_tensor(name, dims, key).astype(dtype)
            mx.eval(array)
            writer.write_rows(name, 0, array)
        writer.check_complete()
    return path


def random_teacher_tokens(config: LmConfig, steps: int, seed: int) -> tuple[mx.array, mx.array]:
    """Random inputs of `chat.teacher_forcing.teacher_forced_logits`: each step's tokens (steps, K), start
    tokens included, and the depformer's previous tokens (steps, dep_q)."""
    rng = np.random.default_rng(seed)
    start = np.array(config.start_tokens)
    inputs = rng.integers(0, start, (steps, config.num_codebooks))
    previous = rng.integers(0, start[: config.dep_q], (steps, config.dep_q))
    return mx.array(inputs, mx.int32), mx.array(previous, mx.int32)


def logit_fidelity(ours: list[np.ndarray], reference: list[np.ndarray]) -> dict:
    """How closely text and audio logits (`teacher_forced_logits`' pair, on the host) track a
    reference: the relative error of each, and the share of greedy tokens they agree on."""
    pairs = list(zip(ours, reference))
    errors = [float(np.linalg.norm(q - r) / np.linalg.norm(r)) for q, r in pairs]
    agree = [float(np.mean(q.argmax(-1) == r.argmax(-1))) for q, r in pairs]
    return {"text_error": errors[0], "audio_error": errors[1], "agreement": agree}
