"""The `serve` part: `python -m moshi_mlx serve` as a client sees it, a real server process on
a loopback port over tiny random STT, TTS and LLM models built in a temp folder: the first
audio of `/api/tts_streaming` after the first word (one `Text` message per word, as Unmute
sends), how far a live STT stream (80 ms frames in real time) and a TTS stream trail real
time, alone and while a `/v1/chat/completions` stream runs beside them, the same for two STT
and two TTS streams at once beside the LLM (batched: one step per frame for each kind), and
the requests per second of `POST /v1/audio/transcriptions` on a 10 s file."""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from bench_stats import summarize

from moshi_mlx.checkpoints.spec import CONFIG_FILE
from moshi_mlx.models.config_sections import SttTiming
from moshi_mlx.models.lm import LmConfig
from moshi_mlx.testing.checkpoints import write_random_lm_checkpoint
from moshi_mlx.tts.voices import DEFAULT_VOICE

from ..part import Part
from ..weights import TTS_TOKENIZER, mimi_weights, tts_weights
from .web import _voiced_frames

ROOT = Path(__file__).resolve().parents[3]
FRAME = 1920  # 80 ms at 24 kHz
FRAME_SECONDS = 0.08
HEADERS = {"kyutai-api-key": "public_token"}
SENTENCE = "hello there this is a short answer spoken one word at a time"
TRANSCRIBED_SECONDS = 10
MODEL_ID = {"sig": "1e68beda", "epoch": 240}
START_SECONDS = 300


def _stt_folder(root: Path, mimi: Path, tokenizer: Path) -> None:
    """A tiny random STT laid out like kyutai/stt-1b-en_fr (config.json naming its files)."""
    folder = root / "stt"
    folder.mkdir(parents=True)
    config = LmConfig(
        dim=32, num_heads=2, num_layers=2, hidden_scale=2.0, context=40, card=2048,
        text_card=400, n_q=32, dep_q=0, delays=(0,) * 33, model_type="stt",
        extra_heads_num_heads=4, stt_config=SttTiming(0.5, 0.0),
    )  # fmt: skip
    write_random_lm_checkpoint(folder / "model.safetensors", config, seed=11)
    names = {"moshi_name": "model.safetensors", "mimi_name": mimi.name}
    names["tokenizer_name"] = tokenizer.name
    (folder / CONFIG_FILE).write_text(json.dumps({**config.to_dict(), **names}, indent=2))
    for source in (mimi, tokenizer):
        (folder / source.name).symlink_to(source)


def _tts_folders(root: Path, mimi: Path) -> None:
    """The bench's tts-tiny with a model id and Mimi beside it, and a voice repo holding the
    default voice for it."""
    folder = tts_weights(root, "tts-tiny", voices=1)
    config = json.loads((folder / CONFIG_FILE).read_text())
    config.update(mimi_name=mimi.name, model_id=MODEL_ID)
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    (folder / mimi.name).symlink_to(mimi)
    voice = root / "voices" / f"{DEFAULT_VOICE}.{MODEL_ID['sig']}@{MODEL_ID['epoch']}.safetensors"
    voice.parent.mkdir(parents=True, exist_ok=True)
    voice.symlink_to(folder / "voices" / "voice0.safetensors")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _models_listed(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/v1/models", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def start_server(folder: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m moshi_mlx serve --stt --tts --llm` on the tiny models, written once into
    `folder / "serve"` (Mimi is the bench's), once it answers."""
    from moshi_mlx.testing.llm import write_tiny_llm

    root = folder / "serve"
    stt, tts, llm, voices = root / "stt", root / "tts-tiny", root / "llm", root / "voices"
    if not (root / "written").exists():
        mimi = mimi_weights(folder)
        _tts_folders(root, mimi)
        _stt_folder(root, mimi, tts / TTS_TOKENIZER)
        write_tiny_llm(llm, max_positions=8192)
        (root / "written").touch()
    port = _free_port()
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(root / "hf"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "moshi_mlx", "serve", "--stt", str(stt), "--tts", str(tts)]
    command += ["--llm", str(llm), "--voice-repo", str(voices), "--port", str(port)]
    with open(log, "wb") as output:  # the server holds its own copy of the file
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=output, stderr=output)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_SECONDS
    while not _models_listed(base):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            tail = log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the server did not start:\n{tail}")
        time.sleep(0.2)
    return server, base


async def _llm_name(base: str) -> str:
    """The served LLM's id (the folder it was loaded from)."""
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{base}/v1/models") as reply:
        models = (await reply.json())["data"]
    return next(model["id"] for model in models if model["id"].endswith("llm"))


def _pack(message: dict) -> bytes:
    import msgpack

    return msgpack.packb(message, use_single_float=True)


async def tts_stream(base: str, words: list[str], seed: int) -> dict:
    """One `/api/tts_streaming` stream: `words` sent one per message, then `Eos`. The
    first audio after the first word, and each frame's lag behind real-time playback from
    the first frame (positive: a listener's buffer would have run dry)."""
    import aiohttp
    import msgpack

    url = f"{base.replace('http', 'ws')}/api/tts_streaming?seed={seed}"
    arrivals = []
    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, headers=HEADERS, max_msg_size=0) as ws,
    ):
        sent = time.perf_counter()
        for word in words:
            await ws.send_bytes(_pack({"type": "Text", "text": word}))
        await ws.send_bytes(_pack({"type": "Eos"}))
        async for message in ws:
            if message.type != aiohttp.WSMsgType.BINARY:
                break
            data = msgpack.unpackb(message.data)
            if data["type"] == "Audio":
                arrivals.append(time.perf_counter())
            elif data["type"] == "Error":
                raise RuntimeError(f"TTS error: {data['message']}")
    if not arrivals:
        raise RuntimeError("the TTS stream sent no audio")
    lag = [t - arrivals[0] - k * FRAME_SECONDS for k, t in enumerate(arrivals)]
    return {"first_audio_s": arrivals[0] - sent, "lag_s": lag, "frames": len(arrivals)}


