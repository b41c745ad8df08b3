"""Measure Kyutai's own `moshi_mlx` 0.3.0 on the same random weights as `scripts/bench.py`.

Runs in Kyutai's virtual environment (it pins mlx 0.26.5), through its public classes only:

    /opt/venvs/kyutai/bin/python scripts/bench_kyutai.py lm --shape tiny \
        --weights model.q4.safetensors --steps 50 --json kyutai_lm.json
    /opt/venvs/kyutai/bin/python scripts/bench_kyutai.py lm --shape stt-1b-structure \
        --weights lm_stt.safetensors --steps 50 --json kyutai_stt.json
    /opt/venvs/kyutai/bin/python scripts/bench_kyutai.py mimi \
        --weights mimi.safetensors --frames 30 --json kyutai_mimi.json
    /opt/venvs/kyutai/bin/python scripts/bench_kyutai.py tts --weights WEIGHTS/tts-small \
        --mimi WEIGHTS/mimi.safetensors --steps 20 --batches 1,8 --json kyutai_tts.json

`bench.py --kyutai` calls it for every case, alternating with our own measurement.
LM files are in the published MLX format (bf16, or q8/q4 packed by `mlx.nn.quantize`); the
quantization is read from the file. The Mimi file is in the published PyTorch layout, which
Kyutai's MLX Mimi converts with its own `load_pytorch_weights`. A TTS folder (`bench/weights.py`'s
`tts_weights`: config.json, the LM in the published PyTorch layout, tokenizer, voices) is
loaded as Kyutai's `run_tts` loads its files, and `TTSModel.generate` timed per step. An LM shape without a depformer (`dep_q` 0, speech-to-text)
is timed as Kyutai runs STT: `LmGen.step_with_extra_heads`, greedy.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from bench_stats import FRAME_MS, LM_SHAPES, TTS_TEXTS, lm_result, summarize, tts_result
from mlx import nn


def _kyutai():
    """Kyutai's package (not ours: this script's folder, not the repo root, leads sys.path)."""
    import moshi_mlx

    if "site-packages" not in str(Path(moshi_mlx.__file__)):
        raise SystemExit(f"expected Kyutai's installed moshi_mlx, got {moshi_mlx.__file__}")
    from moshi_mlx import models, utils

    return models, utils


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(size))


def detect_quantization(path: Path, dim: int) -> tuple[int | None, int | None]:
    """(bits, group_size) of an MLX LM file, read from the `text_linear` tensors' shapes."""
    header = _safetensors_header(path)
    weight = header["text_linear.weight"]
    if weight["dtype"] != "U32":
        return None, None
    bits = weight["shape"][1] * 32 // dim
    group_size = dim // header["text_linear.scales"]["shape"][1]
    return bits, group_size


def _memory_gb() -> float:
    return mx.get_peak_memory() / 1e9


