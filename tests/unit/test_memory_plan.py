"""The memory plan: published 7B figures, agreement with what MLX allocates, and its advice."""

from __future__ import annotations

import csv
import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import soundfile as sf
from conftest import MANIFESTS
from mlx.utils import tree_flatten
from tiny_moshi import cached_tiny_moshi, tiny_config, weight_flags

from moshi_mlx.chat.generate import ChatStepper
from moshi_mlx.checkpoints.header import lm_header
from moshi_mlx.checkpoints.io import SafetensorsWriter, read_safetensors
from moshi_mlx.checkpoints.mimi import load_mimi
from moshi_mlx.checkpoints.spec import output_layout
from moshi_mlx.cli.infer import main as run_inference
from moshi_mlx.errors import ConfigError
from moshi_mlx.models.lm import Lm, LmConfig
from moshi_mlx.modules.kv_quant import KVQuantization
from moshi_mlx.runtime.codec import MlxCodec
from moshi_mlx.runtime.memory_plan import (
    MemoryPlan,
    check_fits,
    codec_bytes,
    kv_cache_bytes,
    lm_weight_bytes,
    plan_memory,
    quantized_lm_weight_bytes,
    wired_memory,
)
from moshi_mlx.testing.checkpoints import load_lm

GB = 1e9
EIGHT_GB_MAC = (int(8 * GB * 2 / 3), "GPU working set")  # macOS wires about two thirds


def _manifest_layout(name: str) -> dict:
    dtypes = {"bfloat16": mx.bfloat16, "uint32": mx.uint32}
    with (MANIFESTS / f"moshiko_mlx_{name}.tsv").open() as file:
        rows = list(csv.DictReader(file, delimiter="\t"))
    return {
        r["name"]: (tuple(int(d) for d in r["shape"].split(",")), dtypes[r["dtype"]]) for r in rows
    }


def _lm(config: LmConfig, layout: dict, source: str = "the LM file"):
    """What an LM file of this layout says, as the load path works it out from its header."""
    return lm_header(layout, {}, config, source)


def test_published_7b_figures():
    config = LmConfig.moshi_7b()
    q4 = plan_memory(_lm(config, _manifest_layout("q4")), 0, mx.bfloat16, capacity=EIGHT_GB_MAC)
    assert q4.lm_bits == 4 and q4.dtype == mx.bfloat16
    assert round(q4.weights / GB, 2) == 4.81  # Kyutai's file, as loaded in bf16
    assert round(q4.kv_cache / GB, 2) == 1.57  # 32 layers x 2 x 3000 x 4096 x 2 bytes
    assert quantized_lm_weight_bytes(config, 4, mx.bfloat16) == q4.weights
    assert (
        quantized_lm_weight_bytes(config, 8, mx.bfloat16)
        == plan_memory(
            _lm(config, _manifest_layout("q8")), 0, mx.bfloat16, capacity=EIGHT_GB_MAC
        ).weights
    )
    kv8, kv4 = (
        kv_cache_bytes(config, mx.bfloat16, KVQuantization.of(bits)) / GB for bits in (8, 4)
    )
    assert round(kv8, 2) == 0.85 and round(kv4, 2) == 0.51  # each with 17 MB unquantized
    bf16 = plan_memory(_lm(config, _manifest_layout("bf16")), 0, mx.bfloat16, capacity=EIGHT_GB_MAC)
    assert bf16.lm_bits is None and round(bf16.weights / GB, 2) == 15.38
    assert "KV cache (3000 steps, unquantized)" in q4.table() and "does not fit" in q4.table()


def test_advice_names_what_fits():
    config = LmConfig.moshi_7b()
    mimi = codec_bytes("mlx", "unused", 8)
    bf16 = plan_memory(
        _lm(config, _manifest_layout("bf16")), mimi, mx.bfloat16, capacity=(11 * 10**9, "GPU")
    )
    with pytest.raises(ConfigError) as error:
        check_fits(bf16, config)
    message = str(error.value)
    assert "\n" not in message and "needs 17.39 GB" in message
    assert "it fits with quantize=4 (6.81 GB)" in message
    q4 = plan_memory(_lm(config, _manifest_layout("q4")), mimi, mx.bfloat16, capacity=EIGHT_GB_MAC)
    with pytest.raises(ConfigError) as error:
        check_fits(q4, config)
    message = str(error.value)
    assert (
        "a q4 file of group size 64 (python -m moshi_mlx quantize --group-size 64) and " in message
    )
    assert re.search(r"kv_bits=4 \(5\.2\d GB\) or kv_bits=4 context=\d+ \(5\.3\d GB\)", message)
    check_fits(replace(q4, capacity=7 * 10**9), config)  # fits: no error