async def stt_stream(base: str, frames: int, seed: int) -> dict:
    """One live `/api/asr-streaming` stream: `frames` 80 ms frames sent in real time; each
    `Step`'s lag behind the frame it answers (the server's steps count frames from 1)."""
    import aiohttp
    import msgpack

    url = f"{base.replace('http', 'ws')}/api/asr-streaming"
    pcm = _voiced_frames(frames, seed)
    sent: list[float] = []
    lag: list[float] = []
    words = 0

    async def listen(ws) -> None:
        nonlocal words
        async for message in ws:
            if message.type != aiohttp.WSMsgType.BINARY:
                return
            data = msgpack.unpackb(message.data)
            if data["type"] == "Step" and 0 < data["step_idx"] <= len(sent):
                lag.append(time.perf_counter() - sent[data["step_idx"] - 1])
                if data["step_idx"] >= frames:
                    return
            elif data["type"] == "Word":
                words += 1
            elif data["type"] == "Error":
                raise RuntimeError(f"STT error: {data['message']}")

    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(url, headers=HEADERS, max_msg_size=0) as ws,
    ):
        listening = asyncio.create_task(listen(ws))
        start = time.perf_counter()
        for index, frame in enumerate(pcm):
            await asyncio.sleep(max(0.0, start + index * FRAME_SECONDS - time.perf_counter()))
            sent.append(time.perf_counter())
            await ws.send_bytes(_pack({"type": "Audio", "pcm": frame.tolist()}))
        await asyncio.wait_for(listening, timeout=60 + frames * FRAME_SECONDS)
    return {"lag_s": lag, "steps": len(lag), "words": words}


async def llm_stream(base: str, stop: asyncio.Event) -> int:
    """A streamed `/v1/chat/completions` answer, read until `stop`: its chunks."""
    import aiohttp

    body = {"model": await _llm_name(base), "stream": True, "max_tokens": 4000}
    body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    chunks = 0
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"{base}/v1/chat/completions", json=body) as reply,
    ):
        reply.raise_for_status()
        async for line in reply.content:
            if stop.is_set() or line.strip() == b"data: [DONE]":
                break
            chunks += line.startswith(b"data: ")
    return chunks


async def beside_llm(base: str, stream) -> tuple[dict, int]:
    """`stream` (a coroutine) while a chat answer streams beside it; the chunks it got."""
    stop = asyncio.Event()
    llm = asyncio.create_task(llm_stream(base, stop))
    await asyncio.sleep(0.3)  # the answer is under way
    try:
        result = await stream
    finally:
        stop.set()
    return result, await llm