def bench_lm(
    config: dict, weights: Path, steps: int, warmup: int, seed: int, split_steps: int
) -> dict:
    """Time Kyutai's `LmGen.step` (as its run loop uses it) and its temporal/depformer split."""
    models, utils = _kyutai()
    start = time.perf_counter()
    lm_config = models.LmConfig.from_config_dict(config)
    model = models.Lm(lm_config)
    model.set_dtype(mx.bfloat16)
    bits, group_size = detect_quantization(weights, config["dim"])
    if bits is not None:
        nn.quantize(model, bits=bits, group_size=group_size)
    model.load_weights(str(weights), strict=True)
    mx.eval(model.parameters())
    load_s = time.perf_counter() - start

    rng = np.random.default_rng(seed)
    total = warmup + steps
    user_codes = rng.integers(0, config["card"], size=(total, 8)).astype(np.int32)

    def make_gen(on_text_hook=None, on_audio_hook=None):
        for cache in model.transformer_cache:
            cache.reset()
        mx.random.seed(seed)
        return models.LmGen(
            model=model,
            max_steps=total + 2,
            text_sampler=utils.Sampler(temp=0.7, top_k=25),
            audio_sampler=utils.Sampler(temp=0.8, top_k=250),
            check=False,
            on_text_hook=on_text_hook,
            on_audio_hook=on_audio_hook,
        )

    # 1. The whole step as Kyutai's own loops run it: step, text token to host, audio to host.
    mx.reset_peak_memory()
    gen = make_gen()
    step_times = []
    first_audio_step = None
    for index, codes in enumerate(user_codes):
        t0 = time.perf_counter()
        text = gen.step(mx.array(codes[None]))
        text[0].item()
        audio = gen.last_audio_tokens()
        if audio is not None:
            np.array(audio)
            if first_audio_step is None:
                first_audio_step = index
        step_times.append(time.perf_counter() - t0)
    peak_gb = _memory_gb()

    # 2. The split, through LmGen's hooks (each forces an evaluation, hence a separate run).
    marks: dict[str, float] = {}

    def on_text(token):
        mx.eval(token)
        marks["text"] = time.perf_counter()

    def on_audio(tokens):
        mx.eval(tokens)
        marks["audio"] = time.perf_counter()

    gen = make_gen(on_text, on_audio)
    temporal, depformer = [], []
    for codes in user_codes[: warmup + split_steps]:
        t0 = time.perf_counter()
        text = gen.step(mx.array(codes[None]))
        text[0].item()
        temporal.append(marks["text"] - t0)
        depformer.append(marks["audio"] - marks["text"])

    # 3. The samplers alone, on logits of the real shapes (1 text + 8 audio codebooks).
    text_sampler = utils.Sampler(temp=0.7, top_k=25)
    audio_sampler = utils.Sampler(temp=0.8, top_k=250)
    sampling = []
    for _ in range(warmup + split_steps):
        text_logits = mx.random.normal((1, 1, config["text_card"])).astype(mx.bfloat16)
        audio_logits = mx.random.normal((8, 1, 1, config["card"])).astype(mx.bfloat16)
        mx.eval(text_logits, audio_logits)
        t0 = time.perf_counter()
        tokens = [text_sampler(text_logits)[0]]
        tokens += [audio_sampler(audio_logits[k])[0] for k in range(8)]
        mx.eval(tokens)
        sampling.append(time.perf_counter() - t0)

    return {
        "impl": "kyutai",
        "mlx": mx.__version__,
        "bits": bits,
        "load_s": load_s,
        **lm_result(
            {
                "step_ms": step_times[warmup:],
                "temporal_ms": temporal[warmup:],
                "depformer_ms": depformer[warmup:],
                "sampling_ms": sampling[warmup:],
            }
        ),
        "first_audio_step": first_audio_step,
        "peak_memory_gb": peak_gb,
    }


def bench_listen(config: dict, weights: Path, steps: int, warmup: int, seed: int) -> dict:
    """Time Kyutai's STT step (a model without a depformer): `LmGen.step_with_extra_heads` on
    one frame of audio codes, greedy text as its STT config asks (temperature 0), the text
    token and the voice-activity heads read on the host."""
    models, utils = _kyutai()
    start = time.perf_counter()
    model = models.Lm(models.LmConfig.from_config_dict(config))
    model.set_dtype(mx.bfloat16)
    bits, group_size = detect_quantization(weights, config["dim"])
    if bits is not None:
        nn.quantize(model, bits=bits, group_size=group_size)
    model.load_weights(str(weights), strict=True)
    mx.eval(model.parameters())
    load_s = time.perf_counter() - start

    total = warmup + steps
    codes = np.random.default_rng(seed).integers(0, config["card"], (total, config["n_q"]))
    mx.reset_peak_memory()
    gen = models.LmGen(
        model=model,
        max_steps=total + 1,
        text_sampler=utils.Sampler(temp=0.0),
        audio_sampler=utils.Sampler(temp=0.0),
        check=False,
    )
    step_times = []
    for frame in codes.astype(np.int32):
        t0 = time.perf_counter()
        text, heads = gen.step_with_extra_heads(mx.array(frame[None]))
        mx.eval(text, heads)  # one evaluation, then both on the host
        text[0].item()
        [head.tolist() for head in heads]  # bfloat16: no numpy buffer
        step_times.append(time.perf_counter() - t0)
    return {
        "impl": "kyutai",
        "mlx": mx.__version__,
        "bits": bits,
        "load_s": load_s,
        **lm_result({"step_ms": step_times[warmup:]}),
        "first_audio_step": None,
        "peak_memory_gb": _memory_gb(),
    }