def _allocated(build) -> tuple[int, object]:
    """The bytes MLX holds for what `build` returns, with MLX's buffer cache off: else an
    array may get a buffer freed during the build (a load's bf16 sources, its casts) up to
    two pages larger than it, at random as the CPU stream's frees interleave with the
    allocations: 5% and more of the tiny LM's 16 KB tables (at 7B, see `runtime.memory_plan`)."""
    mx.synchronize()
    mx.clear_cache()
    cache_limit = mx.set_cache_limit(0)
    try:
        before = mx.get_active_memory()
        built = build()
        mx.synchronize()
        return mx.get_active_memory() - before, built
    finally:
        mx.set_cache_limit(cache_limit)


@pytest.mark.parametrize("variant", ["bf16", "q8", "q4"])
def test_planned_weights_are_what_mlx_allocates(tiny_lm_checkpoints, variant):
    path = tiny_lm_checkpoints[variant]
    layout = read_safetensors(path).layout
    plan = plan_memory(_lm(LmConfig.tiny(), layout, str(path)), 0)
    allocated, lm = _allocated(lambda: load_lm(path))
    held = sum(p.nbytes for _, p in tree_flatten(lm.parameters()))
    print(f"{variant}: planned {plan.weights} B, allocated {allocated} B, parameters {held} B")
    assert lm.out_norm.weight.dtype == plan.dtype
    assert abs(plan.weights - held) <= 0.05 * held
    assert abs(plan.weights - allocated) <= 0.05 * allocated