def _wav(seconds: int, seed: int) -> bytes:
    import soundfile

    buffer = io.BytesIO()
    pcm = _voiced_frames(round(seconds / FRAME_SECONDS), seed).reshape(-1)
    soundfile.write(buffer, pcm, 24_000, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


async def transcriptions(base: str, requests: int, seed: int) -> dict:
    """`requests` transcriptions of a 10 s WAV one after the other: requests per second."""
    import aiohttp

    wav = _wav(TRANSCRIBED_SECONDS, seed)
    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(requests):
            form = aiohttp.FormData()
            form.add_field("model", "stt")
            form.add_field("file", wav, filename="speech.wav", content_type="audio/wav")
            start = time.perf_counter()
            async with session.post(f"{base}/v1/audio/transcriptions", data=form) as reply:
                reply.raise_for_status()
                await reply.json()
            times.append(time.perf_counter() - start)
    return {"requests_per_s": len(times) / sum(times), "request_s": summarize(times)}


async def two_and_two(base: str, frames: int, words: list[str], seed: int) -> dict:
    """Two live STT streams and two TTS streams at once (the second of each 0.2 s after the
    first), beside a chat answer: each kind's lag over its streams, and the LLM's chunks."""

    async def later(stream, delay: float) -> dict:
        await asyncio.sleep(delay)
        return await stream

    streams = asyncio.gather(
        stt_stream(base, frames, seed),
        later(stt_stream(base, frames, seed + 1), 0.2),
        tts_stream(base, words, seed),
        later(tts_stream(base, words[::-1], seed + 1), 0.2),
    )
    (stt_a, stt_b, tts_a, tts_b), chunks = await beside_llm(base, streams)
    return {
        "stt_lag_2x2_with_llm_ms": summarize(stt_a["lag_s"] + stt_b["lag_s"]),
        "tts_lag_2x2_with_llm_ms": summarize(tts_a["lag_s"] + tts_b["lag_s"]),
        "llm_chunks_beside_2x2": chunks,
    }


async def _measure(base: str, frames: int, runs: int, requests: int, seed: int) -> dict:
    words = SENTENCE.split()[: max(3, frames // 2)]  # speech about as long as the STT stream
    await tts_stream(base, words[:1], seed)  # warm-up: every path compiled once
    await stt_stream(base, 3, seed)
    first_audio = [(await tts_stream(base, words, seed + k))["first_audio_s"] for k in range(runs)]
    stt_alone = await stt_stream(base, frames, seed)
    stt_llm, stt_chunks = await beside_llm(base, stt_stream(base, frames, seed))
    tts_alone = await tts_stream(base, words, seed)
    tts_llm, tts_chunks = await beside_llm(base, tts_stream(base, words, seed))
    result = {
        "impl": "ours",
        "backend": "serve",
        "first_audio_ms": summarize(first_audio),
        "stt_lag_ms": summarize(stt_alone["lag_s"]),
        "stt_lag_with_llm_ms": summarize(stt_llm["lag_s"]),
        "tts_lag_ms": summarize(tts_alone["lag_s"]),
        "tts_lag_with_llm_ms": summarize(tts_llm["lag_s"]),
        "stt_steps": stt_alone["steps"],
        "tts_frames": tts_alone["frames"],
        "llm_chunks_beside_stt": stt_chunks,
        "llm_chunks_beside_tts": tts_chunks,
    }
    result.update(await two_and_two(base, frames, words, seed))
    for stream in ("stt", "tts"):
        alone, beside = result[f"{stream}_lag_ms"], result[f"{stream}_lag_with_llm_ms"]
        result[f"{stream}_lag_added_by_llm_ms"] = beside["p50"] - alone["p50"]
    if requests:
        result["transcriptions"] = await transcriptions(base, requests, seed)
    return result


def bench_serve(folder: Path, frames: int, runs: int, requests: int, seed: int) -> dict:
    """The server's figures over `frames` 80 ms STT frames, `runs` first-audio timings and
    `requests` transcriptions (none: not measured), its models written into `folder`."""
    with tempfile.TemporaryDirectory(prefix="bench_serve_") as logs:
        server, base = start_server(folder, Path(logs) / "server.log")
        try:
            return asyncio.run(_measure(base, frames, runs, requests, seed))
        finally:
            server.terminate()
            server.wait(timeout=30)


def cases(args: argparse.Namespace, folder: Path) -> Iterator[dict]:
    """One case: live streams of at least 10 frames, first audio over `--warmup` runs (at
    least one), `--warmup // 2` transcriptions (each about 30 s on a loaded 2-core CPU)."""
    runs, requests = max(args.warmup, 1), args.warmup // 2
    ours = bench_serve(folder, max(args.frames, 10), runs, requests, args.seed)
    yield {"part": "serve", "ours": ours}


def _notes(label: str, data: dict, case: dict) -> list[str]:
    added = (
        f"  LLM lag added (p50): STT {data['stt_lag_added_by_llm_ms']:+.1f} ms, "
        f"TTS {data['tts_lag_added_by_llm_ms']:+.1f} ms "
        f"({data['llm_chunks_beside_stt']}/{data['llm_chunks_beside_tts']} chunks streamed)"
    )
    lines = [added]
    if "transcriptions" in data:
        lines.append(
            f"  /v1/audio/transcriptions ({TRANSCRIBED_SECONDS} s file): "
            f"{data['transcriptions']['requests_per_s']:.2f} requests/s"
        )
    return lines


PART = Part(
    "serve",
    cases,
    metrics=lambda case: (
        "first_audio_ms",
        "stt_lag_ms",
        "stt_lag_with_llm_ms",
        "tts_lag_ms",
        "tts_lag_with_llm_ms",
        "stt_lag_2x2_with_llm_ms",
        "tts_lag_2x2_with_llm_ms",
    ),
    label=lambda data: data["backend"],
    notes=_notes,
)