def bench_mimi(
    weights: Path,
    frames: int,
    warmup: int,
    seed: int,
    batch_seconds: float = 0.0,
    num_codebooks: int = 8,
) -> dict:
    """Time Kyutai's MLX Mimi streaming `encode_step` and `decode_step` per 80 ms frame, and
    its batch `encode` / `decode` of `batch_seconds` of audio."""
    models, _ = _kyutai()
    start = time.perf_counter()
    mimi = models.mimi.Mimi(models.mimi_202407(num_codebooks))
    # The file holds 32 codebooks and Kyutai's loader wants exactly the model's: keep the first.
    tensors = mx.load(str(weights))
    unused = [f"quantizer.rvq_rest.vq.layers.{i}." for i in range(num_codebooks - 1, 31)]
    tensors = {k: v for k, v in tensors.items() if not k.startswith(tuple(unused))}
    with tempfile.TemporaryDirectory() as tmp:
        subset = Path(tmp) / "mimi.safetensors"
        mx.save_safetensors(str(subset), tensors)
        mimi.load_pytorch_weights(str(subset), strict=True)
    mx.eval(mimi.parameters())
    load_s = time.perf_counter() - start

    rng = np.random.default_rng(seed)
    pcm = (0.1 * rng.standard_normal((warmup + frames, 1920))).astype(np.float32)
    mx.reset_peak_memory()
    mimi.reset_all()
    encode, decode = [], []
    for frame in pcm:
        t0 = time.perf_counter()
        codes = mimi.encode_step(mx.array(frame[None, None]))
        mx.eval(codes)
        t1 = time.perf_counter()
        out = mimi.decode_step(codes)
        mx.eval(out)
        t2 = time.perf_counter()
        encode.append(t1 - t0)
        decode.append(t2 - t1)
    frame = summarize([e + d for e, d in zip(encode, decode)][warmup:])
    batch = {}
    if batch_seconds > 0:  # one call on the whole signal, twice
        long_pcm = mx.array(0.1 * rng.standard_normal(int(24_000 * batch_seconds)))[None, None]
        batch_encode, batch_decode = [], []
        for _ in range(2):
            t0 = time.perf_counter()
            codes = mimi.encode(long_pcm.astype(mx.float32))
            mx.eval(codes)
            t1 = time.perf_counter()
            mx.eval(mimi.decode(codes))
            batch_encode.append(t1 - t0)
            batch_decode.append(time.perf_counter() - t1)
        batch = {
            "batch_encode_ms": summarize(batch_encode),
            "batch_decode_ms": summarize(batch_decode),
        }
    return {
        **batch,
        "impl": "kyutai",
        "mlx": mx.__version__,
        "load_s": load_s,
        "encode_ms": summarize(encode[warmup:]),
        "decode_ms": summarize(decode[warmup:]),
        "frame_ms": frame,
        "real_time_factor": FRAME_MS / frame["p50"],
        "peak_memory_gb": _memory_gb(),
    }


def _tts_model(folder: Path, mimi_file: Path, max_steps: int):
    """Kyutai's `TTSModel` over a bench TTS folder, loaded as its `run_tts` loads one: the LM
    from PyTorch names (`Lm.load_pytorch_weights`, bf16), Mimi of all generated codebooks."""
    import sentencepiece

    models, _ = _kyutai()
    from moshi_mlx.models.tts import TTSModel

    raw_config = json.loads((folder / "config.json").read_text())
    lm_config = models.LmConfig.from_config_dict(raw_config)
    model = models.Lm(lm_config)
    model.set_dtype(mx.bfloat16)
    model.load_pytorch_weights(str(folder / raw_config["moshi_name"]), lm_config, strict=True)
    mimi = models.mimi.Mimi(models.mimi_202407(lm_config.generated_codebooks))
    mimi.load_pytorch_weights(str(mimi_file), strict=True)
    tokenizer = sentencepiece.SentencePieceProcessor(str(folder / raw_config["tokenizer_name"]))
    tts = TTSModel(
        model, mimi, tokenizer, temp=0.6, cfg_coef=2.0, n_q=32, max_gen_length=max_steps,
        raw_config=raw_config,
    )  # fmt: skip
    mx.eval(model.parameters(), mimi.parameters())
    return tts