def test_planned_codec_is_what_mlx_allocates(tiny_mimi_checkpoint, mimi_signal):
    """Weights as allocated at load, plus the streaming state once the attention caches are
    full. (MLX also keeps the buffers that the conv states are views of: 21 MB at full size,
    counted in the plan's activations.)"""
    path, config = tiny_mimi_checkpoint
    planned = codec_bytes("mlx", path, 4, config)
    allocated, codec = _allocated(lambda: MlxCodec(load_mimi(path, num_codebooks=4, config=config)))
    for _ in range(config.transformer.context // 2 + 1):  # two attention steps per frame
        mx.eval(codec.decode_step(codec.encode_step(mimi_signal(1920))), codec.state)
    allocated += sum(array.nbytes for array in codec.state)
    print(f"tiny Mimi: planned {planned} B, allocated {allocated} B")
    assert abs(planned - allocated) <= 0.05 * allocated


def _header_only_lm(folder, config: LmConfig):
    """An LM file with a complete header and no tensor data written (a sparse file: its
    data reads as zeros and takes no disk), and its config.json."""
    params = tree_flatten(Lm(config).parameters())
    layout = {name: (tuple(p.shape), mx.bfloat16) for name, p in sorted(params)}
    path = folder / "model.safetensors"
    with open(path, "wb") as file:
        SafetensorsWriter(file, layout, metadata={})
    (folder / "config.json").write_text(json.dumps(config.to_dict()))
    return path


def _silence(folder):
    path = folder / "user.wav"
    sf.write(path, np.zeros(24000, np.float32), 24000)
    return path


def test_a_model_that_does_not_fit_stops_before_reading_weights(
    tmp_path, tmp_path_factory, capsys, monkeypatch
):
    from moshi_mlx.runtime import loading

    def no_weights(*args, **kwargs):
        raise AssertionError("a weight was read")

    monkeypatch.setattr(loading, "load_strict", no_weights)
    files = cached_tiny_moshi(tmp_path_factory)
    huge = replace(LmConfig.moshi_7b(), num_layers=400, card=2048)  # about 90 GB in bf16
    moshi = _header_only_lm(tmp_path, huge)
    flags = [
        *weight_flags(files),
        "--moshi-weight",
        str(moshi),
        "--lm-config",
        str(tmp_path / "config.json"),
    ]
    user = _silence(tmp_path)
    code = run_inference([str(user), str(tmp_path / "out.wav"), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith("error: Moshi needs") and "--memory-plan" in err
    assert run_inference([str(user), str(tmp_path / "out.wav"), *flags, "--memory-plan"]) == 0
    table = capsys.readouterr().out
    assert "LM weights" in table and table.rstrip().endswith("does not fit")


def test_memory_plan_flag_and_context(tmp_path, tmp_path_factory, capsys):
    files = cached_tiny_moshi(tmp_path_factory)
    user = _silence(tmp_path)
    argv = [str(user), str(tmp_path / "out.wav"), *weight_flags(files)]
    assert run_inference([*argv, "--memory-plan", "--context", "8"]) == 0
    table = capsys.readouterr().out
    assert "KV cache (8 steps, unquantized)" in table and table.rstrip().endswith("fits")
    assert not (tmp_path / "out.wav").exists()
    context = tiny_config().context
    assert run_inference([*argv, "--context", str(context + 1)]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"--context {context + 1} is out of range: it must be between 1 and {context}" in err
    )


@pytest.mark.parametrize("app", [["moshi_mlx.local"], ["moshi_mlx", "web"]], ids=["local", "web"])
def test_memory_plan_in_the_live_apps(app, tmp_path_factory):
    files = cached_tiny_moshi(tmp_path_factory)
    command = [sys.executable, "-m", *app, "--memory-plan", *weight_flags(files)]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "LM weights" in done.stdout and done.stdout.rstrip().endswith("fits")


@pytest.mark.parametrize("kv_bits", [None, 8, 4])
def test_planned_kv_cache_is_what_mlx_allocates(kv_bits):
    """The ring grown to its full context, unquantized or packed (head dimension 64)."""
    config = replace(LmConfig.tiny(), dim=128, num_heads=2, context=300)
    lm = Lm(config)
    lm.set_dtype(mx.float32)
    mx.eval(lm.parameters())
    quantization = KVQuantization.of(kv_bits) if kv_bits else None

    def full_ring():
        ring = lm.make_ring(quantization=quantization).grown(config.context - 1)
        mx.eval(ring.keys, ring.values)
        return ring

    allocated, ring = _allocated(full_ring)
    assert ring.capacity == config.context
    planned = kv_cache_bytes(config, mx.float32, quantization)
    print(f"KV {kv_bits or 32}-bit: planned {planned} B, allocated {allocated} B")
    assert abs(planned - allocated) <= 0.05 * allocated


def test_kv_bits_flag(tmp_path, tmp_path_factory, capsys):
    files = cached_tiny_moshi(tmp_path_factory)
    argv = [str(_silence(tmp_path)), str(tmp_path / "out.wav"), *weight_flags(files)]
    # The tiny LM's heads are 16 wide: no KV group fits them, which the plan says too.
    for plan_only in (["--memory-plan"], []):
        assert run_inference([*argv, *plan_only, "--kv-bits", "4"]) == 2
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and "needs a head dimension that divides by it" in err
        assert "KV cache" not in out
    plan = plan_memory(
        _lm(LmConfig.moshi_7b(), _manifest_layout("q4")), 0, kv=KVQuantization.of(8)
    ).table()
    assert "KV cache (3000 steps, 8-bit)" in plan


def _personaplex_layout() -> dict:
    """PersonaPlex's published file (nvidia/personaplex-7b-v1) from Kyutai's PyTorch layout:
    the depformer stored for 16 steps (8 more for the user's codebooks)."""
    with (MANIFESTS / "moshiko_pytorch_bf16.tsv").open() as file:
        rows = list(csv.DictReader(file, delimiter="\t"))
    layout = {r["name"]: tuple(int(d) for d in r["shape"].split(",")) for r in rows}
    for name, shape in list(layout.items()):
        parts = name.split(".")
        if parts[0] in ("depformer_in", "linears") and parts[1] == "0":
            layout.update({f"{parts[0]}.{k}.weight": shape for k in range(8, 16)})
        elif parts[0] == "depformer_emb" and parts[1] == "0":  # depformer_emb.k feeds step k + 1
            layout.update({f"depformer_emb.{k}.weight": shape for k in range(7, 15)})
        elif name.startswith("depformer.layers.") and parts[3] == "gating" and parts[4] == "0":
            for k in range(8, 16):
                layout[name.replace("gating.0.", f"gating.{k}.")] = shape
        elif name.startswith("depformer.layers.") and parts[3] == "self_attn":
            layout[name] = (2 * shape[0], *shape[1:])
    return {name: (shape, mx.bfloat16) for name, shape in layout.items()}


def test_personaplex_plans_the_slices_it_samples_and_fits_8_gb_as_moshi():
    """q4 of group size 64 with a 4-bit KV cache: what the plan advises Moshi on 8 GB."""
    layout = _personaplex_layout()
    assert round(sum(np.prod(s) for s, _ in layout.values()) / 1e9, 2) == 8.37  # 16-step file
    personaplex, moshi = LmConfig.personaplex_7b(), LmConfig.moshi_7b()
    mimi = codec_bytes("mlx", "unused", 8)
    plans = [
        plan_memory(_lm(config, file_layout), mimi, mx.bfloat16, capacity=EIGHT_GB_MAC)
        for config, file_layout in ((personaplex, layout), (moshi, _manifest_layout("bf16")))
    ]
    assert plans[0].weights == plans[1].weights  # the user's 8 slices are never loaded
    kv4 = KVQuantization.of(4)
    for config in (personaplex, moshi):
        q4 = replace(
            plans[0],
            weights=quantized_lm_weight_bytes(config, 4, mx.bfloat16, group_size=64),
            kv_cache=kv_cache_bytes(config, mx.bfloat16, kv4),
            kv=kv4,
        )
        assert q4.fits, q4.table()


def test_hibiki_plans_its_condition_and_two_kv_rows():
    """A conditioned model's plan holds the condition tables (in the weights) and a KV ring
    of 2 rows (guidance), which is what a guided `ChatStepper` allocates."""
    hibiki = Path(__file__).parents[1] / "fixtures" / "hibiki"
    config = LmConfig.from_dict(json.loads((hibiki / "config.json").read_text()))
    layout = read_safetensors(hibiki / "weights.safetensors").layout
    plan = plan_memory(_lm(config, layout), 0, mx.float32, capacity=(1 << 40, "test"))
    plain = replace(config, conditioners=(), model_type="moshi")
    assert plan.kv_cache == 2 * kv_cache_bytes(plain, mx.float32)
    assert "2 rows: guidance" in plan.table()
    conditioner = sum(
        math.prod(shape) for name, (shape, _) in layout.items() if name.startswith("condition_")
    )
    assert conditioner > 0
    lm = Lm(config)
    lm.set_dtype(mx.float32)
    gen = ChatStepper(lm, cfg_coef=3.0)
    gen.reserve(lm.config.attention_window)
    ring = sum(a.nbytes for a in (*gen.ring.keys, *gen.ring.values))
    assert ring == plan.kv_cache


def test_wired_memory_waits_for_queued_work_before_restoring_the_limit(monkeypatch):
    """As mlx-lm's `wired_limit`: the block's work is synchronised before the old wired limit
    is put back (on Apple GPUs; here MLX's calls are recorded, as the CPU has no wired memory)."""
    calls: list[tuple] = []
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "set_wired_limit", lambda limit: calls.append(("limit", limit)) or 7)
    monkeypatch.setattr(mx, "synchronize", lambda *stream: calls.append(("synchronize",)))
    plan = MemoryPlan(
        weights=100, kv_cache=20, codec=5, activations=5, capacity=1000, device="test",
        context=10, kv=None, dtype=mx.bfloat16, lm_bits=None,
    )  # fmt: skip
    with wired_memory(plan):
        calls.append(("work",))
    assert calls == [("limit", 130), ("work",), ("synchronize",), ("limit", 7)]


def test_hibiki_zero_figures_count_shared_slices_and_key_value_heads_once():
    """kyutai/hibiki-zero-3b-pytorch-bf16: its 16 depformer slices hold 9 weight sets in memory
    (the plan counts them once, as the file's 6.3 GB), its KV cache 8 of its 16 heads."""
    path = Path(__file__).parents[1] / "fixtures/kyutai_configs/hibiki-zero-3b-pytorch-bf16.json"
    config = LmConfig.from_dict(json.loads(path.read_text()))
    weights = {bits: quantized_lm_weight_bytes(config, bits, mx.bfloat16) / GB for bits in (4, 8)}
    assert (round(weights[4], 2), round(weights[8], 2)) == (1.96, 3.33)
    assert round(kv_cache_bytes(config, mx.bfloat16) / GB, 2) == 0.34  # 28 x 2 x 3000 x 1024 x 2
    tiny = Path(__file__).parents[1] / "fixtures/hibiki_zero"
    lm = load_lm(tiny / "weights.safetensors", dtype=mx.float32)
    held = {id(v): v.nbytes for _, v in tree_flatten(lm.parameters())}  # shared arrays once
    shapes = {name: tuple(p.shape) for name, p in tree_flatten(lm.parameters())}
    planned = lm_weight_bytes(output_layout(shapes, 16, None), mx.float32, lm.config)
    assert planned == sum(held.values())