def _tts_run(tts, folder: Path, texts: list[str], steps: int) -> dict:
    """One `TTSModel.generate` of `len(texts)` requests (voice b for text b), as `run_tts`
    makes it (distilled guidance 2.0 given as the "cfg" condition, padding 1 between words),
    each produced frame decoded by Mimi as it comes (`on_frame`, as Kyutai's streaming
    script plays it), `max_gen_length` cut to the first audio frame's step plus `steps` and
    one more (which ends the last measured step).

    Returns seconds: `ttfa` (from preparing the requests to the first decoded frame), per
    step past it the whole step (`frame`: from its text hook to the next step's) and Mimi's
    decoding in it (`decode`); the first frame's step."""
    cfg_coef = tts.cfg_coef
    first_step = tts.delay_steps + max(tts.lm.delays)  # the first frame without -1 codes
    tts.max_gen_length = first_step + 2 + steps
    hooks: list[float] = []
    decodes: list[tuple[int, float, float]] = []  # (step, decode start, end)

    def on_text(_tokens) -> None:
        hooks.append(time.perf_counter())

    def on_frame(frame) -> None:
        start = time.perf_counter()
        pcm = tts.mimi.decode_step(frame[:, :, None])
        np.array(mx.clip(pcm, -1, 1))  # played: on the host
        decodes.append((len(hooks) - 1, start, time.perf_counter()))

    start = time.perf_counter()
    entries = [tts.prepare_script([text], padding_between=1) for text in texts]
    voices = [folder / "voices" / f"voice{b}.safetensors" for b in range(len(texts))]
    attributes = [tts.make_condition_attributes([voice], cfg_coef) for voice in voices]
    tts.cfg_coef = 1.0  # distilled: the guidance is a condition (as run_tts sets it)
    try:
        tts.generate(entries, attributes, on_text_hook=on_text, on_frame=on_frame)
    finally:
        tts.cfg_coef = cfg_coef
    assert decodes and decodes[0][0] == first_step, (decodes[:1], first_step)
    measured = decodes[1 : 1 + steps]
    frame = [hooks[t + 1] - hooks[t] for t, _, _ in measured]
    decode = [stop - begin for _, begin, stop in measured]
    return {
        "ttfa": decodes[0][2] - start,  # their first frame is played: no frame skipped
        "frame": frame,
        "decode": decode,
        "first_step": decodes[0][0] + 1,  # steps run when it came
    }


def bench_tts(
    folder: Path, mimi_file: Path, batches: list[int], steps: int, warmup: int, seed: int
) -> dict:
    """Kyutai's `TTSModel` on a bench TTS folder (`bench/weights.py`'s `tts_weights`), per batch size:
    a warm-up generation (`warmup` steps past the first audio) then a measured one."""
    start = time.perf_counter()
    tts = _tts_model(folder, mimi_file, 1)
    load_s = time.perf_counter() - start
    result: dict = {"impl": "kyutai", "mlx": mx.__version__, "load_s": load_s}
    for batch in batches:
        texts = TTS_TEXTS[:batch]
        try:
            mx.random.seed(seed)
            _tts_run(tts, folder, texts, warmup)
            mx.reset_peak_memory()
            mx.random.seed(seed)
            run = _tts_run(tts, folder, texts, steps)
        except Exception as exc:  # noqa: BLE001 (reported: e.g. a batch it cannot run)
            result[f"error_b{batch}"] = f"{type(exc).__name__}: {exc}"
            continue
        step = [f - d for f, d in zip(run["frame"], run["decode"])]
        result.update(tts_result(batch, run["ttfa"], run["ttfa"], run["first_step"],
                                 run["frame"], step, run["decode"], _memory_gb()))  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=["lm", "mimi", "tts"])
    parser.add_argument("--weights", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(LM_SHAPES), help="LM shape (for part lm)")
    parser.add_argument("--config", type=Path, help="a Kyutai config.json instead of --shape")
    parser.add_argument("--steps", type=int, default=50, help="measured LM steps")
    parser.add_argument("--split-steps", type=int, default=20, help="steps timed part by part")
    parser.add_argument("--frames", type=int, default=30, help="measured Mimi frames")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch-seconds", type=float, default=0.0, help="batch Mimi encode")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mimi", type=Path, help="tts: the Mimi file (PyTorch layout)")
    parser.add_argument("--batches", default="1,8", help="tts: batch sizes, e.g. 1,8")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)

    if args.part == "lm":
        if args.config is not None:
            config = json.loads(args.config.read_text())
        elif args.shape is not None:
            config = LM_SHAPES[args.shape]
        else:
            parser.error("part lm needs --shape or --config")
        if config["dep_q"] == 0:  # speech-to-text
            result = bench_listen(config, args.weights, args.steps, args.warmup, args.seed)
        else:
            result = bench_lm(
                config, args.weights, args.steps, args.warmup, args.seed, args.split_steps
            )
    elif args.part == "tts":
        if args.mimi is None:
            parser.error("part tts needs --mimi")
        batches = [int(b) for b in args.batches.split(",")]
        result = bench_tts(args.weights, args.mimi, batches, args.steps, args.warmup, args.seed)
    else:
        result = bench_mimi(args.weights, args.frames, args.warmup, args.seed, args.batch_seconds)
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.write_text(text)
    print(text)


if __name__ == "__main__":
    sys.exit(main())
